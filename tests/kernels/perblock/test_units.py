"""The per-block mode piece by piece: the reference's band layout, rotation and packing against
the Rust primitives; batching and memory layouts; input validation; the parity checker catching
what it must; the parts dicts mirroring the extension's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("triton")

import torch  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import kernels as K  # noqa: E402
from kakeyaturbo.errors import CorruptDataError, InvalidInputError, InvalidParameterError  # noqa: E402
from kakeyaturbo.reference import perblock as ref  # noqa: E402

from .. import harness  # noqa: E402
from ..conftest import DEVICE  # noqa: E402
from . import parity  # noqa: E402


@pytest.mark.parametrize("d_eff", [1, 3, 16, 45, 96, 100, 127, 255])
def test_band_layout_and_rotation_match_rust(d_eff: int) -> None:
    x = np.random.default_rng(d_eff).standard_normal((300, 256)).astype(np.float32)
    p = kt.encode_block_codes(x, variance_ratio=1.0, rank_cap=d_eff)
    assert p["d_eff"] == d_eff
    assert [w for _, w in ref.band_layout(d_eff)] == list(p["bands"])
    assert sum(w for _, w in ref.band_layout(d_eff)) == d_eff
    # One band, a power of two: the band rotation is rotate_rows of the extension.
    w = 1 << (d_eff.bit_length() - 1)
    s = ref.sign_pattern(7, w)
    y = ref.rotate(torch.from_numpy(x[:, :w]), s, w).numpy()
    assert np.array_equal(y, kt.rotate_rows(np.ascontiguousarray(x[:, :w]), 7))
    back = ref.inverse_rotate(torch.from_numpy(y), s, w).numpy()
    assert np.array_equal(back, kt.inverse_rotate_rows(y, 7))


@given(st.integers(1, 4), st.integers(0, 500), st.integers(0, 2**32 - 1))
def test_pack_matches_the_extension(bits: int, count: int, seed: int) -> None:
    v = np.random.default_rng(seed).integers(0, 1 << bits, size=count).astype(np.uint8)
    packed = ref.pack_codes(torch.from_numpy(v), bits)
    assert packed.numpy().tobytes() == kt.pack_bits(v, bits)
    assert np.array_equal(ref.unpack_codes(packed, bits, count).numpy(), v)


def _two_blocks(d: int = 96, metric: str = "mse", bits: int = 3, threshold: object = 2.0):
    g = np.random.default_rng(5)
    xs = [(g.standard_normal((n, d)) * 0.97 ** np.arange(d)).astype(np.float32) for n in (100, 37)]
    kw = dict(metric=metric, bit_width=bits, outlier_threshold=threshold, variance_ratio=0.99)
    parts = [kt.encode_block_codes(x, **kw) for x in xs]
    xb = np.zeros((2, 100, d), np.float32)
    xb[0], xb[1, :37] = xs
    return xs, parts, xb


def test_batched_blocks_equal_single_blocks() -> None:
    """Padding and masks: each block of a batch codes as it does alone, both as Rust codes it.

    Compared through the parity checker, not bit for bit: the batched and the single launch
    may round a matrix product differently (numpy's BLAS under the interpreter picks its
    kernel by CPU model and operand layout: equal on one AMD EPYC, an ulp apart on another), so a
    code may flip where its value sits on a decision threshold; a padded row leaking into a
    block would not be near any threshold."""
    xs, parts, xb = _two_blocks()
    skel = K.stack_skeletons(parts, DEVICE)
    with K.poison_outputs():
        both = K.encode_blocks(torch.from_numpy(xb).to(DEVICE), skel, [100, 37])
    for i, x in enumerate(xs):
        one_skel = K.stack_skeletons([parts[i]], DEVICE)
        with K.poison_outputs():
            one = K.encode_blocks(torch.from_numpy(x[None]).to(DEVICE), one_skel)
        a = K.block_parts(both, skel, [100, 37], i)
        b = K.block_parts(one, one_skel, [len(x)], 0)
        parity.compare_block(x, parts[i], a, f"block {i} of the batch")
        parity.compare_block(x, parts[i], b, f"block {i} alone")


def test_strided_input_and_shared_basis() -> None:
    """A layer stored token-major ([T, H, D]) is coded through a strided view, and a basis
    shared by all blocks may be an expanded view: both give the same codes as copies."""
    d, n, h = 64, 80, 3
    g = np.random.default_rng(9)
    layer = (g.standard_normal((n, h, d)) * 0.9 ** np.arange(d)).astype(np.float32)
    parts = [
        kt.encode_block_codes(np.ascontiguousarray(layer[:, j]), rank_cap=19, variance_ratio=1.0)
        for j in range(h)
    ]
    # Give every block the first block's mean and basis (share_basis), centres stay per block.
    for p in parts[1:]:
        p["mean"], p["basis"] = parts[0]["mean"], parts[0]["basis"]
    skel = K.stack_skeletons(parts, DEVICE)
    shared = dataclasses.replace(
        skel, mean=skel.mean[:1].expand(h, -1), basis=skel.basis[:1].expand(h, -1, -1)
    )
    view = torch.from_numpy(layer).to(DEVICE).permute(1, 0, 2)  # [H, T, D], not contiguous
    assert not view.is_contiguous()
    a = K.encode_blocks(view, shared)
    b = K.encode_blocks(view.contiguous(), skel)
    for key in ("seg_id", "t_bits", "norm_bits", "residual_packed"):
        assert torch.equal(a[key], b[key]), key
    out = torch.full((n, h, d), float("nan"), device=DEVICE).permute(1, 0, 2)  # token-major
    K.decode_blocks(a, shared, out=out)
    assert torch.equal(out, K.decode_blocks(b, skel))


def test_encode_rejects_bad_input() -> None:
    xs, parts, xb = _two_blocks()
    skel = K.stack_skeletons(parts, DEVICE)
    x = torch.from_numpy(xb).to(DEVICE)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        K.encode_blocks(x.double(), skel)
    with pytest.raises(ValueError, match="does not fit"):
        K.encode_blocks(x[:1], skel)
    with pytest.raises(ValueError, match="does not fit"):
        K.encode_blocks(x[..., :64], skel)
    with pytest.raises(ValueError, match=r"\[B, N, D\]"):
        K.encode_blocks(x[0], skel)
    with pytest.raises(ValueError, match="rows"):
        K.encode_blocks(x, skel, [100, 101])
    with pytest.raises(ValueError, match="rows"):
        K.encode_blocks(x, skel, [100])
    with pytest.raises(ValueError, match="rows must be int32"):
        K.encode_blocks(x, skel, torch.tensor([100, 37], device=DEVICE))
    with pytest.raises(ValueError, match="metric"):
        K.encode_blocks(x, dataclasses.replace(skel, metric="l2"))
    with pytest.raises(ValueError, match="centers"):
        K.encode_blocks(x, dataclasses.replace(skel, centers=skel.centers[:, :8]))


def test_decode_rejects_bad_input() -> None:
    xs, parts, xb = _two_blocks()
    skel = K.stack_skeletons(parts, DEVICE)
    codes = K.encode_blocks(torch.from_numpy(xb).to(DEVICE), skel, [100, 37])
    for key, bad in (
        ("t_bits", codes["t_bits"].to(torch.int32)),
        ("seg_id", codes["seg_id"][:, :50]),
        ("residual_packed", codes["residual_packed"][:, :10]),
        ("outlier_bits", codes["outlier_bits"][:0]),
        ("norm_exp", codes["norm_exp"][:1]),
    ):
        with pytest.raises(ValueError):
            K.decode_blocks({**codes, key: bad}, skel)
    with pytest.raises(ValueError, match="out_dtype"):
        K.decode_blocks(codes, skel, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be"):
        K.decode_blocks(codes, skel, out=torch.empty(2, 100, 95, device=DEVICE))


def test_stack_skeletons_rejects_mixed_parameters() -> None:
    x = np.random.default_rng(0).standard_normal((50, 32)).astype(np.float32)
    a = kt.encode_block_codes(x, bit_width=3)
    for other in (
        dict(bit_width=2), dict(metric="inner_product"), dict(rotation_seed=1), dict(outlier_threshold=2.0)
    ):
        with pytest.raises(ValueError):
            K.stack_skeletons([a, kt.encode_block_codes(x, **other)])
    with pytest.raises(ValueError):
        K.stack_skeletons([])


def test_reference_rejects_bad_input() -> None:
    x = np.random.default_rng(0).standard_normal((50, 32)).astype(np.float32)
    p = kt.encode_block_codes(x)
    with pytest.raises(ValueError):
        ref.encode_block(torch.from_numpy(x[:, :31]), p)
    with pytest.raises(ValueError):
        ref.encode_block(torch.from_numpy(x).double(), p)
    with pytest.raises(ValueError):
        ref.decode_block({**p, "residual_packed": p["residual_packed"][:-1]})
    # As decode_block_from_parts: typed errors, no wrapped index or silent garbage.
    q = kt.encode_block_codes(x, outlier_threshold=1.0)
    assert len(q["outlier_pos"]) > 3
    for key, value, error, match in _CORRUPT_PARTS:
        bad = {**q, key: value(q)}
        with pytest.raises(error, match=match):
            kt.decode_block_from_parts(bad)
        with pytest.raises(error, match=match):
            ref.decode_block(bad)
    xn = torch.from_numpy(x.copy())
    xn[2, 1] = float("nan")
    with pytest.raises(InvalidInputError, match="non-finite value NaN at row 2, column 1"):
        ref.encode_block(xn, p)


def _set(key: str, i: int, v: int):
    def f(p: dict) -> np.ndarray:
        a = np.asarray(p[key]).copy()
        a[i] = v
        return a
    return f


#: Corruptions of a block's parts: (key, new value of parts, error, message) as Rust raises them.
_CORRUPT_PARTS = [
    ("seg_id", _set("seg_id", 0, -1), InvalidInputError, "seg_id out of range"),
    ("seg_id", _set("seg_id", 3, 99), InvalidInputError, "seg_id out of range"),
    ("seg_id", lambda p: np.asarray(p["seg_id"])[:3], InvalidInputError, "seg_id"),
    ("t_bits", lambda p: np.asarray(p["t_bits"])[:-1], InvalidInputError, "t_bits"),
    ("outlier_pos", _set("outlier_pos", 0, -1), InvalidInputError, "outlier_pos out of range"),
    ("outlier_pos", _set("outlier_pos", -1, 10**6), InvalidInputError, "outlier_pos out of range"),
    ("outlier_bits", lambda p: np.asarray(p["outlier_bits"])[:3], InvalidInputError, "outlier_bits"),
    ("norm_exp", lambda p: 1000, InvalidParameterError, r"norm_exp.*-126\.\.=127"),
    ("t_exp", lambda p: -127, InvalidParameterError, r"t_exp.*-126\.\.=127"),
    ("residual_packed", lambda p: p["residual_packed"][:-20], InvalidInputError, "residual_packed has"),
]


def test_stack_codes_checks_the_parts_as_rust_does() -> None:
    """Host parts are checked before anything reaches a kernel: the same error types as
    decode_block_from_parts for the same corruption (D1, D5, D6 of the audit)."""
    g = np.random.default_rng(5)
    x = (g.standard_normal((40, 32)) * 0.97 ** np.arange(32)).astype(np.float32)
    p = kt.encode_block_codes(x, outlier_threshold=1.0)
    skel = K.stack_skeletons([p], DEVICE)
    extra = [
        ("residual_packed", lambda p: p["residual_packed"] + b"\0", InvalidInputError, "residual_packed has"),
        ("residual_packed", lambda p: b"", InvalidInputError, "residual_packed has"),
        ("norm_bits", lambda p: np.asarray(p["norm_bits"])[:-1], InvalidInputError, "norm_bits"),
        ("outlier_bits", _set("outlier_bits", 0, 0x7C00), InvalidInputError, "non-finite"),
        ("seg_id", _set("seg_id", 0, 10**6), InvalidInputError, r"seg_id out of range \(k = "),
    ]
    for key, value, error, match in _CORRUPT_PARTS + extra:
        with pytest.raises(error, match=match):
            K.stack_codes([{**p, key: value(p)}], skel)
    # Unsorted and repeated positions decode as Rust decodes them (the last value of a cell wins).
    order = np.arange(len(p["outlier_pos"]))[::-1]
    pos = np.concatenate([np.asarray(p["outlier_pos"])[order], [p["outlier_pos"][1]]])
    bits = np.concatenate([np.asarray(p["outlier_bits"])[order], np.array([0x3C00], np.uint16)])
    q = {**p, "outlier_pos": pos, "outlier_bits": bits}
    got = K.decode_blocks(K.stack_codes([q], skel), skel)[0].cpu().numpy()
    np.testing.assert_allclose(got, kt.decode_block_from_parts(q), rtol=1e-5, atol=1e-5)


def test_decode_checks_host_codes() -> None:
    """Codes in host memory (CPU tensors) are checked before the launch; on a GPU they are
    trusted and the kernel clamps (tests/kernels/test_common.py)."""
    if DEVICE != "cpu":
        pytest.skip("host codes: the CPU run")
    g = np.random.default_rng(5)
    x = (g.standard_normal((40, 32)) * 0.97 ** np.arange(32)).astype(np.float32)
    p = kt.encode_block_codes(x, outlier_threshold=2.0)
    skel = K.stack_skeletons([p], DEVICE)
    codes = K.stack_codes([p], skel)
    m = codes["outlier_pos"].numel()
    assert m > 2

    def seg(v: int) -> torch.Tensor:
        s = codes["seg_id"].clone()
        s[0, 5] = v
        return s

    cases = [
        ({"seg_id": seg(int(p["k"]))}, InvalidInputError, r"block 0: seg_id out of range \(k = "),
        ({"seg_id": seg(-1)}, InvalidInputError, "seg_id out of range"),
        ({"t_exp": torch.tensor([500], dtype=torch.int32)}, InvalidParameterError, "t_exp"),
        ({"norm_exp": torch.tensor([-1000], dtype=torch.int32)}, InvalidParameterError, "norm_exp"),
        ({"outlier_ptr": torch.tensor([0, m + 5])}, CorruptDataError, "outlier_ptr"),
        ({"outlier_ptr": torch.tensor([3, 0])}, CorruptDataError, "outlier_ptr"),
        ({"outlier_ptr": torch.tensor([-2, m])}, CorruptDataError, "outlier_ptr"),
        ({"outlier_pos": codes["outlier_pos"] + 10**6}, InvalidInputError, "outlier positions"),
        ({"outlier_pos": codes["outlier_pos"].flip(0).contiguous()}, InvalidInputError, "not ascending"),
        ({"outlier_bits": torch.full((m,), 0x7E00, dtype=torch.int16)}, InvalidInputError, "non-finite"),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            K.decode_blocks({**codes, **change}, skel)
    # Rows past a block's count are not read, so not checked.
    short = {**codes, "seg_id": seg(10**6)}
    assert K.decode_blocks(short, skel, [5]).shape == (1, 40, 32)
    with pytest.raises(InvalidInputError, match="must not repeat elements"):
        K.decode_blocks(codes, skel, out=torch.zeros(1, 1, 32).expand(1, 40, 32))
    bad_k = dataclasses.replace(skel, k=skel.k + 100)
    with pytest.raises(InvalidParameterError, match="k in"):
        K.decode_blocks(codes, bad_k)


def test_encode_refuses_non_finite_rows() -> None:
    """As the Rust encoder: a NaN or inf in a block's rows is an InvalidInputError naming it;
    rows past a block's count are not read (a NaN there is fine)."""
    xs, parts, xb = _two_blocks()
    skel = K.stack_skeletons(parts, DEVICE)
    for v, shown in ((float("nan"), "NaN"), (float("inf"), "inf"), (float("-inf"), "-inf")):
        x = torch.from_numpy(xb).to(DEVICE).clone()
        x[1, 3, 2] = v
        with pytest.raises(InvalidInputError, match=f"non-finite value {shown} at block 1, row 3, column 2"):
            K.encode_blocks(x, skel, [100, 37])
    x = torch.from_numpy(xb[:, :40]).to(DEVICE).clone()
    x[1, 37:] = float("nan")
    K.encode_blocks(x, skel, [40, 37])
    with pytest.raises(InvalidInputError, match="at least one row"):
        K.encode_blocks(x[:, :0], skel)


