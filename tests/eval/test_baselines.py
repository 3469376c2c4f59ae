"""The baselines quantise as their definitions say, and count their bits."""

from __future__ import annotations

import numpy as np
import pytest

from kakeyaturbo.eval import baselines as b

X = (np.random.default_rng(0).standard_normal((300, 64)) * 2).astype(np.float32)


def test_e4m3_grid() -> None:
    v = np.array([0.0, 1.0, 1.0625, 1.0626, 1.1875, 448.0, 500.0, -3.3, 2.0**-9, 2.0**-10 * 1.01])
    want = np.array([0.0, 1.0, 1.0, 1.125, 1.25, 448.0, 448.0, -3.25, 2.0**-9, 2.0**-9])
    np.testing.assert_array_equal(b.round_e4m3(v), want.astype(np.float32))


def test_bf16_rounding() -> None:
    v = np.array([1.0, 1.00390625, 1.005859375, 3.14159265], np.float32)
    np.testing.assert_array_equal(b.round_bf16(v), np.array([1.0, 1.0, 1.0078125, 3.140625], np.float32))


@pytest.mark.parametrize(
    "name, bits, max_rel",
    [("identity", 16, 0.0), ("bf16", 16, 0.005), ("fp8_e4m3", 8.25, 0.05), ("int4", 4.25, 0.2),
     ("turboquant3", 3.25, 0.25), ("turboquant4", 4.25, 0.13)],
)
def test_bits_and_error(name: str, bits: float, max_rel: float) -> None:
    y, cost = b.BASELINES[name](X, "k")
    assert y.shape == X.shape and y.dtype == np.float32
    assert cost / X.size == pytest.approx(bits)
    assert np.linalg.norm(y - X) / np.linalg.norm(X) <= max_rel


def test_turboquant_matches_lloyd_max_error() -> None:
    y, _ = b.turboquant(X, 3)
    rel2 = np.sum((y - X) ** 2) / np.sum(X**2)
    assert rel2 == pytest.approx(0.0345, rel=0.15)


def test_kivi_layout_and_bits() -> None:
    t, d = X.shape
    n_q = (t - 128) // 32 * 32  # 160 quantised tokens, 140 kept in fp16
    yk, ck = b.kivi(X, "k")
    yv, cv = b.kivi(X, "v")
    assert ck == n_q * d * 2 + (n_q // 32) * d * 32 + (t - n_q) * d * 16
    assert cv == n_q * d * 2 + n_q * (d // 32) * 32 + (t - n_q) * d * 16
    np.testing.assert_allclose(yk[n_q:], X[n_q:], rtol=1e-3)
    # 2-bit asymmetric: 4 levels per group, so at most 4 distinct values per key channel group.
    assert len(np.unique(yk[:32, 0])) <= 4
    assert len(np.unique(yv[0, :32])) <= 4
    with pytest.raises(ValueError):
        b.kivi(X, "q")
