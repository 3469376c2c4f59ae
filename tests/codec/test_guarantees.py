"""What the codec promises (README, "Guarantees"): no input aborts the interpreter, allocates
memory the input does not describe, or is silently lost; a wrong type is a TypeError and every
other error a KakeyaError. One test per class of issue 12, each failing on the build before
the fix."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import zlib
from typing import Any, Callable, Optional, Type

import numpy as np
import pytest
from tests.conftest import in_forked_child, kv_like

import kakeyaturbo as kt
from kakeyaturbo import _core

F32_MAX = float(np.finfo(np.float32).max)
X = kv_like(300, 16)


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    return float(np.linalg.norm(x64 - y) / np.linalg.norm(x64))


def _crc(b: bytearray) -> bytes:
    """The container with its CRC-32 recomputed, so that the structural checks are reached."""
    b[-4:] = zlib.crc32(bytes(b[:-4])).to_bytes(4, "little")
    return bytes(b)


def _limited(code: str, gib: Optional[int] = 2) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter whose address space is capped at `gib` GiB: an
    allocation sized by a corrupt field or a huge request aborts there (non-zero exit) instead
    of passing unnoticed on a machine that overcommits. `gib=None`: no cap."""
    prelude = "" if gib is None else (
        f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({gib << 30}, {gib << 30}))\n")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


needs_rlimit = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc: Linux")


def _calibration(m: int = 4, d: int = 16, spread: float = 1.0, seed: int = 0):
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    a = q[:m].astype(np.float32)
    return np.zeros(d, np.float32), a, a, np.full(m, spread, np.float32)


# ---- 1. allocation before a bounds check --------------------------------------------------


