"""Statistics of a calibration mixture: each domain's statistics (gathered and cached per domain,
:mod:`.gather`) pooled as the moments of the mixture distribution (:func:`pool_stats`), each
domain weighed by its share of the windows (:func:`kakeyaturbo.calibration.corpus.composition`).
"""

from __future__ import annotations

import json
import numbers
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError
from .compressed import COMPRESSED_POINT
from .latent import LATENT_POINT
from .stats import AttentionStats, Sensitivity

#: How far two parts' ``o_gram`` (weights only) may differ, relative to its largest entry: the
#: rounding of one model's weights loaded in another dtype (bfloat16: about 1e-3), far below what
#: another model's weights give (order 0.1 to 1).
O_GRAM_TOLERANCE = 1e-2

#: Meta entries every pooled part must share (where both record them): the side of RoPE the keys
#: are taken on (default "before"), how the moments are weighed, where they are taken, the model
#: (fingerprint of the attention weights); a sensitivity's also its labels and sink.
_SAME_STATS = ("rope", "weighting", "hooks", "fingerprint")
_SAME_SENS = ("rope", "labels", "n_sink", "hooks", "fingerprint")


def _parts(items: Sequence[Tuple[Any, float]], cls: type, what: str) -> None:
    """InvalidParameterError unless every item is ``(cls, weight)``."""
    try:
        ok = all(isinstance(s, cls) for s, _ in items)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidParameterError(f"pooling {what} needs (a {cls.__name__}, weight) pairs")


def _same_meta(items: Sequence[Tuple[Any, float]], keys: Sequence[str], what: str) -> None:
    """InvalidParameterError when two parts record different values of one of ``keys`` (a part
    that does not record one is not compared; ``rope`` unrecorded is "before")."""
    for k in keys:
        seen = {}
        for n, (s, _) in enumerate(items):
            v = s.meta.get(k, "before" if k == "rope" else None)
            if v is not None:
                seen.setdefault(json.dumps(v, sort_keys=True, default=str), n)
        if len(seen) > 1:
            parts = list(seen.values())
            vals = [items[n][0].meta.get(k, "before") for n in parts]
            raise InvalidParameterError(f"cannot pool {what} of different {k!r}: {vals} (parts {parts})")


def _rope(items: Sequence[Tuple[Any, float]], meta: Optional[Dict[str, Any]], what: str) -> str:
    """The side of RoPE the parts share (after :func:`_same_meta`); InvalidParameterError when
    the pooled ``meta`` would record another."""
    rope = items[0][0].meta.get("rope", "before")
    asked = (meta or {}).get("rope", rope)
    if asked != rope:
        raise InvalidParameterError(f"cannot record pooled {what} as rope {asked!r}: their parts were "
                                    f"taken {rope!r} RoPE")
    return rope


def _weights(items: Sequence[Tuple[Any, float]]) -> np.ndarray:
    try:
        w = np.array([float(x) for _, x in items], dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidParameterError("pooling needs (part, weight) pairs, weights numbers") from None
    if len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise InvalidParameterError("pooling needs one or more parts with weights >= 0, not all 0")
    return w / w.sum()


def pool_stats(items: Sequence[Tuple[AttentionStats, float]], *, samples: Optional[int] = None,
               seed: int = 0, meta: Optional[Dict[str, Any]] = None) -> AttentionStats:
    """The :class:`AttentionStats` of a mixture of distributions from those of its parts and
    their weights (normalised): query second moments and the key and value means and second
    moments are the weighted averages, covariances follow from them; ``o_gram`` (weights only)
    must agree; the sample rows are drawn from the parts in proportion (``samples`` rows, default
    the largest part's count; seeded). Multi-head latent attention's ``o_gram`` (its rotated
    queries' second moment) is averaged like ``q2``.

    Raises InvalidParameterError when the parts differ in shape, layers, the side of RoPE, the
    weighting, the capture point or the model (fingerprint where recorded; ``o_gram`` beyond
    rounding), or ``samples`` is not an integer >= 0."""
    _parts(items, AttentionStats, "statistics")
    w = _weights(items)
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, numbers.Integral)
                                or samples < 0):
        raise InvalidParameterError(f"samples must be an integer >= 0, got {samples!r}")
    first = items[0][0]
    for s, _ in items:
        if s.q2.shape != first.q2.shape or s.v_cov.shape != first.v_cov.shape or s.layer_index != first.layer_index:
            raise InvalidParameterError(f"cannot pool statistics of shapes {s.q2.shape} and "
                                        f"{first.q2.shape} (layers {list(s.layer_index)} and "
                                        f"{list(first.layer_index)})")
    _same_meta(items, _SAME_STATS, "statistics")
    latent = first.meta.get("hooks") in (LATENT_POINT, COMPRESSED_POINT)
    if latent:
        o_gram = sum(p * s.o_gram for (s, _), p in zip(items, w))
    else:
        o_gram = first.o_gram
        scale = float(np.abs(o_gram).max())
        for n, (s, _) in enumerate(items):
            if float(np.abs(s.o_gram - o_gram).max()) > O_GRAM_TOLERANCE * scale:
                raise InvalidParameterError(
                    f"cannot pool statistics of different models: part {n}'s o_gram (the output "
                    "projection's Gram matrix) differs from part 0's")
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
    info["rope"] = _rope(items, meta, "statistics")
    info["parts"] = [dict(s.meta, weight=float(p)) for (s, _), p in zip(items, w)]
    info["windows"] = int(sum(int(s.meta.get("windows", 0)) for s, _ in items))
    return AttentionStats(meta=info, q2=q2, k_mean=pooled["k"][0], k_cov=pooled["k"][1],
                          v_mean=pooled["v"][0], v_cov=pooled["v"][1], o_gram=o_gram,
                          k_samples=ks, v_samples=vs)


def pool_sensitivity(items: Sequence[Tuple[Sensitivity, float]], *,
                     meta: Optional[Dict[str, Any]] = None) -> Sensitivity:
    """The :class:`Sensitivity` of a mixture: the weighted average of its parts' (normalised
    weights), each an average over its windows. InvalidParameterError when they differ in shape,
    layers, side of RoPE, labels, sink, capture point or model (fingerprint, where recorded)."""
    _parts(items, Sensitivity, "sensitivities")
    w = _weights(items)
    first = items[0][0]
    for s, _ in items:
        if s.k.shape != first.k.shape or s.v.shape != first.v.shape or s.layer_index != first.layer_index:
            raise InvalidParameterError(f"cannot pool sensitivities of shapes {s.k.shape} and "
                                        f"{first.k.shape} (or of other layers)")
    _same_meta(items, _SAME_SENS, "sensitivities")
    info = dict(first.meta)
    info.update(meta or {})
    info["rope"] = _rope(items, meta, "sensitivities")
    info["parts"] = [dict(s.meta, weight=float(p)) for (s, _), p in zip(items, w)]
    info["windows"] = int(sum(int(s.meta.get("windows", 0)) for s, _ in items))
    return Sensitivity(meta=info, k=sum(p * s.k for (s, _), p in zip(items, w)),
                       v=sum(p * s.v for (s, _), p in zip(items, w)))
