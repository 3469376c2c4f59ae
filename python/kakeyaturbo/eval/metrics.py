"""Paired perplexity comparison: pooled NLL, top-1 agreement, KL, bootstrap intervals, verdicts.

Every function takes per-window arrays so that a window is the unit of resampling: `nll_*`
and `kl` are ``[windows, tokens]`` float arrays (natural log), `agree` is ``[windows, tokens]``
bool (argmax of the codec run equals the reference's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Tuple

import numpy as np

#: |dppl| and top-1 limits of each verdict, as fractions.
ACCEPT = (0.01, 0.95)
MARGINAL = (0.03, 0.85)


def pooled_ppl(nll: np.ndarray) -> float:
    """exp of the mean NLL over every scored token of every window (not a mean of ratios)."""
    nll = np.asarray(nll, dtype=np.float64)
    if nll.size == 0:
        raise ValueError("no scored tokens")
    return float(np.exp(nll.mean()))


def dppl(nll_ref: np.ndarray, nll_codec: np.ndarray) -> float:
    """Relative perplexity change of the codec against the reference: ppl_c / ppl_r - 1."""
    return pooled_ppl(nll_codec) / pooled_ppl(nll_ref) - 1.0


def verdict(d: float, top1: float) -> str:
    """ACCEPT: |dppl| <= 1 % and top-1 >= 95 %; MARGINAL: <= 3 % and >= 85 %; else REJECT."""
    if abs(d) <= ACCEPT[0] and top1 >= ACCEPT[1]:
        return "ACCEPT"
    if abs(d) <= MARGINAL[0] and top1 >= MARGINAL[1]:
        return "MARGINAL"
    return "REJECT"


def bootstrap(
    nll_ref: np.ndarray,
    nll_codec: np.ndarray,
    agree: np.ndarray,
    samples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Dict[str, Tuple[float, float]]:
    """Percentile intervals of dppl and top-1 over windows resampled with replacement."""
    w = np.asarray(nll_ref).shape[0]
    g = np.random.default_rng(seed)
    idx = g.integers(0, w, size=(samples, w))
    ref = np.asarray(nll_ref, dtype=np.float64).mean(axis=1)
    cod = np.asarray(nll_codec, dtype=np.float64).mean(axis=1)
    agr = np.asarray(agree, dtype=np.float64).mean(axis=1)
    # Windows hold equal token counts, so the pooled mean of a resample is the mean of means.
    d = np.exp(cod[idx].mean(axis=1) - ref[idx].mean(axis=1)) - 1.0
    t = agr[idx].mean(axis=1)
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    return {
        "dppl": (float(np.percentile(d, lo)), float(np.percentile(d, hi))),
        "top1": (float(np.percentile(t, lo)), float(np.percentile(t, hi))),
    }


@dataclass
class Comparison:
    ppl_ref: float
    ppl: float
    dppl: float
    top1: float
    kl: float
    dppl_ci: Tuple[float, float]
    top1_ci: Tuple[float, float]
    verdict: str
    windows: int
    tokens: int

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def compare(
    nll_ref: np.ndarray, nll_codec: np.ndarray, agree: np.ndarray, kl: np.ndarray, seed: int = 0
) -> Comparison:
    """Every figure of the protocol for one method against the reference."""
    nll_ref, nll_codec = np.asarray(nll_ref), np.asarray(nll_codec)
    if nll_ref.shape != nll_codec.shape or nll_ref.shape != np.shape(agree):
        raise ValueError("reference and codec runs must score the same windows and tokens")
    d = dppl(nll_ref, nll_codec)
    top1 = float(np.mean(agree))
    ci = bootstrap(nll_ref, nll_codec, agree, seed=seed)
    return Comparison(
        ppl_ref=pooled_ppl(nll_ref), ppl=pooled_ppl(nll_codec), dppl=d, top1=top1,
        kl=float(np.mean(kl)), dppl_ci=ci["dppl"], top1_ci=ci["top1"],
        verdict=verdict(d, top1), windows=int(nll_ref.shape[0]), tokens=int(nll_ref.size),
    )
