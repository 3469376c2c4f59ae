"""Fitting: the whitening identity, whitened fits at equal bits, the decoded error against the
water-filling prediction, Lloyd-Max tables fitted on the codec's own z."""

from __future__ import annotations

import numpy as np
import pytest

import kakeyaturbo as kt
from kakeyaturbo import calibration, recipes
from kakeyaturbo.calibration.mixture import pool_stats
from kakeyaturbo.calibration.stats import MAX_LAYERS
from tests.synthetic_stats import synthetic_stats

D = 32


def _data(n: int = 2000, d: int = D, seed: int = 0):
    g = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    lam = 2.0 * 0.85 ** np.arange(d)
    x = (g.standard_normal((n, d)) * np.sqrt(lam)) @ q.T + 0.3
    return x.astype(np.float32), q, lam


def _codec(bpe: float = 3.0, **kw) -> tuple:
    x, _, _ = _data()
    fit = calibration.fit_stream(x.mean(0), np.cov(x.T, bias=True), bpe)
    return fit.codec(**kw), x, fit


def test_whitening_identity() -> None:
    # MSE of whitened keys equals the expected squared error of q . k under the calibration
    # queries (up to the ridge).
    g = np.random.default_rng(1)
    q = g.standard_normal((4000, D)) * np.linspace(3, 0.2, D) + 0.5
    s_q = q.T @ q / len(q)
    lw = calibration.whitening_factor(s_q, ridge=0.0)
    k = g.standard_normal((300, D))
    e = g.standard_normal((300, D)) * 0.1
    lhs = np.mean(np.sum((e @ lw) ** 2, axis=1))
    rhs = np.mean((q @ e.T) ** 2)
    assert lhs == pytest.approx(rhs, rel=1e-9)
    # Whitening and un-whitening are exact inverses, through the codec's analysis/synthesis.
    fit = calibration.fit_stream(np.zeros(D), np.cov(k.T), 16.0, whitening=lw, max_bits=8)
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
    for name, w in (("plain", None), ("whitened", calibration.whitening_factor(s_q))):
        c = calibration.fit_stream(mean, cov, 2.0, whitening=w).codec()
        e = x - c.decode(c.encode(x))
        errs[name] = np.mean((e @ q.T) ** 2)
    assert errs["whitened"] < 0.7 * errs["plain"], errs



def test_tables_fitted_on_the_codecs_own_z_lower_the_error() -> None:
    # Heavy-tailed rows (Laplace coefficients): per-width Lloyd-Max tables fitted on the codec's
    # z (pooled over two "heads") beat the N(0, 1) tables on fresh rows of the same kind.
    g = np.random.default_rng(5)
    q, _ = np.linalg.qr(g.standard_normal((D, D)))
    lam = 0.8 ** np.arange(D)

    def rows(n):
        return ((g.laplace(size=(n, D)) * np.sqrt(lam / 2)) @ q.T).astype(np.float32)

    train, test = rows(4000), rows(2000)
    fit = calibration.fit_stream(np.zeros(D), q @ np.diag(lam) @ q.T, 3.0, norm=False)
    plain = fit.codec(norm=False)
    tables = calibration.fit_tables({(0, 0): plain, (0, 1): plain},
                                  np.stack([train[:2000], train[2000:]])[None])
    assert set(tables) == set(int(b) for b in fit.bits)
    tuned = fit.codec(norm=False, centroids=tables)
    e_plain = np.mean((test - plain.decode(plain.encode(test))) ** 2)
    e_tuned = np.mean((test - tuned.decode(tuned.encode(test))) ** 2)
    assert e_tuned < 0.97 * e_plain, (e_tuned, e_plain)



def test_error_tracks_water_filling_prediction() -> None:
    # Gaussian data fitted on itself: the decoded squared error per row is the water-filling
    # distortion sum_j var_j * LM(b_j) plus the variance of dropped components, within 15 %.
    c, x, fit = _codec(2.5)
    y = c.decode(c.encode(x))
    measured = np.mean(np.sum((x.astype(np.float64) - y) ** 2, axis=1))
    lm = np.array(calibration.LLOYD_MAX_MSE)
    m = len(fit.bits)
    predicted = np.sum(fit.variances[:m] * lm[fit.bits]) + np.sum(fit.variances[m:])
    assert abs(measured / predicted - 1) < 0.15, (measured, predicted)



def test_more_bits_never_hurt() -> None:
    errs = []
    for bpe in (1.5, 2.0, 3.0, 4.0, 6.0):
        c, x, _ = _codec(bpe)
        errs.append(c.roundtrip(x)[1]["relative_error"])
    assert all(a > b for a, b in zip(errs, errs[1:])), errs


_stats = synthetic_stats


