"""The calibrated mode: container round trips, water-filling against its closed form, the
whitening identity, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kakeyaturbo as kt
from kakeyaturbo import calibrate

D = 32


def _data(n: int = 2000, d: int = D, seed: int = 0):
    g = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    lam = 2.0 * 0.85 ** np.arange(d)
    x = (g.standard_normal((n, d)) * np.sqrt(lam)) @ q.T + 0.3
    return x.astype(np.float32), q, lam


def _codec(bpe: float = 3.0, **kw) -> tuple:
    x, _, _ = _data()
    fit = calibrate.fit_stream(x.mean(0), np.cov(x.T, bias=True), bpe)
    return fit.codec(**kw), x, fit


def test_container_round_trip_and_bytes() -> None:
    c, x, fit = _codec(3.0, outlier_threshold=3.0, metric="inner_product")
    y, r = c.roundtrip(x)
    blob = c.encode(x)
    assert np.array_equal(c.decode(blob), y)
    assert len(blob) == r["compressed_bytes"]
    assert r["code_bytes"] == x.shape[0] * c.row_bytes
    assert c.row_bits == int(fit.bits.sum()) and c.row_bits <= 3 * D - 16
    n = x.shape[0]
    assert r["scale_bytes"] == 1 + 2 * n  # shared exponent + one fp16 per row
    per_row = 8 * (r["code_bytes"] + r["scale_bytes"] - 1) / n
    assert per_row <= 3.0 * D
    assert r["bits_per_element"] == pytest.approx(8 * r["compressed_bytes"] / x.size)
    info = c.inspect(blob)
    assert info["fingerprint"] == c.fingerprint and info["num_vecs"] == x.shape[0]
    assert c.model_bytes == len(c.canonical_bytes())
    parts = c.encode_parts(x)
    assert np.array_equal(c.decode_parts(parts), y)
    assert parts["indices"].shape == (x.shape[0], c.m)


def test_error_tracks_water_filling_prediction() -> None:
    # Gaussian data fitted on itself: the decoded squared error per row is the water-filling
    # distortion sum_j var_j * LM(b_j) plus the variance of dropped components, within 15 %.
    c, x, fit = _codec(2.5)
    y = c.decode(c.encode(x))
    measured = np.mean(np.sum((x.astype(np.float64) - y) ** 2, axis=1))
    lm = np.array(calibrate.LLOYD_MAX_MSE)
    m = len(fit.bits)
    predicted = np.sum(fit.variances[:m] * lm[fit.bits]) + np.sum(fit.variances[m:])
    assert abs(measured / predicted - 1) < 0.15, (measured, predicted)


def test_more_bits_never_hurt() -> None:
    errs = []
    for bpe in (1.5, 2.0, 3.0, 4.0, 6.0):
        c, x, _ = _codec(bpe)
        errs.append(c.roundtrip(x)[1]["relative_error"])
    assert all(a > b for a, b in zip(errs, errs[1:])), errs


def test_water_filling_matches_the_closed_form() -> None:
    # With the ideal distortion 4^-b and no cap, integer greedy allocation lands within one
    # bit of the closed-form rates R_j = max(0, log2(var_j / theta) / 2) and spends the budget.
    lam = 3.0 * 0.8 ** np.arange(48)
    budget = 96
    ideal = [4.0**-b for b in range(40)]
    bits = calibrate.allocate_bits(lam, budget, max_bits=39, distortion=ideal)
    rates, theta = calibrate.water_fill_rates(lam, budget)
    assert bits.sum() == budget
    assert np.all(np.abs(bits - rates) <= 1.0 + 1e-9)
    assert np.all(np.diff(bits) <= 0)
    # Components below the water level get nothing; the distortion is sum min(theta, var).
    assert np.all(bits[lam < theta / 4] == 0)
    d_int = np.sum(lam * np.power(4.0, -bits))
    d_closed = np.sum(np.minimum(theta, lam))
    assert d_closed <= d_int <= 1.25 * d_closed


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=40), st.integers(0, 200),
       st.integers(1, 8))
def test_allocation_is_greedy_optimal(lam, budget, max_bits) -> None:
    bits = calibrate.allocate_bits(lam, budget, max_bits)
    lm = np.array(calibrate.LLOYD_MAX_MSE)
    a = np.array(lam)
    assert bits.min() >= 0 and bits.max() <= max_bits and bits.sum() <= budget
    # No single move of one bit from one component to another lowers the distortion.
    cost = np.sum(a * lm[bits])
    for i in range(len(a)):
        for j in range(len(a)):
            if i != j and bits[i] > 0 and bits[j] < max_bits:
                b2 = bits.copy()
                b2[i] -= 1
                b2[j] += 1
                assert np.sum(a * lm[b2]) >= cost - 1e-9 * (1 + cost)


def test_whitening_identity() -> None:
    # MSE of whitened keys equals the expected squared error of q . k under the calibration
    # queries (up to the ridge).
    g = np.random.default_rng(1)
    q = g.standard_normal((4000, D)) * np.linspace(3, 0.2, D) + 0.5
    s_q = q.T @ q / len(q)
    lw = calibrate.whitening_factor(s_q, ridge=0.0)
    k = g.standard_normal((300, D))
    e = g.standard_normal((300, D)) * 0.1
    lhs = np.mean(np.sum((e @ lw) ** 2, axis=1))
    rhs = np.mean((q @ e.T) ** 2)
    assert lhs == pytest.approx(rhs, rel=1e-9)
    # Whitening and un-whitening are exact inverses, through the codec's analysis/synthesis.
    fit = calibrate.fit_stream(np.zeros(D), np.cov(k.T), 16.0, whitening=lw, max_bits=8)
    assert fit.analysis.shape == (D, D)
    np.testing.assert_allclose(fit.synthesis.T @ fit.analysis, np.eye(D), atol=1e-9)
    xw = (k @ lw) @ np.linalg.inv(lw)
    np.testing.assert_allclose(xw, k, atol=1e-10)


def test_whitened_keys_lower_the_qk_error() -> None:
    # At equal bits, fitting in the query-whitened space lowers E[(q . (k - k^))^2] below
    # the plain PCA fit on anisotropic queries.
    g = np.random.default_rng(2)
    x, _, _ = _data(3000, seed=3)
    q = g.standard_normal((2000, D)) * np.geomspace(4, 0.05, D)[::-1]
    s_q = q.T @ q / len(q)
    mean, cov = x.mean(0), np.cov(x.T, bias=True)
    errs = {}
    for name, w in (("plain", None), ("whitened", calibrate.whitening_factor(s_q))):
        c = calibrate.fit_stream(mean, cov, 2.0, whitening=w).codec()
        e = x - c.decode(c.encode(x))
        errs[name] = np.mean((e @ q.T) ** 2)
    assert errs["whitened"] < 0.7 * errs["plain"], errs


def test_custom_tables_and_lloyd_fit() -> None:
    z = np.random.default_rng(4).laplace(size=20000)
    t = calibrate.lloyd_max(z, 3)
    assert len(t) == 8 and np.all(np.diff(t) > 0)
    gauss = kt.centroids_gaussian(3)
    assert t[-1] > gauss[-1]  # heavier tails than N(0, 1) spread the outer levels
    c, x, fit = _codec(3.0)
    widths = sorted(set(int(b) for b in fit.bits))
    c2 = fit.codec(centroids={b: kt.centroids_gaussian(b) * 1.01 for b in widths})
    assert c2.fingerprint != c.fingerprint
    assert not np.array_equal(c2.decode(c2.encode(x)), c.decode(c.encode(x)))


def test_bad_input_and_other_calibrations() -> None:
    c, x, fit = _codec(3.0)
    with pytest.raises(TypeError):
        c.encode(x.astype(np.float64))
    bad = x.copy()
    bad[3, 4] = np.nan
    with pytest.raises(kt.InvalidInputError):
        c.encode(bad)
    with pytest.raises(kt.InvalidInputError):
        c.encode(x[:, :5].copy())
    with pytest.raises(kt.InvalidInputError):
        c.encode(np.zeros((0, D), np.float32))
    blob = c.encode(x[:100])
    with pytest.raises(kt.CorruptDataError):
        c.decode(blob[:-3])
    flipped = bytearray(blob)
    flipped[60] ^= 1
    with pytest.raises(kt.CorruptDataError):
        c.decode(bytes(flipped))
    with pytest.raises(kt.CorruptDataError):
        c.decode(kt.encode_layer(x[:100]))
    other = calibrate.fit_stream(x.mean(0), np.cov(x.T, bias=True), 2.0).codec()
    with pytest.raises(kt.InvalidParameterError, match="different calibration"):
        other.decode(blob)
    with pytest.raises(kt.InvalidParameterError):
        fit.codec(metric="inner_product", norm=False)
    with pytest.raises(kt.InvalidParameterError):
        kt.CalibratedCodec(fit.mean, fit.analysis, fit.synthesis, -fit.spread, fit.bits)
    with pytest.raises(kt.InvalidParameterError):
        kt.CalibratedCodec(fit.mean, fit.analysis, fit.synthesis, fit.spread, fit.bits * 0)
    with pytest.raises(kt.InvalidInputError):
        kt.CalibratedCodec(fit.mean, fit.analysis, fit.synthesis[:, :3], fit.spread, fit.bits)


def test_deterministic_across_threads() -> None:
    c, x, _ = _codec(3.0, outlier_threshold=2.5)
    big = np.tile(x, (3, 1))
    assert c.encode(big, threads=1) == c.encode(big, threads=2)


def test_tables_fitted_on_the_codecs_own_z_lower_the_error() -> None:
    # Heavy-tailed rows (Laplace coefficients): per-width Lloyd-Max tables fitted on the codec's
    # z (pooled over two "heads") beat the N(0, 1) tables on fresh rows of the same kind.
    g = np.random.default_rng(5)
    q, _ = np.linalg.qr(g.standard_normal((D, D)))
    lam = 0.8 ** np.arange(D)

    def rows(n):
        return ((g.laplace(size=(n, D)) * np.sqrt(lam / 2)) @ q.T).astype(np.float32)

    train, test = rows(4000), rows(2000)
    fit = calibrate.fit_stream(np.zeros(D), q @ np.diag(lam) @ q.T, 3.0, norm=False)
    plain = fit.codec(norm=False)
    tables = calibrate.fit_tables({(0, 0): plain, (0, 1): plain},
                                  np.stack([train[:2000], train[2000:]])[None])
    assert set(tables) == set(int(b) for b in fit.bits)
    tuned = fit.codec(norm=False, centroids=tables)
    e_plain = np.mean((test - plain.decode(plain.encode(test))) ** 2)
    e_tuned = np.mean((test - tuned.decode(tuned.encode(test))) ** 2)
    assert e_tuned < 0.97 * e_plain, (e_tuned, e_plain)


def test_global_allocation_moves_bits_to_where_variance_is() -> None:
    loud = 4.0 * 0.85 ** np.arange(D)
    quiet = 0.01 * 0.85 ** np.arange(D)
    per_head = [calibrate.allocate_bits(sp, 64) for sp in (loud, quiet)]
    glob = calibrate.global_allocation([loud, quiet], [64, 64])
    assert all(b.sum() % 8 == 0 for b in glob)
    assert sum(b.sum() for b in glob) <= 128
    assert glob[0].sum() > per_head[0].sum() and glob[1].sum() < per_head[1].sum()
    lm = np.array(calibrate.LLOYD_MAX_MSE)
    cost = lambda alloc: sum(np.sum(sp * lm[b]) for sp, b in zip((loud, quiet), alloc))  # noqa: E731
    assert cost(glob) < cost(per_head)
    # Bytes freed by trimming every head to whole bytes go back: the pooled budget is spent.
    assert sum(b.sum() for b in glob) == 128
    spectra = [s * 0.8 ** np.arange(D) for s in (1.0, 0.37, 0.11)]
    three = calibrate.global_allocation(spectra, [40, 40, 40])
    assert sum(b.sum() for b in three) == 120 and all(b.sum() % 8 == 0 and b.sum() >= 8 for b in three)
    # A head the pooled water-filling leaves empty still gets its byte, paid for by the others.
    tight = calibrate.global_allocation([loud, 1e-12 * loud, quiet], [8, 8, 8])
    assert [int(b.sum()) for b in tight] == [8, 8, 8]
