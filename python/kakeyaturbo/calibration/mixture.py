"""The calibration mixture: several domains' calibration text in set proportions.

``mixture`` is the shipped one (:data:`DEFAULT`); ``mixture:DOMAIN=WEIGHT,...`` names another.
A calibration of ``n`` windows apportions them over the domains by their weights (largest
remainders, ties to the domain listed first); a domain that is not on this machine (``prose``
without Debian's documentation, ``chat`` for a tokenizer without a chat template) is left out
with a warning, and the statistics record what was used. Statistics are gathered per domain
(and cached so) and pooled as the moments of the mixture distribution (:func:`pool_stats`):
each domain weighs its share of the windows.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError
from .corpus import DOMAINS, MIXTURE, Windows, check_spec, part_windows, parts
from .sources import CorpusUnavailableError
from .stats import AttentionStats, Sensitivity

#: The shipped mixture: window weights per domain (of 16 windows, 3 / 2 / 2 / 3 / 3 / 3).
DEFAULT: Tuple[Tuple[str, float], ...] = (
    ("wiki-en", 3.0), ("wiki-fr", 2.0), ("wiki-es", 2.0), ("code", 3.0), ("prose", 3.0),
    ("chat", 3.0))


def parse(spec: str) -> List[Tuple[str, float]]:
    """``[(domain, weight)]`` of a mixture spec: ``mixture`` (:data:`DEFAULT`) or
    ``mixture:DOMAIN=WEIGHT,...`` (weights > 0, domains of :data:`~.corpus.DOMAINS`, each once).
    Raises InvalidParameterError naming what is wrong."""
    if spec == MIXTURE:
        return list(DEFAULT)
    if not isinstance(spec, str) or not spec.startswith(MIXTURE + ":"):
        raise InvalidParameterError(f"not a mixture: {spec!r}")
    out: List[Tuple[str, float]] = []
    for item in spec[len(MIXTURE) + 1:].split(","):
        name, eq, w = item.strip().partition("=")
        name = name.strip()
        if name not in DOMAINS:
            raise InvalidParameterError(
                f"mixture {spec!r}: {name!r} is not a domain ({', '.join(DOMAINS)})")
        try:
            weight = float(w) if eq else 1.0
        except ValueError:
            raise InvalidParameterError(f"mixture {spec!r}: weight {w!r} of {name} is not a number") from None
        if not np.isfinite(weight) or weight <= 0:
            raise InvalidParameterError(f"mixture {spec!r}: the weight of {name} must be > 0")
        if any(name == d for d, _ in out):
            raise InvalidParameterError(f"mixture {spec!r}: {name} is named twice")
        out.append((name, weight))
    if not out:
        raise InvalidParameterError(f"mixture {spec!r} names no domain")
    return out


def apportion(weights: Sequence[Tuple[str, float]], n: int) -> List[Tuple[str, int]]:
    """``n`` windows over the domains in proportion to their weights (largest remainders; ties
    to the domain listed first); domains given no window are left out."""
    if n < 0:
        raise InvalidParameterError(f"need n >= 0 windows, got {n}")
    total = sum(w for _, w in weights)
    exact = [n * w / total for _, w in weights]
    counts = [int(np.floor(x + 1e-9)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:n - sum(counts)]:
        counts[i] += 1
    return [(d, c) for (d, _), c in zip(weights, counts) if c > 0]


def usable(spec: str, tok: Any = None) -> List[Tuple[str, float]]:
    """The mixture's ``(domain, weight)`` that this machine and tokenizer can make, warning
    (``UserWarning``) about each one left out; InvalidParameterError when none is left."""
    from .chat import has_template
    from .sources import STORED, documents

    out = []
    for d, w in parse(spec):
        try:
            if d == "chat":
                if not has_template(tok):
                    raise CorpusUnavailableError("the tokenizer has no chat template")
                documents("wiki-en")
            elif d in STORED:
                documents(d)
        except CorpusUnavailableError as e:
            warnings.warn(f"calibration mixture without {d}: {e}", UserWarning, stacklevel=2)
            continue
        out.append((d, w))
    if not out:
        raise InvalidParameterError(f"no domain of mixture {spec!r} is available here")
    return out


def composition(spec: str, n: int, tok: Any = None) -> List[Tuple[str, int]]:
    """``[(domain, windows)]``: ``n`` windows apportioned over the usable domains."""
    check_spec(spec)
    return apportion(usable(spec, tok), n)


def windows(tok: Any, spec: str, n: int, length: int) -> List[Tuple[str, Windows]]:
    """``[(domain, windows)]``: each domain's share of ``n`` windows of ``length`` tokens from
    its calibration part."""
    out = []
    for d, c in composition(spec, n, tok):
        cal, _ = parts(d, tok)
        out.append((d, part_windows(tok, cal, c, length)))
    return out


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
        if s.q2.shape != first.q2.shape:
            raise InvalidParameterError(f"cannot pool statistics of shapes {s.q2.shape} and "
                                        f"{first.q2.shape}")
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
        if s.k.shape != first.k.shape:
            raise InvalidParameterError(f"cannot pool sensitivities of shapes {s.k.shape} and "
                                        f"{first.k.shape}")
    info = dict(first.meta)
    info.update(meta or {})
    info["parts"] = [dict(s.meta, weight=float(p)) for (s, _), p in zip(items, w)]
    info["windows"] = int(sum(int(s.meta.get("windows", 0)) for s, _ in items))
    return Sensitivity(meta=info, k=sum(p * s.k for (s, _), p in zip(items, w)),
                       v=sum(p * s.v for (s, _), p in zip(items, w)))


def key(spec: str, tok: Any = None) -> str:
    """A name for a mixture's pooled statistics: ``mixture-<hash>`` of its composition."""
    import hashlib

    comp = ",".join(f"{d}={w:g}" for d, w in parse(spec))
    return "mixture-" + hashlib.sha256(comp.encode()).hexdigest()[:8]