# The parity checker must catch what it is meant to catch.


@pytest.fixture(scope="module")
def block() -> tuple:
    g = np.random.default_rng(3)
    x = (g.standard_normal((300, 64)) * 0.95 ** np.arange(64)).astype(np.float32)
    kw = dict(metric="inner_product", bit_width=3, outlier_threshold=2.0, variance_ratio=0.99)
    rust = kt.encode_block_codes(x, **kw)
    ours = ref.to_numpy_parts(ref.encode_block(torch.from_numpy(x), rust))
    return x, rust, ours


def _copy(p: dict) -> dict:
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in p.items()}


def test_checker_accepts_identical_codes(block: tuple) -> None:
    x, rust, ours = block
    res = parity.compare_block(x, rust, ours, "same")
    assert res.nears == [] and res.compared["residual_codes"] > 0


@pytest.mark.parametrize(
    "field", ["seg_id", "t_bits", "norm_bits", "residual_codes", "outlier_pos", "outlier_bits"]
)
def test_checker_rejects_a_wrong_code(block: tuple, field: str) -> None:
    x, rust, ours = block
    bad = _copy(ours)
    n, de = int(rust["n"]), int(rust["d_eff"])
    if field == "seg_id":
        bad["seg_id"][5] = (bad["seg_id"][5] + 1) % int(rust["k"])
    elif field in ("t_bits", "norm_bits"):
        bad[field][7] += 40
        stem = field.split("_")[0]
        scale = np.float32(2.0 ** int(bad[f"{stem}_exp"]))
        bad[stem] = bad[field].view(np.float16).astype(np.float32) * scale
    elif field == "residual_codes":
        codes = bad["residual_codes"].reshape(n, de)
        # The coordinate farthest from any threshold: a flip there is a real error.
        ex = parity.exact(x, rust)
        thr = ref.thresholds(torch.from_numpy(rust["centroids"])).double().numpy()
        dist = np.abs(ex.z[..., None] - thr).min(-1)
        i, j = np.unravel_index(int(np.argmax(dist)), dist.shape)
        codes[i, j] = codes[i, j] + 1 if codes[i, j] < 7 else codes[i, j] - 1
        bad["residual_packed"] = kt.pack_bits(codes.reshape(-1), 3)
    elif field == "outlier_pos":
        bad["outlier_pos"] = bad["outlier_pos"][1:]
        bad["outlier_bits"] = bad["outlier_bits"][1:]
        bad["outlier_val"] = bad["outlier_val"][1:]
    else:
        bad["outlier_bits"][0] ^= 0x0100
    with pytest.raises(harness.ParityError, match=field):
        parity.compare_block(x, rust, bad, "mutated")


