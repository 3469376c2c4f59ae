"""Statistics and sensitivity of compressed attention (DeepSeek V4's CSA and HCA layers), taken at
the cache: what the codecs code is the entries the compressor emits (one per ``rate`` tokens,
:mod:`kakeyaturbo.cache.compressed`), split as multi-head latent attention's rows are: their
channels without RoPE as the "keys", the rotated channels as the "values"
(:class:`~kakeyaturbo.families.LayerSpec` ``"compressed"``). The window's rows are not coded.

Each window runs through the model with a ``DynamicCache``, which then holds the entries. An
entry is read as key and value alike by every head (one kv-head); the queries that score it are
every head's at every position, their channels without RoPE weighing the keys' errors (``q2``)
and their rotated ones the values' (``o_gram``, as multi-head latent attention's rotated key
part). The attention function sees the queries and the window's rows with the entries after
them; the attention weights of the entries (sums of squared probabilities, the model's learnt
sinks in the softmax, its mask with the compressor's block bias) weigh rows and queries as
:func:`~kakeyaturbo.calibration.collect` weighs them. The first ``n_sink`` entries of each
window are left out, as the cache keeps them raw. The sensitivity is taken as a cache is used:
the prefix prefilled without gradients, its entries made inputs, the scored tokens fed through
it (their own new entries appended to those inputs, as the model appends them)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError
from .checks import check_same_output
from .moments import CacheMoments, SampledRows, cache_gradients, cache_meta, check_scored, dynamic_cache, no_logits
from .stats import AttentionStats, Sensitivity

#: Where the statistics of compressed attention are taken (recorded in their meta).
COMPRESSED_POINT = ("compressed attention's entries at the cache (channels without RoPE as keys, rotated "
                    "channels as values)")
#: Query rows whose probabilities are computed at once (bounds the ``[heads, rows, keys]`` tensor).
_CHUNK = 64


def _layers(model: Any) -> Tuple[Any, Tuple[int, ...], int, int, int]:
    """``(layout, layers, query heads, keys' width, values' width)`` of the compressed layers."""
    from ..families import describe

    layout = describe(model)
    layers, (hq, _, d) = layout.calibration_group()
    return layout, layers, hq, d, int(layout.layers[layers[0]].v_dim or 0)


def entry_p2(module: Any, q: Any, kv: Any, mask: Any, kwargs: Dict[str, Any], entries: int,
             n_sink: int) -> Tuple[Any, Any, Any]:
    """Attention of one compressed layer over a window, as its eager attention computes it:
    ``q [1, Hq, S, D]``, ``kv [1, 1, S + entries, D]`` (the window's rows, then the entries),
    ``mask`` the float mask it adds (causal and sliding for the rows, the block bias for the
    entries), the module's learnt ``sinks`` one more logit per head. Returns ``wq [Hq, S]``
    (``sum`` of squared probabilities over the entries ``>= n_sink``), ``wk [entries]`` (over
    every head and query, per entry), float64, and the output ``[1, S, Hq, D]``."""
    import torch

    _, hq, s, d = q.shape
    scaling = kwargs.get("scaling")
    scaling = float(d ** -0.5 if scaling is None else scaling)
    k = kv[0, 0].detach().float()
    sinks = getattr(module, "sinks", None)
    wq = torch.zeros((hq, s), dtype=torch.float64)
    wk = torch.zeros((entries,), dtype=torch.float64)
    out = []
    for a in range(0, s, _CHUNK):
        b = min(a + _CHUNK, s)
        logits = (q[0, :, a:b].detach().float() @ k.T) * scaling
        if mask is not None:
            logits = logits + mask[0, :, a:b].float()
        if sinks is not None:
            logits = torch.cat([logits, sinks.detach().float().reshape(hq, 1, 1).expand(-1, b - a, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., :k.shape[0]]
        out.append(p @ k)
        p2 = p[..., k.shape[0] - entries:].double() ** 2
        wq[:, a:b] = p2[..., n_sink:].sum(dim=-1)
        wk += p2.sum(dim=(0, 1))
    return wq, wk, torch.cat(out, dim=1).transpose(0, 1)[None].to(q.dtype)


def _draws(counts: Sequence[Sequence[int]], samples: int, seed: int) -> List[SampledRows]:
    """Per layer, the entries (counted from ``n_sink``) kept as samples: the same number for
    every layer (the fewest any layer holds, at most ``samples``), drawn uniformly without
    repeats (one seeded generator, layer after layer) over each layer's entries of all windows."""
    n = min([samples] + [sum(c) for c in counts])
    rng = np.random.default_rng(seed)
    return [SampledRows.of_counts(per_window, n, rng) for per_window in counts]


def collect_compressed(model: Any, windows: Sequence[Sequence[int]], *, n_sink: int = 1, samples: int = 512,
                       seed: int = 0, weighting: str = "attention",
                       progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                       meta: Optional[Dict[str, Any]] = None, rope: str = "before") -> AttentionStats:
    """:func:`~kakeyaturbo.calibration.collect` of a model with compressed attention (see the
    module doc): the moments of the entries its cache holds, weighted as there (``weighting``),
    with ``samples`` entries per layer. The keys carry no RoPE and the values are coded as
    cached, so ``rope`` changes nothing but the record."""
    import torch

    from ..families import AttentionCapture
    from ..families.layout import COMPRESSOR

    if weighting not in ("attention", "uniform"):
        raise InvalidParameterError(f"weighting must be 'attention' or 'uniform', got {weighting!r}")
    layout, layers, hq, d, dv = _layers(model)
    rate = [int(layout.layers[i].rate or 1) for i in layers]
    counts = [[max(len(w) // r - n_sink, 0) for w in windows] for r in rate]
    if any(sum(c) < 2 for c in counts):
        raise InvalidParameterError(f"windows of {len(windows[0]) if windows else 0} tokens give compressed layers of "
                                    f"rates {sorted(set(rate))} fewer than two entries after the first {n_sink}: "
                                    "give longer or more windows")
    drawn = _draws(counts, samples, seed)
    row = {i: j for j, i in enumerate(layers)}
    n = len(layers)
    acc = CacheMoments(n, d, dv)
    weights: Dict[int, Any] = {}

    def handler(i: int, module: Any, q: Any, k: Any, v: Any, mask: Any, kwargs: Dict[str, Any],
                attend: Any) -> Tuple[Any, Any]:
        if i not in row:
            return attend(q, k, v)
        s = q.shape[2]
        entries = k.shape[2] - s
        if weighting == "attention":
            wq, wk, o = entry_p2(module, q, k, mask, kwargs, entries, n_sink)
            out = (o, None)
            if first:
                check_same_output(model, i, o, attend(q, k, v)[0])
            weights[i] = wk[None, n_sink:]
        else:
            out = attend(q, k, v)
            wq = torch.ones((hq, s), dtype=torch.float64)
            weights[i] = None
        qd = q[0].detach().double().reshape(-1, q.shape[-1])  # every head's queries: [heads * S, d + dv]
        acc.queries(row[i], qd[:, :d], qd[:, d:], wq)
        return out

    cap = AttentionCapture(model, handler, weights=weighting == "attention")
    head = no_logits(model)
    first = True
    with torch.no_grad(), cap:
        for w_i, w in enumerate(progress(windows)):
            cache = dynamic_cache(model)
            model(input_ids=torch.tensor([list(w)]), cache=cache, **head)
            if first:
                cap.check(layers)
                first = False
            for i, j in row.items():
                x = cache.layers[i].compressed_kv[COMPRESSOR][:, n_sink:].detach().double()  # [1, entries, d + dv]
                acc.rows(j, x[..., :d], x[..., d:], weights[i], drawn[j].of(w_i))
    return acc.stats(cache_meta(meta, layers, hq, d, dv, windows, n_sink, rope, COMPRESSED_POINT,
                                tokens=sum(len(w) for w in windows), samples=len(drawn[0]),
                                weighting=weighting))


def collect_compressed_sensitivity(model: Any, windows: Sequence[Sequence[int]], *, n_sink: int = 1,
                                   score: int = 64,
                                   progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                                   meta: Optional[Dict[str, Any]] = None, rope: str = "before",
                                   labels: str = "text", seed: int = 0) -> Sensitivity:
    """:func:`~kakeyaturbo.calibration.collect_sensitivity` of a model with compressed attention,
    taken as a cache is used: per window the first ``len - score - 1`` tokens are prefilled into
    a ``DynamicCache`` without gradients, every compressed layer's entries are made inputs, and
    the next ``score`` tokens are fed through it; ``F = sum_t g_t g_t^T`` of the gradients of
    their next-token NLL at those entries (after the first ``n_sink``), split into keys and
    values."""
    from ..families.layout import COMPRESSOR

    layout, layers, hq, d, dv = _layers(model)
    check_scored(windows, n_sink, score, labels)
    fisher = {"k": np.zeros((len(layers), 1, d, d)), "v": np.zeros((len(layers), 1, dv, dv))}

    def leaves(cache: Any) -> List[Tuple[Any, Any]]:
        out = []
        for i in layers:
            held = cache.layers[i].compressed_kv
            if held.get(COMPRESSOR) is not None and held[COMPRESSOR].shape[1] > n_sink:
                held[COMPRESSOR] = x = held[COMPRESSOR].detach().clone().requires_grad_(True)
                out.append((i, x))
        return out

    def add(i: int, g: Any) -> None:
        g = g[0, n_sink:].double()  # [entries - n_sink, d + dv]
        j = layers.index(i)
        fisher["k"][j, 0] += (g[:, :d].T @ g[:, :d]).numpy()
        fisher["v"][j, 0] += (g[:, d:].T @ g[:, d:]).numpy()

    cache_gradients(model, windows, score, labels, seed, progress, layout.model_type, leaves, add,
                    allow_unused=True)
    info = cache_meta(meta, layers, hq, d, dv, windows, n_sink, rope, COMPRESSED_POINT, score=score,
                      labels=labels, cached="independent")
    k = max(len(windows), 1)
    return Sensitivity(meta=info, k=fisher["k"] / k, v=fisher["v"] / k)
