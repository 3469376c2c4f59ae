"""Statistics of a calibration mixture: each domain's statistics (gathered and cached per domain,
:mod:`.gather`) pooled as the moments of the mixture distribution (:func:`pool_stats`), each
domain weighed by its share of the windows (:func:`kakeyaturbo.calibration.corpus.composition`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError
from .stats import AttentionStats, Sensitivity

def _weights(items: Sequence[Tuple[Any, float]]) -> np.ndarray:
    w = np.array([float(x) for _, x in items], dtype=np.float64)
    if len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise InvalidParameterError("pooling needs one or more parts with weights >= 0, not all 0")
    return w / w.sum()


def pool_stats(items: Sequence[Tuple[AttentionStats, float]], *, samples: Optional[int] = None,
               seed: int = 0, meta: Optional[Dict[str, Any]] = None) -> AttentionStats:
    """The :class:`AttentionStats` of a mixture of distributions from those of its parts and
    their weights (normalised): query second moments and the key and value means and second
    moments are the weighted averages, covariances follow from them; ``o_gram`` (weights only)
    must agree; the sample rows are drawn from the parts in proportion (``samples`` rows, default
    the largest part's count; seeded)."""
    w = _weights(items)
    first = items[0][0]
    for s, _ in items:
        if s.q2.shape != first.q2.shape or s.layer_index != first.layer_index:
            raise InvalidParameterError(f"cannot pool statistics of shapes {s.q2.shape} and "
                                        f"{first.q2.shape} (layers {list(s.layer_index)} and "
                                        f"{list(first.layer_index)})")
    q2 = sum(p * s.q2 for (s, _), p in zip(items, w))
    pooled = {}
    for name in ("k", "v"):
        means = [getattr(s, f"{name}_mean") for s, _ in items]
        covs = [getattr(s, f"{name}_cov") for s, _ in items]
        mean = sum(p * m for m, p in zip(means, w))
        second = sum(p * (c + m[..., :, None] * m[..., None, :]) for m, c, p in zip(means, covs, w))
        pooled[name] = (mean, second - mean[..., :, None] * mean[..., None, :])
    n = samples if samples is not None else max(s.k_samples.shape[2] for s, _ in items)
    rng = np.random.default_rng(seed)
    picks = []
    share = np.floor(w * n).astype(int)
    share[: n - share.sum()] += 1
    for (s, _), k in zip(items, share):
        avail = s.k_samples.shape[2]
        idx = np.sort(rng.choice(avail, size=min(int(k), avail), replace=False)) if avail else []
        picks.append((s, np.asarray(idx, dtype=np.int64)))
    ks = np.concatenate([s.k_samples[:, :, i] for s, i in picks], axis=2)
    vs = np.concatenate([s.v_samples[:, :, i] for s, i in picks], axis=2)
    info = dict(first.meta)
    info.update(meta or {})
    info["parts"] = [dict(s.meta, weight=float(p)) for (s, _), p in zip(items, w)]
    info["windows"] = int(sum(int(s.meta.get("windows", 0)) for s, _ in items))
    return AttentionStats(meta=info, q2=q2, k_mean=pooled["k"][0], k_cov=pooled["k"][1],
                          v_mean=pooled["v"][0], v_cov=pooled["v"][1], o_gram=first.o_gram,
                          k_samples=ks, v_samples=vs)


def pool_sensitivity(items: Sequence[Tuple[Sensitivity, float]], *,
                     meta: Optional[Dict[str, Any]] = None) -> Sensitivity:
    """The :class:`Sensitivity` of a mixture: the weighted average of its parts' (normalised
    weights), each an average over its windows."""
    w = _weights(items)
    first = items[0][0]
    for s, _ in items:
        if s.k.shape != first.k.shape or s.layer_index != first.layer_index:
            raise InvalidParameterError(f"cannot pool sensitivities of shapes {s.k.shape} and "
                                        f"{first.k.shape} (or of other layers)")
    info = dict(first.meta)
    info.update(meta or {})
    info["parts"] = [dict(s.meta, weight=float(p)) for (s, _), p in zip(items, w)]
    info["windows"] = int(sum(int(s.meta.get("windows", 0)) for s, _ in items))
    return Sensitivity(meta=info, k=sum(p * s.k for (s, _), p in zip(items, w)),
                       v=sum(p * s.v for (s, _), p in zip(items, w)))