def test_checker_rejects_a_wrong_stream(block: tuple) -> None:
    x, rust, ours = block
    bad = _copy(ours)
    raw = bytearray(bad["residual_packed"])
    raw[3] ^= 0x10
    bad["residual_packed"] = bytes(raw)
    with pytest.raises(harness.ParityError, match="residual_packed"):
        parity.compare_block(x, rust, bad, "mutated")


def test_checker_accepts_a_flip_on_a_threshold(block: tuple) -> None:
    """A flip is accepted (and reported) only where z lies within epsilon of the threshold."""
    x, rust, ours = block
    ex = parity.exact(x, rust)
    thr = ref.thresholds(torch.from_numpy(rust["centroids"])).double().numpy()
    n, de = int(rust["n"]), int(rust["d_eff"])
    codes = np.asarray(rust["residual_codes"]).reshape(n, de)
    dist = np.abs(ex.z - thr[np.clip(codes - 1, 0, 6)])
    dist[codes == 0] = np.inf
    i, j = np.unravel_index(int(np.argmin(dist)), dist.shape)
    # Move the oracle's own z onto the threshold by moving the limit: a tolerance that covers
    # this distance must accept the lower neighbour, a smaller one must not.
    bad = _copy(ours)
    c = bad["residual_codes"].reshape(n, de)
    c[i, j] -= 1
    bad["residual_packed"] = kt.pack_bits(c.reshape(-1), 3)
    old = parity.TOL["z"]
    try:
        parity.TOL["z"] = old * 1.001 * dist[i, j] / ex.eps_z[i]
        res = parity.compare_block(x, rust, bad, "on threshold")
        assert [n_.field for n_ in res.nears] == ["residual_codes"]
        parity.TOL["z"] = old * 0.5 * dist[i, j] / ex.eps_z[i]
        with pytest.raises(harness.ParityError, match="residual_codes"):
            parity.compare_block(x, rust, bad, "off threshold")
    finally:
        parity.TOL["z"] = old


def test_parts_have_the_extensions_names_and_dtypes(block: tuple) -> None:
    """The reference's dict and a kernel batch's block both mirror the extension's parts."""
    x, rust, ours = block
    skel = K.stack_skeletons([rust], DEVICE)
    codes = K.encode_blocks(torch.from_numpy(x[None]).to(DEVICE), skel)
    for other in (ours, K.block_parts(codes, skel, [len(x)], 0, rust)):
        assert set(other) == set(rust)
        for key, v in rust.items():
            w = other[key]
            assert type(w) is type(v), key
            if isinstance(v, np.ndarray):
                assert w.dtype == v.dtype and w.shape == v.shape, key
