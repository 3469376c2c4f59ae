"""Bit allocation: integer water-filling against its closed form and greedy optimality, and
the allocation pooled over heads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kakeyaturbo as kt
from kakeyaturbo import calibration

D = 32


def test_water_filling_matches_the_closed_form() -> None:
    # With the ideal distortion 4^-b and no cap, integer greedy allocation lands within one
    # bit of the closed-form rates R_j = max(0, log2(var_j / theta) / 2) and spends the budget.
    lam = 3.0 * 0.8 ** np.arange(48)
    budget = 96
    ideal = [4.0**-b for b in range(40)]
    bits = calibration.allocate_bits(lam, budget, max_bits=39, distortion=ideal)
    rates, theta = calibration.water_fill_rates(lam, budget)
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
    bits = calibration.allocate_bits(lam, budget, max_bits)
    lm = np.array(calibration.LLOYD_MAX_MSE)
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



def test_global_allocation_moves_bits_to_where_variance_is() -> None:
    loud = 4.0 * 0.85 ** np.arange(D)
    quiet = 0.01 * 0.85 ** np.arange(D)
    per_head = [calibration.allocate_bits(sp, 64) for sp in (loud, quiet)]
    glob = calibration.global_allocation([loud, quiet], [64, 64])
    assert all(b.sum() % 8 == 0 for b in glob)
    assert sum(b.sum() for b in glob) <= 128
    assert glob[0].sum() > per_head[0].sum() and glob[1].sum() < per_head[1].sum()
    lm = np.array(calibration.LLOYD_MAX_MSE)
    cost = lambda alloc: sum(np.sum(sp * lm[b]) for sp, b in zip((loud, quiet), alloc))  # noqa: E731
    assert cost(glob) < cost(per_head)
    # Bytes freed by trimming every head to whole bytes go back: the pooled budget is spent.
    assert sum(b.sum() for b in glob) == 128
    spectra = [s * 0.8 ** np.arange(D) for s in (1.0, 0.37, 0.11)]
    three = calibration.global_allocation(spectra, [40, 40, 40])
    assert sum(b.sum() for b in three) == 120 and all(b.sum() % 8 == 0 and b.sum() >= 8 for b in three)
    # A head the pooled water-filling leaves empty still gets its byte, paid for by the others.
    tight = calibration.global_allocation([loud, 1e-12 * loud, quiet], [8, 8, 8])
    assert [int(b.sum()) for b in tight] == [8, 8, 8]


def test_non_numeric_variances_are_a_type_error() -> None:
    for bad in ("ab", ["a", "b"], [object()]):
        with pytest.raises(TypeError, match="variances must be numeric"):
            calibration.allocate_bits(bad, 2)


def test_targets_past_64_bits_per_element_are_refused() -> None:
    # A row costs at most 24 bits per element (D = 1: 8 bits and the 16-bit scale); a huge
    # finite target overflowed the row's count (OverflowError).
    for bpe in (64.5, 1e308, np.float64(1e300)):
        with pytest.raises(kt.InvalidParameterError, match=r"bits_per_element must be in \[0, 64\]"):
            calibration.row_budget(bpe, 64, False)
        with pytest.raises(kt.InvalidParameterError, match="bits_per_element"):
            calibration.fit_stream(np.zeros(4, np.float32), np.eye(4), bpe)
    assert calibration.row_budget(24, 1, True) == 8
    # A row wider than the core takes: refused, not an OverflowError past float range.
    for d in (kt._core.MAX_DIM + 1, 10 ** 400):
        with pytest.raises(kt.InvalidParameterError, match="d must be in 1..4096"):
            calibration.row_budget(4.0, d, True)
    assert calibration.row_budget(16, 64, False) == 1024
    assert calibration.row_budget(0, 64, False) == 0
