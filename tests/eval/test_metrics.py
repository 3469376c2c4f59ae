"""Pooled-NLL arithmetic, bootstrap intervals and verdicts against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kakeyaturbo.eval import metrics as m


def test_pooled_ppl_is_not_a_mean_of_ratios() -> None:
    ref = np.array([[1.0, 1.0], [3.0, 3.0]])
    cod = np.array([[1.5, 1.5], [3.0, 3.0]])
    assert m.pooled_ppl(ref) == pytest.approx(math.exp(2.0))
    assert m.pooled_ppl(cod) == pytest.approx(math.exp(2.25))
    assert m.dppl(ref, cod) == pytest.approx(math.exp(0.25) - 1)
    # The mean of per-window ratios would give (e^0.5 + 1)/2 - 1: a different number.
    assert m.dppl(ref, cod) != pytest.approx((math.exp(0.5) + 1) / 2 - 1)


def test_identity_gives_zero() -> None:
    g = np.random.default_rng(0)
    nll = g.random((8, 16))
    c = m.compare(nll, nll.copy(), np.ones((8, 16), bool), np.zeros((8, 16)))
    assert c.dppl == 0.0 and c.top1 == 1.0 and c.kl == 0.0
    assert c.dppl_ci == (0.0, 0.0) and c.verdict == "ACCEPT"
    assert c.windows == 8 and c.tokens == 128


def test_bootstrap_by_hand() -> None:
    # Two windows: every resample is (a, a), (a, b), (b, a) or (b, b).
    ref = np.zeros((2, 4))
    cod = np.array([[0.0] * 4, [math.log(1.2)] * 4])
    agree = np.array([[True] * 4, [False] * 4])
    ci = m.bootstrap(ref, cod, agree, samples=4000, seed=1)
    assert ci["dppl"][0] == pytest.approx(0.0)
    assert ci["dppl"][1] == pytest.approx(0.2)
    assert ci["top1"] == (0.0, 1.0)
    # Deterministic for a seed.
    assert m.bootstrap(ref, cod, agree, seed=3) == m.bootstrap(ref, cod, agree, seed=3)


@pytest.mark.parametrize(
    "d, top1, want",
    [(0.0, 1.0, "ACCEPT"), (-0.01, 0.95, "ACCEPT"), (0.0101, 0.99, "MARGINAL"),
     (0.005, 0.94, "MARGINAL"), (0.03, 0.85, "MARGINAL"), (0.031, 0.99, "REJECT"),
     (0.0, 0.84, "REJECT")],
)
def test_verdicts(d: float, top1: float, want: str) -> None:
    assert m.verdict(d, top1) == want


def test_mismatched_runs_are_refused() -> None:
    with pytest.raises(ValueError):
        m.compare(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3), bool), np.zeros((2, 3)))
    with pytest.raises(ValueError):
        m.pooled_ppl(np.zeros((0, 3)))
