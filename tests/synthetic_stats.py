"""Synthetic calibration statistics for tests: every matrix one random symmetric positive
definite matrix per (layer, kv-head), zero means, no samples."""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from kakeyaturbo import calibration


def synthetic_stats(layers: int = 2, heads: int = 1, d: int = 8, seed: int = 0,
                    meta: Optional[Dict[str, Any]] = None, **override: Any) -> calibration.AttentionStats:
    """``AttentionStats`` of ``layers x heads`` of width ``d`` (arrays in ``override`` replace
    the synthetic ones)."""
    a = np.random.default_rng(seed).standard_normal((layers, heads, d, d))
    spd = np.einsum("lhij,lhkj->lhik", a, a) / d + np.eye(d)
    arrays = dict(q2=spd, k_mean=np.zeros((layers, heads, d)), k_cov=spd,
                  v_mean=np.zeros((layers, heads, d)), v_cov=spd, o_gram=spd,
                  k_samples=np.zeros((layers, heads, 0, d), np.float32),
                  v_samples=np.zeros((layers, heads, 0, d), np.float32))
    arrays.update(override)
    return calibration.AttentionStats(meta=meta or {}, **arrays)
