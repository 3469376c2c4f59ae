"""The calibrated mode's reference and kernels piece by piece: the calibration's bytes, the
sub-band and slot layouts, row packing against Rust, batching and memory layouts, the outlier
buffer's overflow path, input validation, and the parity checker catching what it must."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("triton")

import torch  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibrate  # noqa: E402
from kakeyaturbo import kernels as K  # noqa: E402
from kakeyaturbo.errors import CorruptDataError, InvalidInputError, InvalidParameterError  # noqa: E402
from kakeyaturbo.kernels.calibrated import batch as kbatch  # noqa: E402
from kakeyaturbo.reference import calibrated as rc  # noqa: E402

from .. import harness  # noqa: E402
from ..conftest import DEVICE  # noqa: E402
from . import parity  # noqa: E402

D = 64


def _codec(bits, *, seed: int = 0, d: int = D, **kw) -> kt.CalibratedCodec:
    """A codec over the top components of a random covariance with the given layout."""
    g = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    lam = 0.93 ** np.arange(d) + 1e-3
    full = np.zeros(d, np.int64)
    full[: len(bits)] = bits
    fit = calibrate.fit_stream(g.standard_normal(d), (q * lam) @ q.T, 0.0, bits=full)
    return fit.codec(**kw)


def _rows(n: int, seed: int = 1, d: int = D) -> np.ndarray:
    g = np.random.default_rng(seed)
    return (g.standard_normal((n, d)) * 0.95 ** np.arange(d) * 2 + 0.5).astype(np.float32)


LAYOUT = [4, 4, 4, 3, 3, 3, 3, 3, 1] + [6] * 13 + [2] * 7 + [8] * 3  # runs of 3, 5, 1, 13, 7, 3


def test_calibration_bytes_round_trip() -> None:
    c = _codec(LAYOUT, metric="inner_product", outlier_threshold=2.5, rotation_seed=12345,
               centroids={3: np.linspace(-2, 2, 8)})
    cal = rc.calibration_of(c)
    got = (cal.d, cal.m, cal.rotation_seed, cal.metric, cal.norm)
    assert got == (D, len(LAYOUT), 12345, "inner_product", True)
    assert cal.threshold == 2.5 and list(cal.tables) == [3] and cal.row_bytes == c.row_bytes
    assert cal.fingerprint == c.fingerprint
    assert rc.sub_bands(cal.bits) == [tuple(b) for b in c.bands]
    raw = c.canonical_bytes()
    with pytest.raises(ValueError, match="magic"):
        rc.Calibration.from_bytes(b"XXXX" + raw[4:])
    with pytest.raises(ValueError, match="early"):
        rc.Calibration.from_bytes(raw[:-1])
    with pytest.raises(ValueError, match="left over"):
        rc.Calibration.from_bytes(raw + b"\0")


@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 20)), min_size=1, max_size=8))
def test_sub_bands_and_slots(runs: list) -> None:
    bits = [b for b, k in runs for _ in range(k)]
    bands = rc.sub_bands(bits)
    # Runs of equal bits cut into powers of two, largest first, covering every component once.
    assert [j for off, w, _ in bands for j in range(off, off + w)] == list(range(len(bits)))
    assert all(w & (w - 1) == 0 and all(bits[j] == b for j in range(off, off + w)) for off, w, b in bands)
    # Slots: every sub-band aligned to its own width, consecutive, in at most next_pow2(m).
    slots = kbatch.slot_order(bits)
    assert all(s % w == 0 for s, _, w, _ in slots)
    assert sum(w for _, _, w, _ in slots) == len(bits)


@given(st.lists(st.integers(1, 8), min_size=1, max_size=40), st.integers(0, 2**32 - 1))
def test_row_packing_matches_the_independent_packer(bits: list, seed: int) -> None:
    g = np.random.default_rng(seed)
    n = int(g.integers(1, 6))
    idx = np.stack([g.integers(0, 1 << b, size=n) for b in bits], axis=1).astype(np.uint8)
    packed = rc.pack_rows(torch.from_numpy(idx), bits)
    assert packed.shape == (n, (sum(bits) + 7) // 8)
    assert packed.numpy().tobytes() == parity.pack_independent(idx, bits)
    assert np.array_equal(rc.unpack_rows(packed, bits).numpy(), idx)


def test_rust_rows_pack_like_the_format() -> None:
    c = _codec(LAYOUT)
    p = c.encode_parts(_rows(40))
    assert p["codes"] == parity.pack_independent(p["indices"], rc.calibration_of(c).bits)


def _batch_case():
    """Three heads with different m, layouts, seeds and a custom table; 2 of them short."""
    codecs = [
        _codec(LAYOUT, seed=0, outlier_threshold=2.0, metric="inner_product"),
        _codec([5] * 50, seed=1, outlier_threshold=2.0, metric="inner_product", rotation_seed=7),
        _codec([2, 1, 1, 7], seed=2, outlier_threshold=2.0, metric="inner_product",
               centroids={1: [-0.5, 0.75]}),
    ]
    ns = [64, 33, 1]
    xs = [_rows(n, seed=10 + i) for i, n in enumerate(ns)]
    xb = np.zeros((3, 64, D), np.float32)
    for i, x in enumerate(xs):
        xb[i, : len(x)] = x
    return codecs, ns, xs, xb


def test_batched_heads_equal_single_heads() -> None:
    """Padding, masks and per-head layouts: each head of a batch codes as it does alone, and as
    Rust codes it."""
    codecs, ns, xs, xb = _batch_case()
    batch = K.stack_calibrations(codecs, DEVICE)
    with K.poison_outputs():
        both = K.encode_calibrated(torch.from_numpy(xb).to(DEVICE), batch, ns, intermediates=True)
    for i, x in enumerate(xs):
        one_batch = K.stack_calibrations([codecs[i]], DEVICE)
        with K.poison_outputs():
            one = K.encode_calibrated(torch.from_numpy(x[None]).to(DEVICE), one_batch, intermediates=True)
        a = K.head_parts(both, batch, ns, i)
        b = K.head_parts(one, one_batch, [len(x)], 0)
        # Through the parity checker, not bit for bit: the batched and the single launch may
        # round a product an ulp apart (the interpreter's BLAS kernel depends on the CPU and the
        # operands' layout), which can flip a code on a decision threshold; a padded row
        # leaking into a head would not sit on one.
        np.testing.assert_allclose(a["z"], b["z"], rtol=1e-5, atol=1e-6)
        cal = rc.calibration_of(codecs[i])
        rust = codecs[i].encode_parts(x)
        parity.compare_head(x, codecs[i], cal, rust, a, f"head {i} of the batch")
        parity.compare_head(x, codecs[i], cal, rust, b, f"head {i} alone")


def test_nothing_is_written_past_a_heads_rows() -> None:
    """With poisoned buffers, the bytes, scales and decoded rows past each head's count keep
    their poison: the masks hold, and an element a kernel forgot would show as NaN / 0xFF."""
    codecs, ns, _, xb = _batch_case()
    batch = K.stack_calibrations(codecs, DEVICE)
    with K.poison_outputs():
        codes = K.encode_calibrated(torch.from_numpy(xb).to(DEVICE), batch, ns, intermediates=True)
        dec = K.decode_calibrated(codes, batch, ns)
    for i, (n, c) in enumerate(zip(ns, codecs)):
        assert (codes["codes"][i, n * c.row_bytes:] == 255).all()
        assert (codes["scale_bits"][i, n:] == -1).all() and (codes["scale_bits"][i, :n] != -1).any()
        assert torch.isnan(dec[i, n:]).all() and not torch.isnan(dec[i, :n]).any()
        assert torch.isnan(codes["z"][i, :n, c.m:]).all() and not torch.isnan(codes["z"][i, :n, :c.m]).any()


def test_outlier_buffer_overflow_reruns() -> None:
    """A buffer too small for the outliers (capacity 1) gives the same lists as a roomy one."""
    codecs, ns, _, xb = _batch_case()
    batch = K.stack_calibrations(codecs, DEVICE)
    x = torch.from_numpy(xb).to(DEVICE)
    small = K.encode_calibrated(x, batch, ns, capacity=1)
    roomy = K.encode_calibrated(x, batch, ns)
    assert int(roomy["outlier_ptr"][-1]) > 3
    for key in ("outlier_ptr", "outlier_pos", "outlier_bits", "scale_exp"):
        assert torch.equal(small[key], roomy[key]), key
    for i in range(3):  # bytes and scales past a head's rows are unspecified
        a, b = K.head_parts(small, batch, ns, i), K.head_parts(roomy, batch, ns, i)
        assert a["codes"] == b["codes"] and np.array_equal(a["scale_bits"], b["scale_bits"])


def test_strided_input_bf16_and_strided_output() -> None:
    """A layer stored token-major ([T, H, D], bf16) is coded through a strided view, and decoded
    into a strided view of a bf16 cache: both give what copies give."""
    t, h = 40, 2
    codecs = [_codec([3] * 20 + [2] * 11, seed=s) for s in range(h)]
    rows = np.stack([_rows(t, seed=s) for s in range(h)], axis=1)
    layer = torch.from_numpy(rows).to(DEVICE, torch.bfloat16)
    view = layer.permute(1, 0, 2)  # [H, T, D], not contiguous
    assert not view.is_contiguous()
    batch = K.stack_calibrations(codecs, DEVICE)
    a = K.encode_calibrated(view, batch)
    b = K.encode_calibrated(view.contiguous(), batch)
    for key in ("codes", "scale_bits", "scale_exp"):
        assert torch.equal(a[key], b[key]), key
    # The reference on the same bf16 rows, head by head.
    for i, c in enumerate(codecs):
        want = rc.to_numpy_parts(rc.encode(view[i], rc.calibration_of(c)))
        assert want["codes"] == a["codes"][i, : t * c.row_bytes].cpu().numpy().tobytes()
    cache = torch.full((t, h, D), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    K.decode_calibrated(a, batch, out_dtype=torch.bfloat16, out=cache.permute(1, 0, 2))
    assert torch.equal(cache.permute(1, 0, 2), K.decode_calibrated(b, batch, out_dtype=torch.bfloat16))


def test_zero_rows_and_no_norm() -> None:
    """Rows equal to the mean have a zero scale (z = 0); without norm g = 1 and no scale is
    stored. Both as Rust codes them."""
    settings: List[Dict[str, Any]] = [dict(), dict(norm=False, outlier_threshold=1.5)]
    for kw in settings:
        c = _codec(LAYOUT, **kw)
        x = _rows(20)
        x[::3] = rc.calibration_of(c).mean
        batch = K.stack_calibrations([c], DEVICE)
        with K.poison_outputs():
            codes = K.encode_calibrated(torch.from_numpy(x[None]).to(DEVICE), batch, intermediates=True)
        ours = K.head_parts(codes, batch, [20], 0)
        assert ("scale_bits" in ours) == c.norm
        parity.compare_head(x, c, rc.calibration_of(c), c.encode_parts(x), ours, str(kw))


def test_encode_rejects_bad_input() -> None:
    codecs, ns, _, xb = _batch_case()
    batch = K.stack_calibrations(codecs, DEVICE)
    x = torch.from_numpy(xb).to(DEVICE)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        K.encode_calibrated(x.double(), batch)
    with pytest.raises(ValueError, match="does not fit"):
        K.encode_calibrated(x[:2], batch)
    with pytest.raises(ValueError, match="does not fit"):
        K.encode_calibrated(x[..., :32], batch)
    with pytest.raises(ValueError, match=r"\[H, N, D\]"):
        K.encode_calibrated(x[0], batch)
    with pytest.raises(ValueError, match="rows"):
        K.encode_calibrated(x, batch, [64, 65, 1])
    with pytest.raises(ValueError, match="rows must be int32"):
        K.encode_calibrated(x, batch, torch.tensor(ns, device=DEVICE))
    with pytest.raises(ValueError, match="metric"):
        K.encode_calibrated(x, dataclasses.replace(batch, metric="l2"))
    with pytest.raises(ValueError, match="bits"):
        K.encode_calibrated(x, dataclasses.replace(batch, bits=batch.bits[:, :8]))
    with pytest.raises(ValueError, match="inner_product needs norm"):
        K.encode_calibrated(x, dataclasses.replace(batch, norm=False))


def test_decode_rejects_bad_input() -> None:
    codecs, ns, _, xb = _batch_case()
    batch = K.stack_calibrations(codecs, DEVICE)
    codes = K.encode_calibrated(torch.from_numpy(xb).to(DEVICE), batch, ns)
    for key, bad in (
        ("scale_bits", codes["scale_bits"].to(torch.int32)),
        ("codes", codes["codes"][:, :100]),
        ("outlier_bits", codes["outlier_bits"][:0]),
        ("scale_exp", codes["scale_exp"][:1]),
        ("outlier_ptr", codes["outlier_ptr"][:2]),
    ):
        with pytest.raises(ValueError):
            K.decode_calibrated({**codes, key: bad}, batch, ns)
    with pytest.raises(ValueError, match="out_dtype"):
        K.decode_calibrated(codes, batch, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be"):
        K.decode_calibrated(codes, batch, out=torch.empty(3, 64, 63, device=DEVICE))


def test_stack_calibrations_rejects_mixed_parameters() -> None:
    a = _codec([3] * 10)
    for other in (dict(metric="linf"), dict(norm=False), dict(outlier_threshold=2.0)):
        with pytest.raises(ValueError):
            K.stack_calibrations([a, _codec([3] * 10, **other)])
    with pytest.raises(ValueError):
        K.stack_calibrations([a, _codec([3] * 10, d=32)])
    with pytest.raises(ValueError):
        K.stack_calibrations([])


def test_reference_rejects_bad_input() -> None:
    c = _codec(LAYOUT)
    cal = rc.calibration_of(c)
    x = _rows(10)
    with pytest.raises(ValueError):
        rc.encode(torch.from_numpy(x[:, :-1]), cal)
    with pytest.raises(ValueError):
        rc.encode(torch.from_numpy(x).double(), cal)
    p = c.encode_parts(x)
    with pytest.raises(ValueError):
        rc.decode({**p, "codes": p["codes"][:-1]}, cal)
    xn = torch.from_numpy(x.copy())
    xn[2, 1] = float("nan")
    with pytest.raises(InvalidInputError, match="non-finite value NaN at row 2, column 1"):
        rc.encode(xn, cal)
    # Corrupted parts: the errors of CalibratedCodec.decode_parts, no silent garbage.
    c = _codec(LAYOUT, outlier_threshold=1.5)
    cal = rc.calibration_of(c)
    p = c.encode_parts(x)
    assert len(p["outlier_pos"]) > 2
    for key, value, error, match in _CORRUPT_PARTS:
        bad = {**p, key: value(p)}
        with pytest.raises(error, match=match):
            c.decode_parts(bad)
        with pytest.raises(error, match=match):
            rc.decode(bad, cal)


#: Corruptions of a head's parts: (key, new value of parts, error, message) as Rust raises them.
_CORRUPT_PARTS = [
    ("scale_exp", lambda p: 300, InvalidParameterError, r"scale_exp.*-126\.\.=127"),
    ("outlier_pos", lambda p: np.asarray(p["outlier_pos"]) + 10**6, CorruptDataError, "out of range or not ascending"),
    ("outlier_pos", lambda p: np.asarray(p["outlier_pos"])[::-1].copy(), CorruptDataError, "not ascending"),
    ("outlier_bits", lambda p: np.asarray(p["outlier_bits"])[:2], InvalidInputError, "outlier_bits"),
    ("scale_bits", lambda p: np.asarray(p["scale_bits"])[:-1], InvalidInputError, "scale_bits"),
]


def test_calibration_bytes_are_checked_as_the_codec_checks_them() -> None:
    """Values CalibratedCodec refuses are refused when read from bytes (InvalidParameterError),
    not turned into NaN codes."""
    import struct

    c = _codec([4] * 6 + [3] * 5 + [2] * 4, d=32)
    raw = c.canonical_bytes()
    spread_at = 28 + 4 * (c.d + 2 * c.m * c.d)
    for at, v, match in ((spread_at, 0.0, "spread must be > 0"), (spread_at, float("nan"), "spread holds a non-finite"),
                         (28, float("inf"), "mean holds a non-finite"), (24, float("nan"), "outlier_threshold"),
                         (24, -1.0, "outlier_threshold")):
        b = bytearray(raw)
        struct.pack_into("<f", b, at, v)
        with pytest.raises(InvalidParameterError, match=match):
            rc.Calibration.from_bytes(bytes(b))


def test_stack_calibrated_parts_checks_the_parts() -> None:
    c = _codec(LAYOUT, outlier_threshold=1.5)
    p = c.encode_parts(_rows(10))
    batch = K.stack_calibrations([c], DEVICE)
    extra = [
        ("codes", lambda p: p["codes"][:-1], CorruptDataError, "code bytes"),
        ("scale_bits", lambda p: np.full(10, 0x7C00, np.uint16), CorruptDataError, "non-finite"),
        ("outlier_bits", lambda p: np.full(len(p["outlier_pos"]), 0xFC00, np.uint16), CorruptDataError, "not finite"),
        ("m", lambda p: 3, InvalidInputError, "m = 3"),
    ]
    for key, value, error, match in _CORRUPT_PARTS + extra:
        with pytest.raises(error, match=match):
            K.stack_calibrated_parts([{**p, key: value(p)}], batch)
    plain = K.stack_calibrations([_codec(LAYOUT)], DEVICE)
    with pytest.raises(CorruptDataError, match="without them"):
        K.stack_calibrated_parts([p], plain)


def test_encode_checks_capacity_and_finiteness() -> None:
    c = _codec([4] * 6 + [3] * 5 + [2] * 4, d=32, outlier_threshold=1.0)
    batch = K.stack_calibrations([c], DEVICE)
    x = torch.from_numpy(_rows(20, d=32)[None]).to(DEVICE)
    for cap in (0, -3):
        with pytest.raises(InvalidParameterError, match="capacity must be >= 1"):
            K.encode_calibrated(x, batch, capacity=cap)
    for cap in (2.5, True):
        with pytest.raises(TypeError, match="capacity must be an int"):
            K.encode_calibrated(x, batch, capacity=cap)
    for v, shown in ((float("nan"), "NaN"), (float("inf"), "inf")):
        xb = x.clone()
        xb[0, 3, 2] = v
        with pytest.raises(InvalidInputError, match=f"non-finite value {shown} at head 0, row 3, column 2"):
            K.encode_calibrated(xb, batch)
    xb = x.clone()
    xb[0, 10:] = float("nan")  # past the head's rows: not read
    K.encode_calibrated(xb, batch, [10])
    with pytest.raises(InvalidInputError, match="at least one row"):
        K.encode_calibrated(x[:, :0], batch)


def test_decode_checks_host_codes_and_sizes() -> None:
    c = _codec([4] * 6 + [3] * 5 + [2] * 4, d=32, outlier_threshold=1.5)
    batch = K.stack_calibrations([c], DEVICE)
    codes = K.stack_calibrated_parts([c.encode_parts(_rows(20, d=32))], batch)
    m = codes["outlier_pos"].numel()
    assert m > 2
    for n, error in ((0, InvalidParameterError), (-1, InvalidParameterError), (2.5, TypeError)):
        with pytest.raises(error, match="n must be"):
            K.decode_calibrated(codes, batch, n=n)
    with pytest.raises(InvalidInputError, match="must not repeat elements"):
        K.decode_calibrated(codes, batch, out=torch.zeros(1, 1, 32, device=DEVICE).expand(1, 20, 32))
    # Without norm N comes from the codes' size, which must hold whole rows.
    plain = _codec([4] * 6 + [3] * 5 + [2] * 4, d=32, norm=False)
    pbatch = K.stack_calibrations([plain], DEVICE)
    pc = K.encode_calibrated(torch.from_numpy(_rows(20, d=32)[None]).to(DEVICE), pbatch)
    cut = {**pc, "codes": pc["codes"][:, : 7 * pbatch.max_row_bytes + 3].contiguous()}
    with pytest.raises(InvalidInputError, match="not whole rows"):
        K.decode_calibrated(cut, pbatch)
    assert K.decode_calibrated(cut, pbatch, n=7).shape == (1, 7, 32)
    if DEVICE != "cpu":
        return  # codes on a GPU are trusted (checking would read the device)
    cases = [
        ({"scale_exp": torch.tensor([300], dtype=torch.int32)}, InvalidParameterError, "scale_exp"),
        ({"scale_bits": torch.full((1, 20), 0x7C00, dtype=torch.int16)}, CorruptDataError, "non-finite"),
        ({"outlier_ptr": torch.tensor([0, m + 5])}, CorruptDataError, "outlier_ptr"),
        ({"outlier_ptr": torch.tensor([1, m])}, CorruptDataError, "outlier_ptr"),
        ({"outlier_pos": codes["outlier_pos"] + 10**6}, CorruptDataError, "outlier positions"),
        ({"outlier_pos": codes["outlier_pos"].flip(0).contiguous()}, CorruptDataError, "not ascending"),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            K.decode_calibrated({**codes, **change}, batch)
    bad = dataclasses.replace(batch, bits=torch.where(batch.bits > 0, batch.bits + 9, batch.bits))
    with pytest.raises(InvalidParameterError, match="out of range"):
        K.decode_calibrated(codes, bad)


def test_parts_have_the_extensions_names_and_dtypes() -> None:
    """The reference's dict and a kernel batch's head both mirror the extension's parts."""
    codecs, ns, xs, xb = _batch_case()
    batch = K.stack_calibrations(codecs, DEVICE)
    codes = K.encode_calibrated(torch.from_numpy(xb).to(DEVICE), batch, ns, intermediates=True)
    rust = codecs[0].encode_parts(xs[0])
    ref_parts = rc.to_numpy_parts(rc.encode(torch.from_numpy(xs[0]), rc.calibration_of(codecs[0])))
    for other in (ref_parts, K.head_parts(codes, batch, ns, 0)):
        assert set(other) == set(rust)
        for key, v in rust.items():
            w = other[key]
            assert type(w) is type(v), key
            if isinstance(v, np.ndarray):
                assert w.dtype == v.dtype and w.shape == v.shape, key


