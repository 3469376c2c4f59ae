"""The pieces both modes share: the reference's sign pattern, butterfly and shared-exponent
fp16 (``reference/_common.py``) and the kernels' (``kernels/_common.py``) against the Rust
primitives, poisoned buffers and the harness's decoded-value check, and every kernel
specialisation compiling for Hopper."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration  # noqa: E402
from kakeyaturbo import kernels as K  # noqa: E402
from kakeyaturbo.errors import InvalidInputError  # noqa: E402
from kakeyaturbo.kernels import _common  # noqa: E402
from kakeyaturbo.reference import _common as ref  # noqa: E402

from . import harness  # noqa: E402
from .conftest import DEVICE  # noqa: E402


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("w", [1, 2, 16, 128, 256])
def test_fwht_is_the_sylvester_matrix(w: int) -> None:
    x = np.random.default_rng(w).standard_normal((3, w))
    got = ref.fwht(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, x @ hadamard(w).T, rtol=1e-12, atol=1e-12)
    x32 = x.astype(np.float32)
    # Same butterfly order as the Rust transform: bit-identical in f32.
    assert np.array_equal(ref.fwht(torch.from_numpy(x32)).numpy(), kt.wht_rows(x32))


@given(st.integers(0, 2**64 - 1), st.integers(0, 300))
def test_sign_pattern_matches_the_extension(seed: int, n: int) -> None:
    assert np.array_equal(ref.sign_pattern(seed, n).numpy(), kt.wht_sign_pattern(seed, n))


EXP_VALUES = [0.0, 1.0, 1.5, 32768.0, 32768.004, 65504.0, 65536.0, 3e38, 1e-40, 2.0**-126, 2.0**-111, 7.0]


@triton.jit
def _exponent_kernel(v_ptr, e_ptr, h_ptr, n, B: tl.constexpr):
    i = tl.arange(0, B)
    v = tl.load(v_ptr + i, mask=i < n, other=0.0)
    e = _common.shared_exponent(tl.abs(v))
    tl.store(e_ptr + i, e, mask=i < n)
    tl.store(h_ptr + i, _common.to_scaled_f16(v, e), mask=i < n)


@pytest.mark.parametrize("value", EXP_VALUES)
def test_shared_exponent_matches_rust(value: float) -> None:
    # A one-row block's mean is the row itself: its fp16 exponent is Rust's shared exponent.
    row = np.zeros((1, 4), np.float32)
    row[0, 0] = value
    rust = kt.encode_block_codes(row)
    want_e = int(rust["mean_exp"])
    v32 = torch.tensor([np.float32(value)])
    e_ref, bits_ref, stored = ref.scaled_f16(v32)
    assert int(e_ref) == want_e
    np.testing.assert_array_equal(stored.numpy(), rust["mean"][:1])
    e = torch.empty(1, dtype=torch.int32, device=DEVICE)
    h = torch.empty(1, dtype=torch.int16, device=DEVICE)
    _exponent_kernel[(1,)](v32.to(DEVICE), e, h, 1, B=16)
    assert int(e[0]) == want_e
    assert h.cpu().numpy().view(np.uint16)[0] == bits_ref.numpy()[0]


def test_poisoned_buffers() -> None:
    with K.poison_outputs():
        f = _common.empty((3,), torch.float32, torch.device("cpu"))
        i = _common.empty((3,), torch.int32, torch.device("cpu"))
        u = _common.empty((3,), torch.uint8, torch.device("cpu"))
    assert torch.isnan(f).all() and (i == -1).all() and (u == 255).all()
    # An unwritten decoded value fails the decode check rather than passing by accident.
    want = np.ones((4, 3), np.float32)
    got = want.copy()
    got[2, 1] = np.nan
    with pytest.raises(harness.ParityError, match=r"\[2, 1\]"):
        harness.assert_decoded(got, want, 1e-5, "poisoned")


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper() -> None:
    """The interpreter accepts programs the compiler rejects: compile every specialisation a
    run launches down to sm_90 cubin (no GPU needed; a few minutes)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_check.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "specialisations compiled for sm_90" in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_are_compiled_on_the_gpu() -> None:
    assert not K.is_interpreter()


