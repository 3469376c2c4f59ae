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

import datetime
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError, UnsupportedModelError
from ..recipes import CalibrationSettings
from .checks import check_same_output
from .moments import Moments, SampledRows, attention_p2, layer_meta, no_logits, scored_nll
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


def _meta(meta: Optional[Dict[str, Any]], layers: Sequence[int], hq: int, r: int, dv: int,
          windows: Sequence[Sequence[int]], n_sink: int, rope: str, **extra: Any) -> Dict[str, Any]:
    info = dict(meta or {})
    info.update(windows=len(windows), window=len(windows[0]) if windows else 0, n_sink=n_sink,
                **layer_meta(layers), q_heads=hq, kv_heads=1, head_dim=r, v_dim=dv,
                date=datetime.date.today().isoformat(), hooks=LATENT_POINT, rope=rope, **extra)
    return info


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
    q2 = torch.zeros((n, 1, r, r), dtype=torch.float64)
    qr2 = torch.zeros((n, 1, dv, dv), dtype=torch.float64)
    q_count = torch.zeros((n, 1), dtype=torch.float64)
    k_acc, v_acc = Moments(n, 1, r), Moments(n, 1, dv)
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
        wf = wq.reshape(-1, 1)
        j = row[i]
        q2[j, 0] += (qt * wf).T @ qt
        qr2[j, 0] += (qr * wf).T @ qr
        q_count[j, 0] += wq.sum()
        return out

    cap = AttentionCapture(model, handler)
    head = no_logits(model)
    first = True
    with torch.no_grad(), cap:
        for w_i, w in enumerate(progress(windows)):
            sel = drawn.of(w_i)
            cache = _cache(model)
            model(input_ids=torch.tensor([list(w)]), cache=cache, **head)
            if first:
                cap.check(layers)
                first = False
            for i, j in row.items():
                for acc, x in ((k_acc, cache.layers[i].keys), (v_acc, cache.layers[i].values)):
                    x = x[0].detach().double()[:, n_sink:]  # [1, t - n_sink, width]
                    acc.add(j, x, weights[i])
                    if sel:
                        acc.samples[j][0].append(x[0, sel].numpy().astype(np.float32))
    km, kc = k_acc.moments()
    vm, vc = v_acc.moments()
    norm = q_count.clamp_min(1e-300)[:, :, None, None]
    info = _meta(meta, layers, hq, r, dv, windows, n_sink, rope, tokens=sum(len(w) for w in windows),
                 samples=len(drawn.pick), weighting=weighting)
    return AttentionStats(meta=info, q2=(q2 / norm).numpy(), k_mean=km, k_cov=kc, v_mean=vm, v_cov=vc,
                          o_gram=(qr2 / norm).numpy(), k_samples=k_acc.stacked_samples(r),
                          v_samples=v_acc.stacked_samples(dv))


def _cache(model: Any) -> Any:
    import transformers

    return transformers.DynamicCache(config=model.config)


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
    import torch

    if labels not in CalibrationSettings.LABELS:
        raise InvalidParameterError(f"labels must be one of {', '.join(CalibrationSettings.LABELS)}, got {labels!r}")
    layout, layers, hq, r, dv = _layers(model)
    if score < 1 or any(len(w) < n_sink + score + 2 for w in windows):
        raise InvalidParameterError(
            f"windows need n_sink + 1 cached tokens, {score} scored and one more ({n_sink} + {score} + 2)")
    fisher = {"k": np.zeros((len(layers), 1, r, r)), "v": np.zeros((len(layers), 1, dv, dv))}
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        for n, w in enumerate(progress(windows)):
            ids = torch.tensor([list(w)])
            ctx = len(w) - score - 1
            cache = _cache(model)
            with torch.no_grad():
                model(input_ids=ids[:, :ctx], cache=cache)
            leaves: List[Tuple[str, int, Any]] = []
            for i in layers:
                lay = cache.layers[i]
                for s, name in (("k", "keys"), ("v", "values")):
                    x = getattr(lay, name).detach().clone().requires_grad_(True)
                    setattr(lay, name, x)
                    leaves.append((s, i, x))
            with torch.enable_grad():
                logits = model(input_ids=ids[:, ctx:-1], cache=cache).logits[0]
                nll = scored_nll(logits, ids, ctx, labels, seed, n)
                try:
                    grads = torch.autograd.grad(nll, [x for _, _, x in leaves])
                except RuntimeError as e:  # e.g. a recurrent layer updating its cached state in place
                    raise UnsupportedModelError(
                        f"model type {layout.model_type!r}: no gradient through its cache ({e})") from None
            for (s, i, _), g in zip(leaves, grads):
                g = g[0, 0, n_sink:].double()  # [ctx - n_sink, width]
                fisher[s][layers.index(i), 0] += (g.T @ g).numpy()
    finally:
        for p in trainable:
            p.requires_grad_(True)
    info = _meta(meta, layers, hq, r, dv, windows, n_sink, rope, score=score, labels=labels,
                 cached="independent")
    k = max(len(windows), 1)
    return Sensitivity(meta=info, k=fisher["k"] / k, v=fisher["v"] / k)
