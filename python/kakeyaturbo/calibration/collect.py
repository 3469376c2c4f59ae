"""Statistics collected from a model (torch): forward hooks on the attention projections for
the moments (`collect`), and gradients at the cached rows for the sensitivity
(`collect_sensitivity`)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError
from .stats import AttentionStats, Sensitivity


def attention_modules(model: Any) -> List[Any]:
    """The self-attention modules of a Llama/Qwen2-style model, in layer order."""
    try:
        layers = model.model.layers
    except AttributeError as e:
        raise InvalidParameterError("calibration needs a decoder with model.model.layers") from e
    out = []
    for i, layer in enumerate(layers):
        a = getattr(layer, "self_attn", None)
        if a is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise InvalidParameterError(f"layer {i} has no Llama/Qwen2-style self_attn")
        if hasattr(a, "k_norm") or hasattr(a, "q_norm"):
            raise InvalidParameterError(
                f"layer {i} normalises q/k after the projection (Qwen3-style); not supported")
        out.append(a)
    return out


@dataclass
class _Acc:
    n: float = 0.0
    s1: Optional[np.ndarray] = None
    s2: Optional[np.ndarray] = None
    samples: List[np.ndarray] = field(default_factory=list)

    def add(self, x: np.ndarray, w: Optional[np.ndarray] = None) -> None:
        x = x.astype(np.float64)
        if w is None:
            self.n += x.shape[0]
            s1, s2 = x.sum(axis=0), x.T @ x
        else:
            self.n += float(w.sum())
            s1, s2 = w @ x, (x * w[:, None]).T @ x
        self.s1 = s1 if self.s1 is None else self.s1 + s1
        self.s2 = s2 if self.s2 is None else self.s2 + s2

    def moments(self) -> Tuple[np.ndarray, np.ndarray]:
        assert self.s1 is not None and self.s2 is not None and self.n > 0
        mean = self.s1 / self.n
        return mean, self.s2 / self.n - np.outer(mean, mean)


def collect(model: Any, windows: Sequence[Sequence[int]], *, n_sink: int = 1, samples: int = 512,
            seed: int = 0, weighting: str = "attention",
            progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
            meta: Optional[Dict[str, Any]] = None) -> AttentionStats:
    """Runs ``model`` over ``windows`` (token id lists) and gathers :class:`AttentionStats`.
    ``samples`` rows per (layer, kv-head) are drawn uniformly (seeded) from the positions
    ``>= n_sink`` of all windows.

    ``weighting="attention"`` weighs what the errors cost: key and value ``j`` by
    ``sum_i p_ij^2`` and query ``i`` by ``sum_{j >= n_sink} p_ij^2`` (``p`` the attention
    probabilities of the GQA group), since an error ``e_j`` reaches the output of query ``i``
    through ``p_ij`` (values: ``p_ij e_j``; keys: ``p_ij (q_i . e_j) (v_j - o_i)``). Tokens
    that draw attention are often atypical; unweighted moments (``"uniform"``) let the bits go
    to the bulk of tokens that hardly matter.
    """
    import torch

    if weighting not in ("attention", "uniform"):
        raise InvalidParameterError(f"weighting must be 'attention' or 'uniform', got {weighting!r}")

    cfg = model.config
    attn = attention_modules(model)
    n_layers, hq, hkv = len(attn), cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    group = hq // hkv
    q2 = np.zeros((n_layers, hkv, d, d))
    q_count = np.zeros((n_layers, hkv))
    k_acc = [[_Acc() for _ in range(hkv)] for _ in range(n_layers)]
    v_acc = [[_Acc() for _ in range(hkv)] for _ in range(n_layers)]
    rows_per_window = max(0, len(windows[0]) - n_sink) if windows else 0
    total = rows_per_window * len(windows)
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(total, size=min(samples, total), replace=False)) if total else []
    captured: Dict[Tuple[str, int], np.ndarray] = {}

    def hook(kind: str, i: int) -> Callable[..., None]:
        def f(_m: Any, _inp: Any, out: Any) -> None:
            captured[(kind, i)] = out[0].detach().double().numpy()
        return f

    handles = []
    for i, a in enumerate(attn):
        for kind, mod in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj)):
            handles.append(mod.register_forward_hook(hook(kind, i)))
    attn_impl = getattr(model.config, "_attn_implementation", None)
    if weighting == "attention":
        model.set_attn_implementation("eager")  # the only one that returns the probabilities
    try:
        with torch.no_grad():
            for w_i, w in enumerate(progress(windows)):
                captured.clear()
                out = model(input_ids=torch.tensor([list(w)]), use_cache=False,
                            output_attentions=weighting == "attention")
                t = len(w)
                sel = [p - w_i * rows_per_window for p in pick
                       if w_i * rows_per_window <= p < (w_i + 1) * rows_per_window]
                for i in range(n_layers):
                    q = captured[("q", i)].reshape(t, hkv, group, d)
                    if weighting == "attention":
                        p2 = out.attentions[i][0].double().numpy().reshape(hkv, group, t, t) ** 2
                        wq = p2[..., n_sink:].sum(axis=-1)  # [hkv, group, t] per query
                        wk = p2.sum(axis=(1, 2))[:, n_sink:]  # [hkv, t - n_sink] per key
                    else:
                        wq = np.ones((hkv, group, t))
                        wk = None
                    q2[i] += np.einsum("hgt,thga,thgb->hab", wq, q, q)
                    q_count[i] += wq.sum(axis=(1, 2))
                    for kind, acc in (("k", k_acc), ("v", v_acc)):
                        x = captured[(kind, i)].reshape(t, hkv, d)[n_sink:]
                        for h in range(hkv):
                            acc[i][h].add(x[:, h], None if wk is None else wk[h])
                            if sel:
                                acc[i][h].samples.append(x[sel, h].astype(np.float32))
    finally:
        for h in handles:
            h.remove()
        if weighting == "attention" and attn_impl is not None:
            model.set_attn_implementation(attn_impl)
    o_gram = np.zeros((n_layers, hkv, d, d))
    for i, a in enumerate(attn):
        w_o = a.o_proj.weight.detach().double().numpy()  # [hidden, hq * d]
        for h in range(hkv):
            for g in range(group):
                blk = w_o[:, (h * group + g) * d:(h * group + g + 1) * d]
                o_gram[i, h] += blk.T @ blk
    km, kc, vm, vc = (np.zeros((n_layers, hkv, d)), np.zeros((n_layers, hkv, d, d)),
                      np.zeros((n_layers, hkv, d)), np.zeros((n_layers, hkv, d, d)))
    for i in range(n_layers):
        for h in range(hkv):
            km[i, h], kc[i, h] = k_acc[i][h].moments()
            vm[i, h], vc[i, h] = v_acc[i][h].moments()

    def stack(acc: List[List[_Acc]]) -> np.ndarray:
        return np.stack([np.stack([np.concatenate(a.samples) if a.samples else np.zeros((0, d), np.float32)
                                   for a in row]) for row in acc]).astype(np.float32)

    info = dict(meta or {})
    info.update(windows=len(windows), window=len(windows[0]) if windows else 0, n_sink=n_sink,
                tokens=sum(len(w) for w in windows), layers=n_layers, q_heads=hq, kv_heads=hkv,
                head_dim=d, samples=len(pick), date=datetime.date.today().isoformat(),
                weighting=weighting, hooks="pre-RoPE q_proj/k_proj/v_proj outputs")
    q2 /= np.maximum(q_count, 1e-300)[:, :, None, None]
    return AttentionStats(meta=info, q2=q2, k_mean=km, k_cov=kc, v_mean=vm,
                          v_cov=vc, o_gram=o_gram, k_samples=stack(k_acc), v_samples=stack(v_acc))


def collect_sensitivity(model: Any, windows: Sequence[Sequence[int]], *, n_sink: int = 1,
                        score: int = 64,
                        progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                        meta: Optional[Dict[str, Any]] = None) -> Sensitivity:
    """Runs ``model`` over ``windows`` (token id lists) with gradients and gathers its
    :class:`Sensitivity`, the way the evaluation uses a cache: the first ``ctx = len - score -
    1`` tokens of a window are the cached prefix, the next ``score`` tokens are fed through it
    and their next-token NLL is the loss. The gradients are taken at the cached rows of every
    layer's ``k_proj`` and ``v_proj`` outputs (forward hooks, so keys are seen before RoPE, as
    the calibrated codecs code them; positions ``< n_sink`` left out, they stay uncompressed).
    Each cached row is made an independent input, as in a cache (an error in one layer's
    cached rows does not reach the other layers' cached rows, which were filled before it),
    while the fed tokens stay differentiable through every layer."""
    import torch

    attn = attention_modules(model)
    cfg = model.config
    n_layers, hq, hkv = len(attn), cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    if score < 1 or any(len(w) < n_sink + score + 2 for w in windows):
        raise InvalidParameterError(
            f"windows need n_sink + 1 cached tokens, {score} scored and one more ({n_sink} + {score} + 2)")
    fisher = {s: np.zeros((n_layers, hkv, d, d)) for s in ("k", "v")}
    captured: Dict[Tuple[str, int], Any] = {}
    ctx = 0

    def hook(kind: str, i: int) -> Callable[..., Any]:
        def f(_m: Any, _inp: Any, out: Any) -> Any:
            cached = out[:, :ctx].detach().requires_grad_(True)
            captured[(kind, i)] = cached
            return torch.cat([cached, out[:, ctx:]], dim=1)
        return f

    handles = [mod.register_forward_hook(hook(kind, i))
               for i, a in enumerate(attn) for kind, mod in (("k", a.k_proj), ("v", a.v_proj))]
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        with torch.enable_grad():
            for w in progress(windows):
                captured.clear()
                ids = torch.tensor([list(w)])
                t = len(w)
                ctx = t - score - 1
                logits = model(input_ids=ids, use_cache=False).logits[0, ctx:t - 1]
                nll = -torch.log_softmax(logits.double(), dim=-1).gather(
                    1, ids[0, ctx + 1:, None]).sum()
                keys = [(s, i) for i in range(n_layers) for s in ("k", "v")]
                grads = torch.autograd.grad(nll, [captured[key] for key in keys])
                for (s, i), g in zip(keys, grads):
                    g = g[0, n_sink:].double().reshape(-1, hkv, d)
                    fisher[s][i] += torch.einsum("tha,thb->hab", g, g).numpy()
    finally:
        for h in handles:
            h.remove()
        for p in trainable:
            p.requires_grad_(True)
    info = dict(meta or {})
    info.update(windows=len(windows), window=len(windows[0]) if windows else 0, n_sink=n_sink,
                score=score, layers=n_layers, kv_heads=hkv, head_dim=d, cached="independent",
                date=datetime.date.today().isoformat(),
                hooks="gradients at pre-RoPE k_proj/v_proj outputs")
    n = max(len(windows), 1)
    return Sensitivity(meta=info, k=fisher["k"] / n, v=fisher["v"] / n)
