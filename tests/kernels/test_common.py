"""The pieces both modes share: the reference's sign pattern, butterfly and shared-exponent
fp16 (``reference/_common.py``) and the kernels' (``kernels/_common.py``) against the Rust
primitives, poisoned buffers and the harness's decoded-value check, and every kernel
specialisation compiling for Hopper."""

from __future__ import annotations

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
from kakeyaturbo import kernels as K  # noqa: E402
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
