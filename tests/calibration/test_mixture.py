"""Pooling the statistics of a mixture's domains: the moments of the mixture distribution, checked
against the moments of the pooled rows computed by hand on small synthetic statistics."""

from __future__ import annotations

import numpy as np
import pytest

from kakeyaturbo.calibration import AttentionStats, Sensitivity
from kakeyaturbo.calibration.mixture import pool_sensitivity, pool_stats
from kakeyaturbo.errors import InvalidParameterError

L, H, D = 2, 3, 5


def _rows(n: int, seed: int, shift: float) -> np.ndarray:
    """[L, H, n, D] rows of a Gaussian with its own mean and covariance per part."""
    g = np.random.default_rng(seed)
    a = g.standard_normal((L, H, D, D))
    return g.standard_normal((L, H, n, D)) @ a + shift


def _moments(x: np.ndarray):
    mean = x.mean(axis=2)
    c = x - mean[:, :, None]
    return mean, np.einsum("lhnd,lhne->lhde", c, c) / x.shape[2]


def _stats(k: np.ndarray, v: np.ndarray, q: np.ndarray, o_gram: np.ndarray, windows: int,
           samples: int) -> AttentionStats:
    km, kc = _moments(k)
    vm, vc = _moments(v)
    return AttentionStats(meta={"text": f"part{windows}", "windows": windows},
                          q2=np.einsum("lhnd,lhne->lhde", q, q) / q.shape[2],
                          k_mean=km, k_cov=kc, v_mean=vm, v_cov=vc, o_gram=o_gram,
                          k_samples=k[:, :, :samples].astype(np.float32),
                          v_samples=v[:, :, :samples].astype(np.float32))


def test_pooled_statistics_are_the_moments_of_the_pooled_rows() -> None:
    # Part a has 30 rows, part b 60: weights 1 : 2 make the mixture the plain union of the rows.
    n = {"a": 30, "b": 60}
    rows = {p: {s: _rows(n[p], seed, shift) for s, seed, shift in
                (("k", 1 + i, 3.0 * i), ("v", 11 + i, -2.0 * i), ("q", 21 + i, 0.5 * i))}
            for i, p in enumerate(n)}
    o_gram = np.broadcast_to(np.eye(D), (L, H, D, D)).copy()
    parts = [(_stats(rows[p]["k"], rows[p]["v"], rows[p]["q"], o_gram, w, 20), w)
             for p, w in (("a", 1), ("b", 2))]
    pooled = pool_stats(parts, samples=30, seed=3, meta={"text": "mix"})
    union = {s: np.concatenate([rows["a"][s], rows["b"][s]], axis=2) for s in "kvq"}
    for s in "kv":
        mean, cov = _moments(union[s])
        np.testing.assert_allclose(getattr(pooled, f"{s}_mean"), mean, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(getattr(pooled, f"{s}_cov"), cov, rtol=1e-10, atol=1e-10)
    q = union["q"]
    np.testing.assert_allclose(pooled.q2, np.einsum("lhnd,lhne->lhde", q, q) / q.shape[2],
                               rtol=1e-10, atol=1e-10)
    # The means differ between the parts, so the pooled covariance is more than the average of
    # the parts' covariances (the spread of the means adds to it).
    avg = (parts[0][0].k_cov + 2 * parts[1][0].k_cov) / 3
    assert np.all(np.trace(pooled.k_cov, axis1=2, axis2=3) > np.trace(avg, axis1=2, axis2=3))
    # Sample rows: 30, drawn from the parts in proportion (10 and 20), each a row of its part.
    assert pooled.k_samples.shape == (L, H, 30, D)
    ka, kb = parts[0][0].k_samples, parts[1][0].k_samples
    for layer in range(L):
        for h in range(H):
            from_a = [any(np.array_equal(r, x) for x in ka[layer, h]) for r in pooled.k_samples[layer, h]]
            from_b = [any(np.array_equal(r, x) for x in kb[layer, h]) for r in pooled.k_samples[layer, h]]
            assert sum(from_a) == 10 and sum(from_b) == 20
    assert pooled.meta["windows"] == 3 and pooled.meta["text"] == "mix"
    assert [p["weight"] for p in pooled.meta["parts"]] == pytest.approx([1 / 3, 2 / 3])
    # Seeded: the same draw again; a part alone is itself.
    again = pool_stats(parts, samples=30, seed=3)
    assert np.array_equal(again.k_samples, pooled.k_samples)
    alone = pool_stats(parts[:1])
    for name in ("q2", "k_mean", "k_cov", "v_mean", "v_cov"):
        np.testing.assert_allclose(getattr(alone, name), getattr(parts[0][0], name), rtol=1e-12)


def _gram(g: np.random.Generator, layers: int, heads: int) -> np.ndarray:
    """Random symmetric positive semi-definite ``[layers, heads, D, D]`` matrices (a sensitivity
    is a sum of gradients' outer products)."""
    a = g.random((layers, heads, D, D))
    return a @ np.swapaxes(a, -1, -2)


def test_pooled_sensitivity_is_the_weighted_average() -> None:
    g = np.random.default_rng(0)
    a = [Sensitivity(meta={"windows": w}, k=_gram(g, L, H), v=_gram(g, L, H)) for w in (3, 1)]
    p = pool_sensitivity([(a[0], 3), (a[1], 1)])
    np.testing.assert_allclose(p.k, 0.75 * a[0].k + 0.25 * a[1].k, rtol=1e-12)
    np.testing.assert_allclose(p.v, 0.75 * a[0].v + 0.25 * a[1].v, rtol=1e-12)
    assert p.meta["windows"] == 4


def test_pooling_refuses_what_does_not_pool() -> None:
    g = np.random.default_rng(0)
    s = Sensitivity(meta={}, k=_gram(g, L, H), v=_gram(g, L, H))
    other = Sensitivity(meta={}, k=_gram(g, L, 1), v=_gram(g, L, 1))
    with pytest.raises(InvalidParameterError, match="shapes"):
        pool_sensitivity([(s, 1), (other, 1)])
    for bad in ([], [(s, 0)], [(s, -1), (s, 2)], [(s, float("nan"))]):
        with pytest.raises(InvalidParameterError, match="weights"):
            pool_sensitivity(bad)