def test_statistics_are_checked_when_made_and_loaded(tmp_path) -> None:
    good = _stats()
    bad = good.k_cov.copy()
    bad[1, 0, 2, 2] = np.nan
    with pytest.raises(kt.InvalidParameterError, match="k_cov.*NaN"):
        _stats(k_cov=bad)
    with pytest.raises(kt.InvalidParameterError, match="v_mean.*shape"):
        _stats(v_mean=np.zeros((3, 1, 8)))  # a layer more than q2
    with pytest.raises(kt.InvalidParameterError, match="q2"):
        _stats(q2=np.zeros((2, 8, 8)))
    path, side = good.save(tmp_path / "s.safetensors")
    back = calibration.AttentionStats.load(path)
    assert np.array_equal(back.k_cov, good.k_cov)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(kt.CorruptDataError, match="s.safetensors"):
        calibration.AttentionStats.load(path)
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(kt.CorruptDataError, match="s.safetensors"):
        calibration.AttentionStats.load(path)
    good.save(path)
    side.write_text("[1, 2]")
    with pytest.raises(kt.CorruptDataError, match="JSON object"):
        calibration.AttentionStats.load(path)
    with pytest.raises(kt.InvalidParameterError, match="does not exist"):
        calibration.AttentionStats.load(tmp_path / "none.safetensors")
    (tmp_path / "adir").mkdir()
    with pytest.raises(kt.InvalidParameterError, match="adir' is a directory"):
        calibration.AttentionStats.load(tmp_path / "adir")
    for bad in ("", "/"):  # ValueError from the sidecar's name before
        with pytest.raises(kt.InvalidParameterError, match="names no file"):
            calibration.AttentionStats.load(bad)
        with pytest.raises(kt.InvalidParameterError, match="names no file"):
            good.save(bad)
    # Arrays that disagree on the number of layers, written by hand, are corrupt data.
    from safetensors.numpy import save_file

    arrays = {k: np.ascontiguousarray(getattr(good, k)) for k in good.ARRAYS}
    arrays["o_gram"] = arrays["o_gram"][:1]
    save_file(arrays, str(path))
    side.write_text("{}")
    with pytest.raises(kt.CorruptDataError, match="o_gram"):
        calibration.AttentionStats.load(path)


@pytest.mark.parametrize("side, field", [
    ('{"windows": "many"}', "windows"), ('{"windows": NaN}', "windows"),
    ('{"windows": Infinity}', "windows"), ('{"windows": [1]}', "windows"),
    ('{"windows": true}', "windows"), ('{"windows": -1}', "windows"), ('{"windows": 2.0}', "windows"),
    ('{"layer_index": [0, %d]}' % 10**400, "layer_index"),
    ('{"layer_index": [0, %d]}' % MAX_LAYERS, "layer_index")])
def test_a_sidecar_of_bad_meta_is_corrupt(tmp_path, side, field) -> None:
    # Refused on load, not where pooling reads it (int("many"): a bare ValueError).
    good = _stats()
    sens = calibration.Sensitivity(meta={}, k=good.k_cov, v=good.v_cov)
    for cls, stored in ((calibration.AttentionStats, good), (calibration.Sensitivity, sens)):
        path, sidecar = stored.save(tmp_path / "s.safetensors")
        sidecar.write_text(side)
        with pytest.raises(kt.CorruptDataError, match=f"s.safetensors.*'{field}'"):
            cls.load(path)
    with pytest.raises(kt.InvalidParameterError, match="'windows'"):
        _stats(meta={"windows": "many"})
    with pytest.raises(TypeError, match="meta must be a dict"):
        calibration.Sensitivity(meta=[1], k=good.k_cov, v=good.v_cov)


def test_pooling_sums_the_windows_loaded() -> None:
    parts = [(_stats(meta={"windows": 3, "layer_index": [0, 4095]}), 1.0),
             (_stats(meta={"windows": 2, "layer_index": [0, 4095]}), 1.0)]
    assert pool_stats(parts).meta["windows"] == 5


def test_statistics_that_cannot_be_factored_name_the_head() -> None:
    q2 = _stats().q2.copy()
    q2[1, 0] = np.eye(8)
    q2[1, 0, 0, 1] = q2[1, 0, 1, 0] = 2.0  # indefinite (the diagonal is fine): no Cholesky factor
    stats = _stats(q2=q2)
    rec = recipes.Recipe(name="q", mode="calibrated", k={"whiten": "query", "bits": 3},
                         v={"bits": 3}, streams=("k", "v"))
    with pytest.raises(kt.NumericalError, match="layer 1, kv-head 0"):
        calibration.ModelCodec(stats, rec)


def test_lloyd_max_checks_the_width_before_the_table_size() -> None:
    """bits outside 1..8 (the widths of centroid tables) are refused at once: 2 ** bits of a
    huge width took seconds (2**31) or ran out of memory (2**70) before the refusal."""
    z = np.random.default_rng(0).standard_normal(600)
    for bits in (0, 9, 2 ** 31, 2 ** 70):
        with pytest.raises(kt.InvalidParameterError, match="bits must be in 1..8"):
            calibration.lloyd_max(z, bits)
    assert len(calibration.lloyd_max(z, 8, iters=0)) == 256