def test_the_interpreter_setting_is_read_as_triton_reads_it() -> None:
    # "false" and "off" were taken for the interpreter (only "" and "0" were not), so the cache's
    # CPU check let kernel="triton" through to Triton's "0 active drivers".
    code = "from kakeyaturbo import kernels as K; print(K.is_interpreter())"
    for value, want in (("false", "False"), ("on", "True")):
        env = dict(os.environ, TRITON_INTERPRET=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


def test_the_wrappers_refusals_are_kakeya_errors() -> None:
    # They raised ValueError (README, "Guarantees": everything but a wrong type is a KakeyaError);
    # InvalidInputError is one, and a ValueError still.
    d = 16
    codec = calibration.fit_stream(np.zeros(d), np.eye(d), 4.0).codec()
    codes = kt.LayerCodes([codec], [codec], batch=1)
    codes.append_blocks([[codec.encode(np.ones((8, d), np.float32))]], [[codec.encode(np.ones((8, d), np.float32))]])
    layer = K.stack_layer(codes, DEVICE)
    t = np.ones((1, 1, 1, d), np.float32)
    for call in (lambda: K.stack_calibrations([], DEVICE),
                 lambda: K.decode_attention_triton(layer, torch.ones(1, 1, 1, d, dtype=torch.float64), t, t),
                 lambda: K.decode_attention_triton(layer, torch.ones(1, 1, 1, d), t, t, sink_k=t)):
        with pytest.raises(InvalidInputError):
            call()
    # An AttributeError, a KeyError and torch's RuntimeError before.
    with pytest.raises(TypeError, match="CalibratedCodec"):
        K.stack_calibrations([1], DEVICE)
    with pytest.raises(TypeError, match="dict of tensors"):
        K.decode_calibrated({}, K.stack_calibrations([codec], DEVICE))
    with pytest.raises(kt.InvalidParameterError, match="nodev"):
        K.stack_calibrations([codec], "nodev")


# Robustness: host data checked before any launch, device data clamped in the kernels.


def test_row_counts_are_checked_on_the_host() -> None:
    dev = torch.device("cpu")
    assert _common.rows_tensor([3, 1], 2, 4, dev).tolist() == [3, 1]
    assert _common.rows_tensor(np.array([4], np.int64), 1, 4, dev).tolist() == [4]
    for bad in ([0, 1], [5, 1], [1], [1, 1, 1]):
        with pytest.raises(InvalidInputError, match=r"rows must hold 2 counts in 1\.\.4"):
            _common.rows_tensor(bad, 2, 4, dev)
    # A CPU tensor is host data too: checked like a list (a GPU tensor is trusted).
    for bad in ([0, 1], [-5, 1], [10**7, 1]):
        with pytest.raises(InvalidInputError, match=r"rows must hold 2 counts in 1\.\.4"):
            _common.rows_tensor(torch.tensor(bad, dtype=torch.int32), 2, 4, dev)
    # Counts that are not ints are not truncated.
    for bad in ([1.9, 1], [True, 1], np.array([1.5, 1.0])):
        with pytest.raises(TypeError, match="rows must hold ints"):
            _common.rows_tensor(bad, 2, 4, dev)
    with pytest.raises(TypeError, match="rows must be a sequence"):
        _common.rows_tensor(3, 2, 4, dev)


@pytest.fixture
def on_device(monkeypatch: pytest.MonkeyPatch):
    """Makes the wrappers treat CPU tensors as GPU tensors (trusted, not read): what reaches
    the kernels is then only what they clamp."""
    from kakeyaturbo.kernels.calibrated import decode as cdecode
    from kakeyaturbo.kernels.perblock import decode as pdecode

    for mod in (_common, cdecode, pdecode):
        monkeypatch.setattr(mod, "on_host", lambda t: False, raising=False)


def _calibrated_case(n: int = 20, d: int = 32):
    from kakeyaturbo import calibrate

    g = np.random.default_rng(0)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    full = np.zeros(d, np.int64)
    full[:15] = [4] * 6 + [3] * 5 + [2] * 4
    fit = calibrate.fit_stream(g.standard_normal(d), (q * (0.93 ** np.arange(d) + 1e-3)) @ q.T, 0.0, bits=full)
    codec = fit.codec(outlier_threshold=1.5)
    x = (g.standard_normal((n, d)) * 0.95 ** np.arange(d) * 2 + 0.5).astype(np.float32)
    return codec, x


def test_kernels_clamp_device_row_counts(on_device) -> None:
    """A row count past N on the device (not checked: it would read the device) is clamped to
    N in every kernel: the result is that of N rows, nothing is written past the buffers."""
    codec, x = _calibrated_case()
    batch = K.stack_calibrations([codec], DEVICE)
    xt = torch.from_numpy(x[None]).to(DEVICE)
    huge = torch.tensor([10**7], dtype=torch.int32, device=DEVICE)
    want = K.encode_calibrated(xt, batch)
    got = K.encode_calibrated(xt, batch, huge)
    for key in ("codes", "scale_bits", "scale_exp", "outlier_ptr", "outlier_pos", "outlier_bits"):
        assert torch.equal(got[key], want[key]), key
    with K.poison_outputs():
        dec = K.decode_calibrated(want, batch, huge)
    assert torch.equal(dec, K.decode_calibrated(want, batch))
    p = kt.encode_block_codes(x, outlier_threshold=2.0)
    skel = K.stack_skeletons([p], DEVICE)
    want = K.encode_blocks(xt, skel)
    got = K.encode_blocks(xt, skel, huge)
    for key in ("seg_id", "t_bits", "norm_bits", "residual_packed", "outlier_pos"):
        assert torch.equal(got[key], want[key]), key
    with K.poison_outputs():
        assert torch.equal(K.decode_blocks(want, skel, huge), K.decode_blocks(want, skel))


def test_kernels_clamp_device_centre_indices(on_device) -> None:
    """A corrupted ``seg_id`` on the device is clamped to the block's centres (``k - 1``) by the
    decode and by the encode's residual launches: no read past the centres."""
    from kakeyaturbo.kernels.perblock import project, residual

    _, x = _calibrated_case(40)
    p = kt.encode_block_codes(x, outlier_threshold=2.0)
    k = int(p["k"])
    skel = K.stack_skeletons([p], DEVICE)
    codes = K.stack_codes([p], skel)
    bad, last = dict(codes), dict(codes)
    bad["seg_id"], last["seg_id"] = codes["seg_id"].clone(), codes["seg_id"].clone()
    bad["seg_id"][0, 0], last["seg_id"][0, 0] = 10**6, k - 1
    assert torch.equal(K.decode_blocks(bad, skel), K.decode_blocks(last, skel))
    bad["seg_id"][0, 0] = -(10**6)
    last["seg_id"][0, 0] = 0
    assert torch.equal(K.decode_blocks(bad, skel), K.decode_blocks(last, skel))
    rows = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    c, seg, traw = project.project_assign(torch.from_numpy(x[None]).to(DEVICE), skel, rows)
    seg_bad, seg_last = seg.clone(), seg.clone()
    seg_bad[0, 0], seg_last[0, 0] = 10**6, k - 1
    a = residual.residuals(c, seg_bad, traw, skel, rows)
    b = residual.residuals(c, seg_last, traw, skel, rows)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def _huge_stride_view(n: int, d: int, stride: int) -> torch.Tensor:
    """A bf16 ``[1, n, d]`` view whose last axis has ``stride``, over a buffer of
    ``stride * (d - 1) + n`` elements (virtual memory: only the ``n * d`` viewed elements are
    ever touched). Skips the test where the system refuses that much address space."""
    try:
        base = torch.empty(stride * (d - 1) + n, dtype=torch.bfloat16)
    except RuntimeError as e:  # pragma: no cover - depends on the system's overcommit policy
        pytest.skip(f"cannot reserve {stride * (d - 1) * 2 / 2**30:.1f} GiB of address space: {e}")
    return base.as_strided((1, n, d), (0, 1, stride))


@pytest.mark.skipif(DEVICE != "cpu", reason="a CPU view of over 2**31 elements")
def test_offsets_past_int32_in_strided_loads_and_stores() -> None:
    """A legal view whose largest offset passes 2**31 although its strides fit in int32 (a
    feature-major [D, H*T] buffer seen as [H, T, D]): the kernels form offsets in int64."""
    n, d, stride = 4, 32, 70_000_000  # (d - 1) * stride > 2**31
    codec, x = _calibrated_case(n, d)
    src = torch.from_numpy(x[None]).to(torch.bfloat16)
    view = _huge_stride_view(n, d, stride)
    view.copy_(src)
    batch = K.stack_calibrations([codec], "cpu")
    a, b = K.encode_calibrated(view, batch), K.encode_calibrated(src, batch)
    assert torch.equal(a["codes"], b["codes"]) and torch.equal(a["scale_bits"], b["scale_bits"])
    K.decode_calibrated(b, batch, out_dtype=torch.bfloat16, out=view)
    assert torch.equal(view, K.decode_calibrated(b, batch, out_dtype=torch.bfloat16))
    view.copy_(src)
    skel = K.stack_skeletons([kt.encode_block_codes(x)], "cpu")
    a, b = K.encode_blocks(view, skel), K.encode_blocks(src, skel)
    assert torch.equal(a["residual_packed"], b["residual_packed"]) and torch.equal(a["seg_id"], b["seg_id"])
    K.decode_blocks(b, skel, out_dtype=torch.bfloat16, out=view)
    assert torch.equal(view, K.decode_blocks(b, skel, out_dtype=torch.bfloat16))


def test_row_starts_stay_in_the_lists_whatever_the_pointers() -> None:
    """Corrupted outlier lists on a GPU are not checked (that would read the device): the row
    starts the kernels follow still lie in 0..M, so no read leaves ``outlier_pos``."""
    pos = torch.tensor([1, 5, 9, 0, 2, 4])
    d_eff = torch.tensor([4, 4], dtype=torch.int32)
    good = _common.row_starts({"outlier_ptr": torch.tensor([0, 3, 6]), "outlier_pos": pos}, d_eff, 3, 4)
    assert good.tolist() == [[0, 1, 2, 3], [3, 5, 6, 6]]
    for ptr in ([0, 9], [3, 0], [-2, 6], [0, 2**40]):
        p = torch.tensor(ptr[:1] + [ptr[1]] * 2)
        got = _common.row_starts({"outlier_ptr": p, "outlier_pos": pos}, d_eff, 3, 4)
        assert got.shape == (2, 4) and 0 <= int(got.min()) and int(got.max()) <= pos.numel()
