"""Statistics and sensitivity of multi-head latent attention (DeepSeek V2/V3/V3.2, GLM-4.7-Flash,
GLM-5, MiniCPM3, Youtu, Kimi Linear), taken at the cache: what the codecs code is what the cache
holds, per layer and token one latent row (the "keys", ``kv_lora_rank`` wide, no RoPE) and the
rotated key part every head shares (the "values", ``qk_rope_head_dim`` wide, RoPE applied).

Each window runs through the model with a ``DynamicCache``, which then holds those rows; the
attention function sees the queries and the keys expanded from the latent, which give the
attention weights (all heads read the one latent row: a GQA group of every head). The latent's
query is ``W_uk^T q_nope`` per head (``W_uk`` the key half of ``kv_b_proj``), pooled over the
heads; the rotated key part only scores, so what weighs its errors is the rotated queries'
second moment, kept where the values' output Gram matrix is kept for other families
(``o_gram``). The sensitivity is taken as a cache is used: the prefix prefilled into a
``DynamicCache`` without gradients, its rows made inputs, the scored tokens fed through it."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError, UnsupportedModelError
from .checks import check_same_output
from .moments import (CacheMoments, SampledRows, attention_p2, cache_gradients, cache_meta, check_scored, dynamic_cache,
                      no_logits)
from .stats import AttentionStats, Sensitivity

#: Where the statistics of a latent cache are taken (recorded in their meta).
LATENT_POINT = "cache rows of multi-head latent attention (latent as keys, rotated key part as values)"


def _modules(model: Any, layers: Sequence[int]) -> Dict[int, Any]:
    """The attention module of each latent layer, with what its latent's query needs
    (``kv_b_proj``, ``qk_nope_head_dim``, ``v_head_dim``, ``num_heads``)."""
    from ..families import attention_modules
    from ..families.layout import model_type

    mods = attention_modules(model)
    out = {}
    for i in layers:
        m = mods.get(i)
        w = getattr(getattr(m, "kv_b_proj", None), "weight", None)
        if w is None or not all(isinstance(getattr(m, a, None), int)
                                for a in ("qk_nope_head_dim", "v_head_dim", "num_heads")):
            raise UnsupportedModelError(
                f"model type {model_type(model)!r}: layer {i} has no latent attention module with "
                "kv_b_proj, qk_nope_head_dim, v_head_dim and num_heads to take its latent's queries from")
        out[i] = m
    return out


def _key_up(module: Any) -> Any:
    """``W_uk [heads, nope, r]``: the map from the latent to each head's keys without RoPE."""
    w = module.kv_b_proj.weight.detach().double()
    h, nope, dv = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
    return w.reshape(h, nope + dv, -1)[:, :nope]


def _layers(model: Any) -> Tuple[Any, Tuple[int, ...], int, int, int]:
    """``(layout, layers, heads, latent width, rotated width)`` of a latent model, whose K/V
    layers must be full attention (a sliding window would drop rows the statistics need)."""
    from ..families import describe

    layout = describe(model)
    layers, (hq, _, r) = layout.calibration_group()
    spec = layout.layers[layers[0]]
    if layout.stateful:
        raise UnsupportedModelError(
            f"model type {layout.model_type!r}: latent attention beside recurrent layers (Kimi Linear) is "
            "not calibrated: the sensitivity is taken through the cache, and those layers update their "
            "cached state in place, which no gradient runs through")
    if any(layout.layers[i].kind != "full" for i in layers):
        raise UnsupportedModelError(f"model type {layout.model_type!r}: latent layers with a window are "
                                    "not calibrated (their cache drops rows)")
    return layout, layers, hq, r, int(spec.v_dim or r)