@needs_rlimit
def test_size_fields_are_checked_before_anything_is_allocated() -> None:
    # k = 1 gives 0-bit segment ids; n raised to 2**40 (CRC recomputed) made the reader ask for
    # 4 * (2**32 - 1) bytes before it checked that the rows' fields are present.
    r = _limited("""
        import zlib, numpy as np, kakeyaturbo as kt
        x = np.random.default_rng(0).standard_normal((70, 12)).astype(np.float32)
        b = bytearray(kt.encode_layer(x, k=1, block_size=2**32 - 1))
        b[10:18] = (2**40).to_bytes(8, "little")
        b[-4:] = zlib.crc32(bytes(b[:-4])).to_bytes(4, "little")
        try:
            kt.decode_layer(bytes(b))
        except kt.CorruptDataError:
            print("typed")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "typed", r.stderr[-2000:]


# ---- 2. unchecked size arithmetic on caller input -----------------------------------------


@needs_rlimit
@pytest.mark.parametrize("call, exc", [
    ("kt.unpack_bits(b'', 8, 2**61)", "CorruptDataError"),
    ("kt.unpack_bits(b'', 8, 2**64 - 1)", "CorruptDataError"),
    ("kt.wht_sign_pattern(0, 2**40)", "InvalidParameterError"),
])
def test_huge_requests_are_refused_not_allocated(call: str, exc: str) -> None:
    r = _limited(f"""
        import kakeyaturbo as kt
        try:
            {call}
        except kt.{exc}:
            print("typed")
    """)
    assert r.returncode == 0 and r.stdout.strip() == "typed", r.stderr[-2000:]


def test_parts_sizes_are_checked() -> None:
    parts = kt.encode_block_codes(X)
    with pytest.raises(kt.InvalidParameterError, match="k"):
        kt.decode_block_from_parts(dict(parts, k=2**62))
    c = kt.CalibratedCodec(*_calibration(), np.full(4, 3))
    cp = c.encode_parts(X)
    for n in (2**62, 2**64 + 5, -1):
        with pytest.raises(kt.InvalidParameterError, match="n"):
            c.decode_parts(dict(cp, n=n))
    no_norm = kt.CalibratedCodec(*_calibration(), np.full(4, 3), norm=False)
    with pytest.raises(kt.KakeyaError):
        no_norm.decode_parts(dict(no_norm.encode_parts(X), n=2**32 - 1))


@needs_rlimit
def test_broadcast_views_are_counted_before_they_are_copied() -> None:
    # A broadcast view holds one value and describes 2**34 or more: the parts entries were copied
    # before their count was checked (an abort: Rust's allocation failure), the calibration's
    # arrays, rows and rope tables copied or scanned by numpy first (MemoryError, a scan of
    # 2**40 bits running for minutes). Past the limits each is refused by its shape; within
    # them a copy too large for memory is an InvalidInputError.
    r = _limited("""
        import numpy as np, kakeyaturbo as kt
        B = np.broadcast_to
        d = 8
        eye = np.eye(d, dtype=np.float32)
        args = dict(mean=np.zeros(d, np.float32), analysis=eye, synthesis=eye,
                    spread=np.ones(d, np.float32), bits=np.full(d, 3))
        c = kt.CalibratedCodec(**args)
        cp = c.encode_parts(np.ones((2, d), np.float32))
        bp = kt.encode_block_codes(np.random.default_rng(0).standard_normal((64, d)).astype(np.float32))
        calls = [
            lambda: c.decode_parts(dict(cp, outlier_pos=B(np.int64(1), (2**34,)),
                                        outlier_bits=B(np.uint16(0x3c00), (2**34,)))),
            lambda: c.decode_parts(dict(cp, scale_bits=B(np.uint16(0x3c00), (2**34,)))),
            lambda: kt.decode_block_from_parts(dict(bp, mean=B(np.float32(0), (2**34,)))),
            lambda: kt.decode_block_from_parts(dict(bp, outlier_pos=B(np.int64(1), (2**34,)))),
            lambda: kt.CalibratedCodec(**dict(args, mean=B(np.float32(0), (2**40,)))),
            lambda: kt.CalibratedCodec(**dict(args, bits=B(np.uint8(3), (2**40,)))),
            lambda: kt.CalibratedCodec(**dict(args, analysis=B(np.float32(0), (2**20, 2**20)))),
            lambda: kt.CalibratedCodec(**args, centroids={3: B(np.float32(1), (2**31,))}),
            lambda: c.encode(B(np.float32(0), (2**40, d))),
            lambda: c.encode(B(np.float32(0), (2**32 - 1, d))),
            lambda: kt.encode_layer(B(np.float32(0), (2**32 - 1, d))),
            lambda: kt.RopeTable(B(np.float32(1), (2**20, 2**20)), B(np.float32(0), (2**20, 2**20))),
            lambda: kt.RopeTable(B(np.float32(1), (2**31, 2048)), B(np.float32(0), (2**31, 2048))),
            lambda: kt.RopeTable.from_full(B(np.float32(1), (2**31, 4096)), B(np.float32(0), (2**31, 4096))),
        ]
        for i, call in enumerate(calls):
            try:
                call()
                print(i, "accepted")
            except (kt.InvalidInputError, kt.InvalidParameterError):
                print(i, "typed")
    """, gib=4)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [w for i in range(14) for w in (str(i), "typed")], r.stdout


# ---- 3. large finite inputs ----------------------------------------------------------------


@pytest.mark.parametrize("k", [64, 80, 100, 127])
def test_per_block_rows_of_any_magnitude_round_trip(k: int) -> None:
    # The codec is scale-invariant: rows at 2**k code as well as at unit scale (they came back
    # all-NaN from 2**64 on, with containers their own decoder rejected).
    xs = (X / np.abs(X).max() * np.float32(2.0 ** (k - 1))).astype(np.float32)
    base = _rel(X, kt.roundtrip_layer(X, block_size=128)[0])
    for kw in (dict(), dict(metric="inner_product", outlier_threshold=2.0),
               dict(skeleton_dtype="fp32", share_basis=True)):
        y, _ = kt.roundtrip_layer(xs, block_size=128, **kw)
        assert np.isfinite(y).all(), kw
        assert np.array_equal(kt.decode_layer(kt.encode_layer(xs, block_size=128, **kw)), y)
        if not kw:
            assert _rel(xs, y) == pytest.approx(base, rel=0.02)


def test_rows_at_the_float32_maximum_round_trip() -> None:
    xm = (X / np.abs(X).max() * F32_MAX).astype(np.float32)
    for kw in (dict(), dict(bit_width=1, k=1), dict(metric="ip"), dict(skeleton_dtype="fp32")):
        y = kt.decode_layer(kt.encode_layer(xm, block_size=100, **kw))
        assert np.isfinite(y).all(), kw
        assert _rel(xm, y) < 0.35, kw
    parts = kt.encode_block_codes(xm)
    assert np.isfinite(parts["t"]).all() and np.isfinite(parts["norm"]).all()
    assert np.isfinite(kt.decode_block_from_parts(parts)).all()


@pytest.mark.parametrize("scale", [1e-30, 1e-38, 1e-42])
def test_tiny_rows_stay_finite(scale: float) -> None:
    xs = (X * np.float32(scale)).astype(np.float32)
    assert np.isfinite(kt.roundtrip_layer(xs, metric="ip")[0]).all()
    c = kt.CalibratedCodec(*_calibration(), np.full(4, 3), metric="inner_product")
    assert np.isfinite(c.decode(c.encode(xs))).all()


def test_calibrations_that_overflow_float32_are_refused() -> None:
    mean, a, s, _ = _calibration()
    with pytest.raises(kt.InvalidParameterError, match="spread"):
        kt.CalibratedCodec(mean, a, s, np.full(4, 1e-39, np.float32), np.full(4, 3))
    with pytest.raises(kt.InvalidParameterError, match="spread"):
        kt.CalibratedCodec(mean, a, s * 4, np.full(4, 3e38, np.float32), np.full(4, 3))


@pytest.mark.parametrize("norm", [True, False])
def test_calibrated_coefficients_beyond_float32_round_trip(norm: bool) -> None:
    # (x - mean) / spread overflows float32 for these rows: the row is coded in f64.
    mean, a, s, _ = _calibration()
    tiny = kt.CalibratedCodec(mean, a, s, np.full(4, 1e-30, np.float32), np.full(4, 4), norm=norm)
    unit = kt.CalibratedCodec(mean, a, s, np.full(4, 1.0, np.float32), np.full(4, 4), norm=norm)
    big = (X * np.float32(1e12)).astype(np.float32)
    y = tiny.decode(tiny.encode(big))
    assert np.isfinite(y).all()
    if norm:  # scale-invariant: the same error as the unit calibration on unit rows
        want = _rel(X, unit.decode(unit.encode(X)))
        assert _rel(big, y) == pytest.approx(want, rel=0.05)


def test_reconstructions_past_the_float32_maximum_saturate() -> None:
    # A spread near 3e38: the 2-bit centroid 1.51 of z = -1.1 reconstructs -4.5e38, which
    # decoded to -inf with no error. It now saturates at -f32::MAX.
    one = np.ones((1, 1), np.float32)
    c = kt.CalibratedCodec(np.zeros(1, np.float32), one, one, np.array([3e38], np.float32),
                           np.array([2]), norm=False)
    y = c.decode(c.encode(np.array([[-3.3e38]], np.float32)))
    assert y[0, 0] == -F32_MAX


def test_mutated_containers_never_decode_to_non_finite_values() -> None:
    # An fp32 basis entry of 3e38 with a valid CRC decoded to inf.
    b = bytearray(kt.encode_layer(X, skeleton_dtype="fp32", block_size=300))
    header = 4 + 2 + 4 + 8 + 4 + 4 + 8 + 8 + 4 + 4 + 4
    basis = header + 4 + 4 + 16 * 4
    b[basis:basis + 4] = struct.pack("<f", 3.0e38)
    assert np.isfinite(kt.decode_layer(_crc(b))).all()


# ---- 4, 5. typed exceptions ----------------------------------------------------------------

V = np.array([1, 2, 3], np.uint8)
M, A, S, SP = _calibration()
B = np.full(4, 3, np.uint8)


def _cal(seed: Any = 1, thr: Any = None, cent: Any = None) -> Any:
    return _core.CalibratedCodec(M, A, S, SP, B, seed, "mse", True, thr, cent)


def _layer() -> Any:
    """An empty layer of one kv-head coded by the calibration above (D = 16)."""
    c = kt.CalibratedCodec(M, A, S, SP, B)
    return kt.LayerCodes([c], [c])


@pytest.mark.parametrize("call, exc", [
    (lambda: kt.wht_sign_pattern(-1, 4), kt.InvalidParameterError),
    (lambda: kt.wht_sign_pattern(2**64, 4), kt.InvalidParameterError),
    (lambda: kt.wht_sign_pattern(0, -1), kt.InvalidParameterError),
    (lambda: kt.wht_sign_pattern("1", 4), TypeError),
    (lambda: kt.wht_sign_pattern(1.0, 4), TypeError),
    (lambda: kt.rotate_rows(np.ones((2, 4), np.float32), -1), kt.InvalidParameterError),
    (lambda: kt.inverse_rotate_rows(np.ones((2, 4), np.float32), 2**70), kt.InvalidParameterError),
    (lambda: kt.pack_bits(V, -1), kt.InvalidParameterError),
    (lambda: kt.pack_bits(V, 2**70), kt.InvalidParameterError),
    (lambda: kt.pack_bits(V, "2"), TypeError),
    (lambda: kt.unpack_bits(b"\0", 8, -1), kt.InvalidParameterError),
    (lambda: kt.unpack_bits(b"\0", 2**70, 1), kt.InvalidParameterError),
    (lambda: kt.centroids_gaussian(-1), kt.InvalidParameterError),
    (lambda: kt.centroids_gaussian(300), kt.InvalidParameterError),
    (lambda: kt.centroids_gaussian(True), TypeError),
    (lambda: kt.roundtrip_layer(X, variance_ratio=10**400), kt.InvalidParameterError),
    (lambda: kt.roundtrip_layer(X, rotation_seed=1.7), TypeError),
    (lambda: kt.roundtrip_layer(X, outlier_threshold="2"), TypeError),
    (lambda: _core.roundtrip_layer(X, {}, None, 0), kt.InvalidParameterError),
    (lambda: _core.roundtrip_layer(X, {}, None, "2"), TypeError),
    (lambda: _core.decode_layer(b"", -3), kt.InvalidParameterError),
    (lambda: _cal(seed=-1), kt.InvalidParameterError),
    (lambda: _cal(seed=2**64), kt.InvalidParameterError),
    (lambda: _cal(seed=1.7), TypeError),
    (lambda: _cal(seed="1"), TypeError),
    (lambda: _cal(seed=True), TypeError),
    (lambda: _cal(thr="2"), TypeError),
    (lambda: _cal(cent={300: [0.0, 1.0]}), kt.InvalidParameterError),
    (lambda: _cal(cent={-1: [0.0, 1.0]}), kt.InvalidParameterError),
    (lambda: _cal(cent={1: "ab"}), TypeError),
    (lambda: _cal(cent=[1.0, 2.0]), TypeError),
    (lambda: _cal(cent="tables"), TypeError),
    (lambda: _cal().decode(b"", -1), kt.InvalidParameterError),
    (lambda: _cal().encode(X, 1.5), TypeError),
    (lambda: _cal().decode_parts([1, 2]), TypeError),
    (lambda: _core.decode_block_from_parts([1, 2]), TypeError),
    # Python ints past float64's range: the package's own checks, not an OverflowError.
    (lambda: kt.CalibratedCodec(M, A, S, SP, B, outlier_threshold=10**400), kt.InvalidParameterError),
    (lambda: kt.decode_attention(_layer(), np.zeros((1, 2, 1, 16), np.float32), np.zeros((1, 1, 1, 16), np.float32),
                                 np.zeros((1, 1, 1, 16), np.float32), scale=10**400), kt.InvalidParameterError),
    (lambda: kt.decode_attention(_layer(), np.zeros((1, 2, 1, 16), np.float32), np.zeros((1, 1, 1, 16), np.float32),
                                 np.zeros((1, 1, 1, 16), np.float32), softcap=-10**400), kt.InvalidParameterError),
    # A layer's (batch row, kv-head) pairs are bounded (each holds an empty store per stream).
    (lambda: kt.LayerCodes([kt.CalibratedCodec(M, A, S, SP, B)] * 64, [kt.CalibratedCodec(M, A, S, SP, B)] * 64,
                           batch=2**20), kt.InvalidParameterError),
    (lambda: _layer().select([0] * (2**20 + 1)), kt.InvalidInputError),
])
def test_every_error_is_typed(call: Callable[[], Any], exc: Type[BaseException]) -> None:
    with pytest.raises(exc):
        call()


def test_thread_counts_above_the_cores_are_capped() -> None:
    c = _cal()
    assert c.encode(X, 2**70) == c.encode(X, 3000) == c.encode(X, None)
    assert kt.encode_layer(X, threads=2**70) == kt.encode_layer(X)


def test_custom_tables_may_be_a_dict_or_pairs() -> None:
    t = [float(v) * 1.05 for v in kt.centroids_gaussian(3)]
    assert _cal(cent={3: t}).fingerprint == _cal(cent=[(3, t)]).fingerprint != _cal().fingerprint


@pytest.mark.parametrize("key, value", [("bit_width", 9), ("bit_width", 300), ("bit_width", -1),
                                        ("t_exp", -128), ("norm_exp", 300), ("n", -1),
                                        ("rotation_seed", -1), ("d_eff", 10**30)])
def test_parts_scalars_are_range_checked(key: str, value: int) -> None:
    parts = kt.encode_block_codes(X)
    with pytest.raises(kt.InvalidParameterError, match=key):
        kt.decode_block_from_parts(dict(parts, **{key: value}))


def test_public_calibrated_codec_refuses_a_float_seed() -> None:
    # 1.7 was truncated to 1 by int() in the Python wrapper; now refused there (and in the binding).
    with pytest.raises(TypeError, match="rotation_seed must be an int"):
        kt.CalibratedCodec(M, A, S, SP, B, rotation_seed=1.7)
    with pytest.raises(kt.InvalidParameterError, match="rotation_seed"):
        kt.CalibratedCodec(M, A, S, SP, B, rotation_seed=-1)


# ---- 6. threads ----------------------------------------------------------------------------


@needs_rlimit
def test_thread_counts_do_not_pile_up_os_threads() -> None:
    # Forty distinct counts left 824 threads alive; threads=3000 spawned 3000.
    r = _limited("""
        import os, time, numpy as np, kakeyaturbo as kt
        def threads():
            with open("/proc/self/status") as f:
                return int(next(l for l in f if l.startswith("Threads:")).split()[1])
        x = np.random.default_rng(0).standard_normal((600, 8)).astype(np.float32)
        kt.roundtrip_layer(x, block_size=64)
        before = threads()
        for t in range(1, 41):
            kt.roundtrip_layer(x, block_size=64, threads=t)
        kt.roundtrip_layer(x, block_size=64, threads=3000)
        cores = len(os.sched_getaffinity(0))
        for _ in range(50):  # the threads of dropped pools end asynchronously
            if threads() - before <= 4 * cores:
                break
            time.sleep(0.1)
        print(before, threads(), cores)
    """, gib=None)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after, cores = map(int, r.stdout.split())
    # The global pool plus at most four cached pools smaller than the core count.
    assert after - before <= 4 * cores, (before, after, cores)


def test_a_forked_child_codes_on_threads_of_its_own() -> None:
    """rayon's pools keep their state across a fork but not their threads: a child forked after
    the parent coded on the global pool and on a pool of one thread waited forever for them (the
    build before the fix hung here). It codes the parent's bytes on pools of its own."""
    x = kv_like(4096, 64)
    want = {t: kt.encode_layer(x, threads=t) for t in (None, 1)}
    codec = kt.CalibratedCodec(M, A, S, SP, B)
    y = np.random.default_rng(3).standard_normal((3000, 16)).astype(np.float32)
    want_cal = codec.encode(y)

    def child() -> bool:
        same = all(kt.encode_layer(x, threads=t) == b for t, b in want.items())
        back = kt.decode_layer(want[None])
        return same and np.array_equal(back, kt.decode_layer(want[1], threads=1)) and (
            codec.encode(y) == want_cal)

    ok = in_forked_child(child)
    assert ok is not None, "the forked child hung"
    assert ok, "the child's bytes differ from the parent's"


# ---- 7. messages that name the parameter and the expected value ----------------------------


def test_messages_name_the_parameter_and_its_range() -> None:
    with pytest.raises(kt.InvalidParameterError, match=r"bit_width must be in 1\.\.=4, got 1606"):
        kt.roundtrip_layer(X, bit_width=2**200)
    with pytest.raises(kt.InvalidParameterError, match=r"bits must have shape \(4,\) to match analysis"):
        kt.CalibratedCodec(M, A, S, SP, B[:3])
    with pytest.raises(kt.InvalidParameterError, match=r"spread must have shape \(4,\)"):
        kt.CalibratedCodec(M, A, S, SP[:3], B)
    # The binding checks (and words) the same for callers of the extension itself.
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    with pytest.raises(kt.InvalidParameterError, match="analysis has 4 rows but bits has 3"):
        kt._core.CalibratedCodec(f32(M), f32(A), f32(S), f32(SP), np.asarray(B[:3], np.uint8),
                                 0xCAFEBABE, "mse", True, None, None)
    with pytest.raises(kt.InvalidParameterError, match="spread must hold 4 values"):
        kt._core.CalibratedCodec(f32(M), f32(A), f32(S), f32(SP[:3]), np.asarray(B, np.uint8),
                                 0xCAFEBABE, "mse", True, None, None)
    parts = kt.encode_block_codes(X)
    with pytest.raises(kt.InvalidParameterError, match=r'parts\["bit_width"\] must be in 1\.\.=4, got 9'):
        kt.decode_block_from_parts(dict(parts, bit_width=9))
    with pytest.raises(kt.InvalidInputError, match=r'parts\["centers"\] has \d+ values, expected k x d_eff'):
        kt.decode_block_from_parts(dict(parts, centers=parts["centers"][:-1]))