# The parity checker must catch what it is meant to catch.


@pytest.fixture(scope="module")
def head() -> tuple:
    c = _codec(LAYOUT, metric="inner_product", outlier_threshold=2.0)
    x = _rows(200)
    cal = rc.calibration_of(c)
    rust = c.encode_parts(x)
    ours = rc.to_numpy_parts(rc.encode(torch.from_numpy(x), cal))
    return x, c, cal, rust, ours


def _copy(p: dict) -> dict:
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in p.items()}


def test_checker_accepts_identical_codes(head: tuple) -> None:
    x, c, cal, rust, ours = head
    res = parity.compare_head(x, c, cal, rust, ours, "same")
    assert res.nears == [] and res.compared["indices"] == 200 * c.m


@pytest.mark.parametrize("field", ["g", "indices", "outlier_pos", "outlier_bits", "scale_bits", "codes"])
def test_checker_rejects_a_wrong_code(head: tuple, field: str) -> None:
    x, c, cal, rust, ours = head
    bad = _copy(ours)
    if field == "g":
        bad["g"][7] *= 1.01
    elif field == "indices":
        ex = parity.exact(x, cal, rust["g"])
        # The value farthest from a threshold of its table: a flip there is a real error.
        far = np.zeros_like(ex.z)
        for off, w, b in rc.sub_bands(cal.bits):
            thr = np.float32(0.5) * (cal.centroids(b)[:-1] + cal.centroids(b)[1:])
            far[:, off:off + w] = np.abs(ex.z[:, off:off + w, None] - thr).min(-1)
        i, j = np.unravel_index(int(np.argmax(far)), far.shape)
        top = (1 << int(cal.bits[j])) - 1
        v = int(bad["indices"][i, j])
        bad["indices"][i, j] = v + 1 if v < top else v - 1
        bad["codes"] = parity.pack_independent(bad["indices"], cal.bits)
    elif field == "outlier_pos":
        for key in ("outlier_pos", "outlier_bits", "outlier_val"):
            bad[key] = bad[key][1:]
    elif field == "outlier_bits":
        bad["outlier_bits"][0] ^= 0x0100
        bad["outlier_val"] = bad["outlier_bits"].view(np.float16).astype(np.float32)
    elif field == "scale_bits":
        bad["scale_bits"][9] += 40
        scale = np.float32(2.0 ** bad["scale_exp"])
        bad["scale"] = bad["scale_bits"].view(np.float16).astype(np.float32) * scale
    else:
        raw = bytearray(bad["codes"])
        raw[3] ^= 0x10
        bad["codes"] = bytes(raw)
    with pytest.raises(harness.ParityError, match=field):
        parity.compare_head(x, c, cal, rust, bad, "mutated")