def collect_latent(model: Any, windows: Sequence[Sequence[int]], *, n_sink: int = 1, samples: int = 512,
                   seed: int = 0, weighting: str = "attention",
                   progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                   meta: Optional[Dict[str, Any]] = None, rope: str = "before") -> AttentionStats:
    """:func:`~kakeyaturbo.calibration.collect` of a model with multi-head latent attention (see
    the module doc): the moments of the rows its cache holds, weighted as there (``weighting``),
    with ``samples`` rows per layer drawn from the positions ``>= n_sink``. The latent has no
    RoPE and the rotated part is coded as cached, so ``rope`` changes nothing but the record."""
    import torch

    from ..families import AttentionCapture

    if weighting not in ("attention", "uniform"):
        raise InvalidParameterError(f"weighting must be 'attention' or 'uniform', got {weighting!r}")
    _, layers, hq, r, dv = _layers(model)
    mods = _modules(model, layers)
    w_uk = {i: _key_up(m) for i, m in mods.items()}
    row = {i: j for j, i in enumerate(layers)}
    n = len(layers)
    acc = CacheMoments(n, r, dv)
    drawn = SampledRows(windows, n_sink, samples, seed)
    weights: Dict[int, Any] = {}

    def handler(i: int, module: Any, q: Any, k: Any, v: Any, mask: Any, kwargs: Dict[str, Any],
                attend: Any) -> Tuple[Any, Any]:
        if i not in row:
            return attend(q, k, v)
        t = q.shape[2]
        if weighting == "attention":
            wq, wk, o = attention_p2(module, q, k, mask, kwargs, n_sink, v=v)
            out = (o, None)
            if first:
                check_same_output(model, i, o, attend(q, k, v)[0])
            wq = wq.reshape(hq, t)
            weights[i] = wk.sum(dim=0)[None, n_sink:]  # every head reads the one latent row
        else:
            out = attend(q, k, v)
            wq = torch.ones((hq, t), dtype=torch.float64)
            weights[i] = None
        m = mods[i]
        nope = m.qk_nope_head_dim
        qd = q[0].detach().double()  # [heads, t, nope + rope]
        qt = torch.einsum("hnr,htn->htr", w_uk[i], qd[..., :nope]).reshape(-1, r)  # the latent's queries
        qr = qd[..., nope:].reshape(-1, qd.shape[-1] - nope)  # the rotated key part's
        acc.queries(row[i], qt, qr, wq)
        return out

    cap = AttentionCapture(model, handler)
    head = no_logits(model)
    first = True
    with torch.no_grad(), cap:
        for w_i, w in enumerate(progress(windows)):
            sel = drawn.of(w_i)
            cache = dynamic_cache(model)
            model(input_ids=torch.tensor([list(w)]), cache=cache, **head)
            if first:
                cap.check(layers)
                first = False
            for i, j in row.items():
                k, v = (x[0].detach().double()[:, n_sink:] for x in (cache.layers[i].keys, cache.layers[i].values))
                acc.rows(j, k, v, weights[i], sel)  # [1, t - n_sink, width] each
    return acc.stats(cache_meta(meta, layers, hq, r, dv, windows, n_sink, rope, LATENT_POINT,
                                tokens=sum(len(w) for w in windows), samples=len(drawn.pick), weighting=weighting))


def collect_latent_sensitivity(model: Any, windows: Sequence[Sequence[int]], *, n_sink: int = 1,
                               score: int = 64,
                               progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                               meta: Optional[Dict[str, Any]] = None, rope: str = "before",
                               labels: str = "text", seed: int = 0) -> Sensitivity:
    """:func:`~kakeyaturbo.calibration.collect_sensitivity` of a model with multi-head latent
    attention, taken as a cache is used: per window the first ``len - score - 1`` tokens are
    prefilled into a ``DynamicCache`` without gradients, every layer's cached latent and rotated
    rows are made inputs, and the next ``score`` tokens are fed through it; ``F = sum_t g_t
    g_t^T`` of the gradients of their next-token NLL at those rows (positions ``>= n_sink``)."""
    layout, layers, hq, r, dv = _layers(model)
    check_scored(windows, n_sink, score, labels)
    fisher = {"k": np.zeros((len(layers), 1, r, r)), "v": np.zeros((len(layers), 1, dv, dv))}

    def leaves(cache: Any) -> List[Tuple[Any, Any]]:
        out = []
        for i in layers:
            lay = cache.layers[i]
            for s, name in (("k", "keys"), ("v", "values")):
                x = getattr(lay, name).detach().clone().requires_grad_(True)
                setattr(lay, name, x)
                out.append(((s, i), x))
        return out

    def add(key: Any, g: Any) -> None:
        s, i = key
        g = g[0, 0, n_sink:].double()  # [ctx - n_sink, width]
        fisher[s][layers.index(i), 0] += (g.T @ g).numpy()

    cache_gradients(model, windows, score, labels, seed, progress, layout.model_type, leaves, add)
    info = cache_meta(meta, layers, hq, r, dv, windows, n_sink, rope, LATENT_POINT, score=score, labels=labels,
                      cached="independent")
    k = max(len(windows), 1)
    return Sensitivity(meta=info, k=fisher["k"] / k, v=fisher["v"] / k)
