"""Degenerate input to the public calibration helpers (typed errors naming the argument, never a
numpy error or a non-finite result), and statistics whose covariances are not covariances."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

import kakeyaturbo as kt
from kakeyaturbo import calibrate, calibration, recipes
from tests.synthetic_stats import synthetic_stats

D = 8


def _spd(d: int = D, seed: int = 0) -> np.ndarray:
    a = np.random.default_rng(seed).standard_normal((d, d))
    return a @ a.T / d + np.eye(d)


_stats = partial(synthetic_stats, heads=2, d=D, seed=1)


def _recipe(**k) -> recipes.Recipe:
    return recipes.Recipe(name="q", mode="calibrated", k=dict({"bits": 3}, **k), v={"bits": 3},
                          streams=("k", "v"))


# --- D10: the helpers -------------------------------------------------------------------------

def test_whitening_factor_refuses_what_it_cannot_factor() -> None:
    s = _spd()
    nan = s.copy()
    nan[0, 0] = np.nan
    with pytest.raises(kt.InvalidInputError, match="second_moment.*NaN"):
        calibration.whitening_factor(nan)
    for shape in ((D,), (D, 5), (2, D, D)):
        with pytest.raises(kt.InvalidInputError, match="square"):
            calibration.whitening_factor(np.ones(shape))
    with pytest.raises(kt.InvalidInputError, match="negative"):
        calibration.whitening_factor(-s)
    for ridge in (np.nan, np.inf, -1.0):
        with pytest.raises(kt.InvalidParameterError, match="ridge"):
            calibration.whitening_factor(s, ridge=ridge)
    indefinite = np.eye(D)
    indefinite[0, 1] = indefinite[1, 0] = 2.0  # eigenvalue -1, diagonal fine
    with pytest.raises(kt.NumericalError):
        calibration.whitening_factor(indefinite, ridge=0.0)
    # the old name is the same function
    assert calibrate.whitening_factor is calibration.whitening_factor


def test_fit_stream_refuses_degenerate_input() -> None:
    s, m = _spd(), np.zeros(D)
    for bpe in (np.nan, np.inf, -1.0):
        with pytest.raises(kt.InvalidParameterError, match="bits_per_element"):
            calibration.fit_stream(m, s, bpe)
    nan = s.copy()
    nan[2, 3] = nan[3, 2] = np.nan
    with pytest.raises(kt.InvalidInputError, match="cov.*NaN"):
        calibration.fit_stream(m, nan, 4.0)
    with pytest.raises(kt.InvalidInputError, match="mean has shape \\[3\\] but cov \\[8, 8\\]"):
        calibration.fit_stream(np.zeros(3), s, 4.0)
    with pytest.raises(kt.InvalidInputError, match="mean has shape"):
        calibration.fit_stream(m, np.ones((D, 5)), 4.0)
    with pytest.raises(kt.InvalidInputError, match="mean.*NaN"):
        calibration.fit_stream(np.full(D, np.nan), s, 4.0)
    with pytest.raises(kt.InvalidInputError, match="negative"):
        calibration.fit_stream(m, -s, 4.0)
    with pytest.raises(kt.InvalidInputError, match="variances are zero"):
        calibration.fit_stream(m, np.zeros((D, D)), 4.0)
    with pytest.raises(kt.InvalidParameterError, match="bits must hold one integer per component"):
        calibration.fit_stream(m, s, 4.0, bits=np.array([4, 4]))
    with pytest.raises(kt.InvalidParameterError, match="bits must be >= 0"):
        calibration.fit_stream(m, s, 4.0, bits=-np.ones(D, np.int64))
    with pytest.raises(TypeError, match="max_bits"):
        calibration.fit_stream(m, s, 4.0, max_bits=2.5)
    with pytest.raises(kt.InvalidParameterError, match="max_bits"):
        calibration.fit_stream(m, s, 4.0, max_bits=9)
    with pytest.raises(kt.InvalidInputError, match="whitening"):
        calibration.fit_stream(m, s, 4.0, whitening=np.eye(5))


def test_allocate_bits_refuses_what_it_would_misread() -> None:
    lam = np.array([4.0, 2.0, 1.0, 0.5])
    for budget in (float("nan"), float("inf"), 16.0):
        with pytest.raises(TypeError, match="budget"):
            calibration.allocate_bits(lam, budget)
    for mb in (2.5, True, float("nan")):
        with pytest.raises(TypeError, match="max_bits"):
            calibration.allocate_bits(lam, 100, max_bits=mb)
    for cap in (float("nan"), 2.7):
        with pytest.raises(TypeError, match="max_components"):
            calibration.allocate_bits(lam, 16, max_components=cap)
    with pytest.raises(kt.InvalidParameterError, match="distortion"):
        calibration.allocate_bits(lam, 16, max_bits=2, distortion=[1.0, float("nan"), 0.1])
    for bpe in (float("nan"), float("inf")):
        with pytest.raises(kt.InvalidParameterError, match="bits_per_element"):
            calibration.row_budget(bpe, D, True)
    with pytest.raises(kt.InvalidParameterError, match="d must be"):
        calibration.row_budget(4.0, -5, True)


def test_water_fill_rates_refuses_non_finite_input() -> None:
    lam = np.array([4.0, 2.0, 1.0, 0.5])
    for bad in ([np.nan, 1.0], [np.inf, 1.0]):
        with pytest.raises(kt.InvalidInputError, match="variances"):
            calibration.water_fill_rates(bad, 2.0)
    for rate in (float("nan"), float("inf")):
        with pytest.raises(kt.InvalidParameterError, match="rate"):
            calibration.water_fill_rates(lam, rate)
    with pytest.raises(kt.InvalidParameterError, match="1-D"):
        calibration.water_fill_rates(np.ones((2, 2)), 2.0)
    # Infinite rates or a negative variance taken as none, without an error, before.
    with pytest.raises(kt.InvalidParameterError, match="rate"):
        calibration.water_fill_rates(lam, 1e308)
    with pytest.raises(kt.InvalidInputError, match="variances"):
        calibration.water_fill_rates([4.0, -1.0], 2.0)
    rates, _ = calibration.water_fill_rates(np.ones(4096), 4096 * 8.0)  # large, and fine
    assert np.allclose(rates, 8.0)


def test_covariances_near_the_float64_limit_do_not_overflow_silently() -> None:
    # The symmetrised sum overflowed: NaN eigenvalues and an all-inf factor, without an error.
    big = np.eye(3) * 1e308
    lam, _ = calibration.spectrum(big)
    assert np.isfinite(lam).all() and np.allclose(lam, 1e308)
    assert np.isfinite(calibration.whitening_factor(big)).all()
    with pytest.raises(kt.NumericalError, match="overflows"):
        calibration.spectrum(big, whitening=np.eye(3) * 1e10)


def test_global_allocation_checks_its_budgets() -> None:
    lam = np.array([4.0, 2.0, 1.0, 0.5])
    with pytest.raises(kt.InvalidParameterError, match="1 row budgets for 2 spectra"):
        calibration.global_allocation([lam, lam], [16])
    with pytest.raises(kt.InvalidParameterError, match="2 row budgets for 1 spectra"):
        calibration.global_allocation([lam], [16, 16])
    with pytest.raises(kt.InvalidParameterError, match="at least one spectrum"):
        calibration.global_allocation([], [])
    with pytest.raises(kt.InvalidParameterError, match="row_budgets"):
        calibration.global_allocation([lam], [-16])
    with pytest.raises(TypeError, match="floor"):
        calibration.global_allocation([lam, lam], [16, 16], floor=[1.5, 1])


def test_lloyd_max_refuses_non_finite_samples() -> None:
    z = np.random.default_rng(0).standard_normal(1000)
    for bad in (np.nan, np.inf):
        with pytest.raises(kt.InvalidInputError, match="samples"):
            calibration.lloyd_max(np.r_[z, bad], 2)
    with pytest.raises(TypeError, match="bits"):
        calibration.lloyd_max(z, 2.0)
    with pytest.raises(kt.InvalidParameterError, match="bits"):
        calibration.lloyd_max(z, 0)


def test_head_spectrum_checks_stream_layer_and_head() -> None:
    stats = _stats()
    st = dict(_recipe().calibrated_streams())["k"]
    with pytest.raises(kt.InvalidParameterError, match="stream"):
        calibration.head_spectrum(stats, "q", 0, 0, st)
    for layer in (-1, 2):
        with pytest.raises(kt.InvalidParameterError, match="layer must be in 0..1"):
            calibration.head_spectrum(stats, "k", layer, 0, st)
    with pytest.raises(kt.InvalidParameterError, match="head must be in 0..1"):
        calibration.head_spectrum(stats, "k", 0, 2, st)
    with pytest.raises(TypeError, match="layer"):
        calibration.head_spectrum(stats, "k", 1.0, 0, st)


def test_model_codec_refuses_a_sensitivity_of_the_wrong_type() -> None:
    stats = _stats()
    with pytest.raises(TypeError, match="sensitivity"):
        calibration.ModelCodec(stats, _recipe(), sensitivity=stats)


# --- D11: covariances that are not covariances --------------------------------------------------

def test_statistics_refuse_negative_variances_and_asymmetric_matrices() -> None:
    good = _stats()
    neg = good.k_cov.copy()
    neg[1, 0] = -neg[1, 0]  # negative definite
    with pytest.raises(kt.InvalidInputError, match="'k_cov' at layer 1, kv-head 0 has a negative"):
        _stats(k_cov=neg)
    asym = good.v_cov.copy()
    asym[0, 1, 0, 3] += 0.5
    with pytest.raises(kt.InvalidInputError, match="'v_cov' at layer 0, kv-head 1 is not symmetric"):
        _stats(v_cov=asym)
    for name in ("q2", "o_gram"):
        bad = good.q2.copy()
        bad[1, 1, 4, 4] = -1.0
        with pytest.raises(kt.InvalidInputError, match=f"'{name}' at layer 1, kv-head 1"):
            _stats(**{name: bad})
    # a hybrid model's K/V layers: the model's layer index is named
    with pytest.raises(kt.InvalidInputError, match="layer 7, kv-head 0"):
        _stats(k_cov=neg, meta={"layer_index": [3, 7]})
    # rounding far below the tolerance passes
    fine = good.k_cov.copy()
    fine[0, 0, 0, 1] *= 1 + 1e-12
    _stats(k_cov=fine)


def test_loaded_statistics_are_checked(tmp_path) -> None:
    from safetensors.numpy import save_file

    good = _stats()
    path, _ = good.save(tmp_path / "s.safetensors")
    arrays = {k: np.ascontiguousarray(getattr(good, k)) for k in good.ARRAYS}
    arrays["k_cov"] = np.random.default_rng(0).standard_normal(good.k_cov.shape)
    save_file(arrays, str(path))
    with pytest.raises(kt.CorruptDataError, match="s.safetensors.*'k_cov' at layer 0, kv-head 0"):
        calibration.AttentionStats.load(path)



def test_sensitivity_refuses_matrices_that_are_not_second_moments(tmp_path) -> None:
    from safetensors.numpy import save_file

    good = _stats()
    sens = calibration.Sensitivity(meta={}, k=good.k_cov, v=good.v_cov)
    asym = good.k_cov.copy()
    asym[1, 0, 2, 5] += 0.5
    with pytest.raises(kt.InvalidInputError, match="sensitivity 'k' at layer 1, kv-head 0 is not symmetric"):
        calibration.Sensitivity(meta={}, k=asym, v=good.v_cov)
    neg = good.v_cov.copy()
    neg[0, 1] = -neg[0, 1]
    with pytest.raises(kt.InvalidInputError, match="'v' at layer 5, kv-head 1 has a negative"):
        calibration.Sensitivity(meta={"layer_index": [5, 9]}, k=good.k_cov, v=neg)
    # a damaged file: refused as corrupt, naming the file and the matrix
    path, _ = sens.save(tmp_path / "f.safetensors")
    arrays = {"k": np.ascontiguousarray(sens.k), "v": np.random.default_rng(0).standard_normal(sens.v.shape)}
    save_file(arrays, str(path))
    with pytest.raises(kt.CorruptDataError, match="f.safetensors.*'v' at layer 0, kv-head 0"):
        calibration.Sensitivity.load(path)