def test_checker_accepts_a_flip_on_a_threshold(head: tuple) -> None:
    """A flip is accepted (and reported) only where z lies within epsilon of the threshold."""
    x, c, cal, rust, ours = head
    ex = parity.exact(x, cal, rust["g"])
    idx = rust["indices"].astype(np.int64)
    dist = np.full(ex.z.shape, np.inf)
    for off, w, b in rc.sub_bands(cal.bits):
        thr = (np.float32(0.5) * (cal.centroids(b)[:-1] + cal.centroids(b)[1:])).astype(np.float64)
        sl = slice(off, off + w)
        d = np.abs(ex.z[:, sl] - thr[np.clip(idx[:, sl] - 1, 0, len(thr) - 1)])
        dist[:, sl] = np.where(idx[:, sl] > 0, d, np.inf)
    # Only values that no outlier overrides (a flip of an outlier's index is still a flip).
    dist[np.abs(ex.z) > 2.0] = np.inf
    i, j = np.unravel_index(int(np.argmin(dist)), dist.shape)
    bad = _copy(ours)
    bad["indices"][i, j] -= 1
    bad["codes"] = parity.pack_independent(bad["indices"], cal.bits)
    # (A row with a flipped index is left out of the gain comparison.)
    old = parity.TOL["cal_u"]
    try:
        parity.TOL["cal_u"] = old * 1.001 * dist[i, j] / ex.eps_z[i, j]
        res = parity.compare_head(x, c, cal, rust, bad, "on threshold")
        assert [n_.field for n_ in res.nears] == ["indices"]
        parity.TOL["cal_u"] = old * 0.5 * dist[i, j] / ex.eps_z[i, j]
        with pytest.raises(harness.ParityError, match="indices"):
            parity.compare_head(x, c, cal, rust, bad, "off threshold")
    finally:
        parity.TOL["cal_u"] = old
