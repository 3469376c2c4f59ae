"""Sign pattern, Hadamard, rotation, packing and Lloyd-Max tables against independent
references written here in plain Python/numpy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kakeyaturbo as kt

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
M64 = (1 << 64) - 1


def splitmix_signs(seed: int, n: int) -> list:
    """The format spec's generator, re-implemented from FORMAT.md."""
    s, out = seed, []
    for _ in range(n):
        s = (s + 0x9E3779B97F4A7C15) & M64
        z = s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z ^= z >> 31
        out.append(-1.0 if z >> 63 else 1.0)
    return out


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def test_sign_pattern_golden_and_spec() -> None:
    golden = json.loads((GOLDEN / "signs.json").read_text())
    for seed, pattern in golden.items():
        got = kt.wht_sign_pattern(int(seed), 64)
        assert "".join("-" if v < 0 else "+" for v in got) == pattern
        assert got.tolist() == splitmix_signs(int(seed), 64)
        assert got.dtype == np.float32


@pytest.mark.parametrize("w", [1, 2, 4, 64, 128, 256])
def test_wht_matches_the_matrix(w: int) -> None:
    x = np.random.default_rng(w).standard_normal((5, w)).astype(np.float32)
    np.testing.assert_allclose(kt.wht_rows(x), x @ hadamard(w).T, rtol=1e-5, atol=1e-4)


@given(st.integers(0, M64), st.sampled_from([1, 8, 64, 128, 256]), st.integers(1, 9))
def test_rotation_and_inverse(seed: int, w: int, n: int) -> None:
    x = np.random.default_rng(n).standard_normal((n, w)).astype(np.float32)
    s = np.asarray(splitmix_signs(seed, w))
    y = kt.rotate_rows(x, seed)
    np.testing.assert_allclose(y, (x * s) @ hadamard(w).T, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(kt.inverse_rotate_rows(y, seed), x, rtol=1e-4, atol=1e-5)


def test_rotation_rejects_non_powers_of_two() -> None:
    with pytest.raises(kt.InvalidInputError):
        kt.wht_rows(np.zeros((2, 96), np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_transforms_refuse_non_finite_rows(bad: float) -> None:
    x = np.ones((3, 8), np.float32)
    x[1, 5] = bad
    for call in (kt.wht_rows, lambda a: kt.rotate_rows(a, 7), lambda a: kt.inverse_rotate_rows(a, 7)):
        with pytest.raises(kt.InvalidInputError, match="finite"):
            call(x)


def test_transforms_refuse_an_overflowing_row() -> None:
    x = np.full((2, 16), 3.0e38, np.float32)
    with pytest.raises(kt.InvalidInputError, match="overflows float32"):
        kt.wht_rows(x)
    with pytest.raises(kt.InvalidInputError, match="overflows float32"):
        kt.rotate_rows(x, 0)
    y = np.full((2, 16), 1.0e37, np.float32)  # finite in and out
    assert np.isfinite(kt.rotate_rows(y, 0)).all()


def test_pack_golden() -> None:
    assert kt.pack_bits(np.array([1, 2, 3, 4, 5, 6]), 3) == bytes([0xD1, 0x58, 0x03])
    assert kt.pack_bits(np.array([0xA, 0x5]), 4) == bytes([0x5A])
    assert kt.pack_bits(np.array([], dtype=np.uint8), 2) == b""


@given(st.integers(1, 8), st.lists(st.integers(0, 255), max_size=300))
def test_pack_round_trip(bits: int, raw: list) -> None:
    v = np.array(raw, dtype=np.uint8) & ((1 << bits) - 1)
    packed = kt.pack_bits(v, bits)
    # Independent reference: LSB-first means value i at stream bits [i*b, (i+1)*b).
    ref = sum(int(x) << (i * bits) for i, x in enumerate(v)).to_bytes(len(packed), "little")
    assert packed == ref
    np.testing.assert_array_equal(kt.unpack_bits(packed, bits, len(v)), v)


def test_pack_errors() -> None:
    with pytest.raises(kt.InvalidParameterError):
        kt.pack_bits(np.array([4]), 2)
    with pytest.raises(kt.InvalidParameterError):
        kt.pack_bits(np.array([1]), 9)
    with pytest.raises(kt.CorruptDataError):
        kt.unpack_bits(b"\x00", 3, 5)
    with pytest.raises(TypeError):
        kt.pack_bits(np.array([0.5]), 2)


def _phi(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("bits, mse", [(1, 0.36338023), (2, 0.11748185), (3, 0.034547761),
                                       (4, 0.0095010080), (5, 0.0025046684), (6, 0.00064423967),
                                       (7, 0.00016347823), (8, 0.000041185083)])
def test_gaussian_tables_are_lloyd_max(bits: int, mse: float) -> None:
    c = kt.centroids_gaussian(bits).astype(np.float64)
    assert len(c) == 2**bits and np.all(np.diff(c) > 0)
    edges = [-math.inf] + list((c[1:] + c[:-1]) / 2) + [math.inf]
    total = 0.0
    for i, ci in enumerate(c):
        a, b = edges[i], edges[i + 1]
        p = _cdf(b) - _cdf(a)
        m1 = (_phi(a) if a > -math.inf else 0) - (_phi(b) if b < math.inf else 0)
        # Centroid condition: each centroid is the conditional mean of its cell.
        assert abs(m1 / p - ci) < 2e-7 * max(1.0, abs(ci))  # f32 storage
        m2 = p + (a * _phi(a) if a > -math.inf else 0) - (b * _phi(b) if b < math.inf else 0)
        total += m2 - 2 * ci * m1 + ci * ci * p
    assert abs(total - mse) < 1e-4 * mse
    with pytest.raises(kt.InvalidParameterError):
        kt.centroids_gaussian(9)
