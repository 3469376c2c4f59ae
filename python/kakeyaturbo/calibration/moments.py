"""What the statistics accumulate: weighted first and second moments of rows, and the attention
weights (sums of squared probabilities, as the model computes them) that weigh them; and the loss
the sensitivity differentiates."""

from __future__ import annotations

import datetime
import inspect
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError, UnsupportedModelError
from ..recipes import CalibrationSettings
from .stats import AttentionStats


class Moments:
    """Weighted first and second moments of rows, per (layer, kv-head), accumulated in float64
    torch (batched over the heads of a layer), and the sampled rows."""

    def __init__(self, layers: int, heads: int, d: int) -> None:
        import torch

        self.n = torch.zeros((layers, heads), dtype=torch.float64)
        self.s1 = torch.zeros((layers, heads, d), dtype=torch.float64)
        self.s2 = torch.zeros((layers, heads, d, d), dtype=torch.float64)
        self.samples: List[List[List[np.ndarray]]] = [[[] for _ in range(heads)] for _ in range(layers)]

    def add(self, layer: int, x: Any, w: Any = None) -> None:
        """``x [heads, n, d]`` float64 rows, ``w [heads, n]`` their weights (None: 1)."""
        import torch

        if w is None:
            self.n[layer] += x.shape[1]
            self.s1[layer] += x.sum(dim=1)
            self.s2[layer] += torch.bmm(x.transpose(1, 2), x)
        else:
            self.n[layer] += w.sum(dim=1)
            xw = x * w[..., None]
            self.s1[layer] += xw.sum(dim=1)
            self.s2[layer] += torch.bmm(xw.transpose(1, 2), x)

    def moments(self) -> Tuple[np.ndarray, np.ndarray]:
        """``(mean [L, H, d], covariance [L, H, d, d])``."""
        mean = self.s1 / self.n[..., None]
        cov = self.s2 / self.n[..., None, None] - mean[..., :, None] * mean[..., None, :]
        return mean.numpy(), cov.numpy()

    def stacked_samples(self, d: int) -> np.ndarray:
        return np.stack([np.stack([np.concatenate(a) if a else np.zeros((0, d), np.float32)
                                   for a in row]) for row in self.samples]).astype(np.float32)


class SampledRows:
    """Which rows to keep as samples: ``samples`` positions drawn uniformly (seeded), without
    repeats, from the positions ``>= n_sink`` of all windows (each ``len(windows[0])`` long)."""

    def __init__(self, windows: Sequence[Sequence[int]], n_sink: int, samples: int, seed: int) -> None:
        per_window = max(0, len(windows[0]) - n_sink) if windows else 0
        self._draw([per_window] * len(windows), samples, np.random.default_rng(seed))

    @classmethod
    def of_counts(cls, counts: Sequence[int], samples: int, rng: Any) -> "SampledRows":
        """``samples`` of the rows of windows holding ``counts`` rows each (counted from their
        first kept row), drawn from ``rng`` (none drawn where ``samples`` is 0)."""
        out = cls.__new__(cls)
        out._draw(counts, samples, rng)
        return out

    def _draw(self, counts: Sequence[int], samples: int, rng: Any) -> None:
        self.lo = np.cumsum([0] + list(counts))
        total = int(self.lo[-1])
        size = min(samples, total)
        self.pick = np.sort(rng.choice(total, size=size, replace=False)) if total and size else []

    def of(self, window: int) -> List[int]:
        """The rows drawn in window ``window``, counted from its position ``n_sink``."""
        lo, hi = self.lo[window], self.lo[window + 1]
        return [int(p - lo) for p in self.pick if lo <= p < hi]

    def __len__(self) -> int:
        return len(self.pick)


def layer_meta(layers: Sequence[int]) -> Dict[str, Any]:
    """``layers`` (the number of K/V layers) and, for a hybrid model whose K/V layers are not
    ``0 .. n-1``, ``layer_index`` (the model's index of each)."""
    out: Dict[str, Any] = {"layers": len(layers)}
    if list(layers) != list(range(len(layers))):
        out["layer_index"] = [int(i) for i in layers]
    return out


def attention_p2(module: Any, q: Any, k: Any, mask: Any, kwargs: Dict[str, Any], n_sink: int,
                 chunk: int = 64, v: Any = None) -> Tuple[Any, ...]:
    """Sums of squared attention probabilities of one layer and window, as the model's attention
    computes the probabilities (its ``scaling``, ``softcap`` and the layer's mask: causal,
    sliding window): ``wq [kv_heads, group, T]`` (``sum_{j >= n_sink} p_ij^2`` per query) and
    ``wk [kv_heads, T]`` (``sum_i p_ij^2`` over the queries of the GQA group, per key), float64.

    ``q [1, Hq, T, D]``, ``k [1, Hkv, T, D]`` (no cache: queries and keys are the same
    positions); ``mask`` as the model's attention implementation gets it (None, or not 4-D as
    flash attention's: causal and the ``sliding_window`` the layer passes; bool: True where
    attended; float: added; one for every head or one per query head, as Doge's dynamic mask;
    keys after a query are masked in all of them). Computed in float32, ``chunk`` query
    positions at a time against the keys up to the chunk's last, so no
    ``[Hq, T, T]`` tensor is ever materialised and the masked half is never computed. With
    ``v [1, Hkv, T, D]`` the attention output is computed from the same probabilities and
    returned third, ``[1, T, Hq, D]`` in ``q``'s dtype, as transformers' attention functions
    return it (the statistics pass uses it instead of running the model's attention a second
    time; equal to the model's own output to float32 rounding, checked per family). A module
    with learnt sinks (``module.sinks``, one logit per query head: GPT-OSS) has each query's
    softmax taken with its head's sink logit as one more entry, which holds no value and is
    dropped from the sums, as the model's attention does. A ``position_bias`` the model passes
    (``[1, Hq, T, T]``, added to the scaled logits: Inkling's relative position bias) is added
    as its eager attention adds it; per-query sink logits it passes as ``sinks`` (``[1, Hq, T,
    1]``: Inkling 2's, computed from the hidden state) are taken as the learnt sinks are."""
    import torch

    _, hq, t, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scaling = kwargs.get("scaling")
    scaling = float(d ** -0.5 if scaling is None else scaling)
    softcap = kwargs.get("softcap")
    window = kwargs.get("sliding_window")
    qf = q[0].detach().float().reshape(hkv, group, t, d)
    kt = k[0].detach().float().transpose(1, 2)  # [hkv, d, t]
    wq = torch.empty((hkv, group, t), dtype=torch.float64)
    wk = torch.zeros((hkv, t), dtype=torch.float64)
    pos = torch.arange(t)
    sinks = getattr(module, "sinks", None)
    if sinks is not None:
        sinks = sinks.detach().float().reshape(hkv, group, 1, 1).expand(-1, -1, t, 1)
    if kwargs.get("sinks") is not None:  # one sink logit per query
        sinks = kwargs["sinks"][0].detach().float().reshape(hkv, group, t, 1)
    bias = kwargs.get("position_bias")
    if bias is not None:
        bias = bias[0].detach().float().reshape(hkv, group, t, -1)[..., -t:]
    vf = None if v is None else v[0].detach().float()[:, None]  # [hkv, 1, t, d]
    out = None if v is None else torch.empty((hkv, group, t, vf.shape[-1]), dtype=torch.float32)
    for a in range(0, t, chunk):
        b = min(a + chunk, t)  # causal: queries a..b-1 see keys 0..b-1 at most
        logits = torch.matmul(qf[:, :, a:b], kt[:, None, :, :b]) * scaling  # [hkv, group, c, b]
        if bias is not None:
            logits += bias[:, :, a:b, :b]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if mask is None or mask.ndim != 4:  # causal (and the layer's window) by position
            hidden = pos[None, :b] > pos[a:b, None]
            if window:
                hidden |= pos[None, :b] <= pos[a:b, None] - window
            logits.masked_fill_(hidden, float("-inf"))
        else:  # one mask for every head, or one per query head (Doge's dynamic mask: a bias per key)
            m = mask[0, :, a:b, :b]
            m = m[None] if m.shape[0] == 1 else m.reshape(hkv, group, b - a, b)
            if m.dtype == torch.bool:
                logits.masked_fill_(~m, float("-inf"))
            else:
                logits += m.float()
        if sinks is None:
            p2 = torch.softmax(logits, dim=-1)
        else:
            p2 = torch.softmax(torch.cat([logits, sinks[:, :, a:b]], dim=-1), dim=-1)[..., :-1]
        if out is not None:
            out[:, :, a:b] = torch.matmul(p2, vf[:, :, :b])
        p2.square_()
        wq[:, :, a:b] = p2[..., n_sink:].sum(dim=-1)
        wk[:, :b] += p2.sum(dim=(1, 2))
    if out is None:
        return wq, wk
    return wq, wk, out.reshape(1, hq, t, -1).transpose(1, 2).contiguous().to(q.dtype)


def no_logits(model: Any) -> Dict[str, Any]:
    """Forward arguments that skip the LM head where the model's forward can (``logits_to_keep``:
    the statistics need no logits, and over a window the head is a fifth of a small model's
    forward pass)."""
    try:
        accepted = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}


def scored_nll(logits: Any, ids: Any, ctx: int, labels: str, seed: int, window: int) -> Any:
    """The summed next-token NLL of the scored positions ``ctx .. len - 2`` (``logits`` theirs,
    ``[scored, vocab]``): of the window's own next tokens (``labels`` ``"text"``), or of tokens
    drawn from the model's prediction at each (``"model"``, seeded by ``seed`` and the window's
    index)."""
    import torch

    logp = torch.log_softmax(logits.double(), dim=-1)
    if labels == "text":
        target = ids[0, ctx + 1:, None]
    else:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + window)
        target = torch.multinomial(logp.detach().exp(), 1, generator=gen)
    return -logp.gather(1, target).sum()


# --- statistics taken at the cache (multi-head latent attention, compressed attention) --------


def cache_meta(meta: Optional[Dict[str, Any]], layers: Sequence[int], hq: int, d: int, dv: int,
               windows: Sequence[Sequence[int]], n_sink: int, rope: str, hooks: str, **extra: Any) -> Dict[str, Any]:
    """The meta of statistics or a sensitivity taken at the cache: one kv-head of keys ``d`` and
    values ``dv`` wide per layer, ``hooks`` saying where."""
    info = dict(meta or {})
    info.update(windows=len(windows), window=len(windows[0]) if windows else 0, n_sink=n_sink,
                **layer_meta(layers), q_heads=hq, kv_heads=1, head_dim=d, v_dim=dv,
                date=datetime.date.today().isoformat(), hooks=hooks, rope=rope, **extra)
    return info


class CacheMoments:
    """What statistics taken at the cache accumulate per layer (one kv-head): the moments and
    samples of its keys (``d`` wide) and values (``dv``), and the second moments of the queries
    that weigh their errors: the keys' (``q2``) and the values' (kept as ``o_gram``: multi-head
    latent attention's rotated key part, compressed attention's rotated channels, which only
    queries read)."""

    def __init__(self, layers: int, d: int, dv: int) -> None:
        import torch

        self.d, self.dv = d, dv
        self.q2 = torch.zeros((layers, 1, d, d), dtype=torch.float64)
        self.qr2 = torch.zeros((layers, 1, dv, dv), dtype=torch.float64)
        self.q_count = torch.zeros((layers, 1), dtype=torch.float64)
        self.k, self.v = Moments(layers, 1, d), Moments(layers, 1, dv)

    def queries(self, layer: int, qk: Any, qv: Any, w: Any) -> None:
        """Query rows ``qk [n, d]`` and ``qv [n, dv]`` (float64) of weights ``w`` (``n`` of them)."""
        wf = w.reshape(-1, 1)
        self.q2[layer, 0] += (qk * wf).T @ qk
        self.qr2[layer, 0] += (qv * wf).T @ qv
        self.q_count[layer, 0] += w.sum()

    def rows(self, layer: int, k: Any, v: Any, w: Any, sample: Sequence[int]) -> None:
        """Cached rows ``k [1, n, d]`` and ``v [1, n, dv]`` (float64) of weights ``w [1, n]`` (None:
        1); the rows ``sample`` are kept as samples."""
        for acc, x in ((self.k, k), (self.v, v)):
            acc.add(layer, x, w)
            if sample:
                acc.samples[layer][0].append(x[0, list(sample)].numpy().astype(np.float32))

    def stats(self, info: Dict[str, Any]) -> AttentionStats:
        km, kc = self.k.moments()
        vm, vc = self.v.moments()
        norm = self.q_count.clamp_min(1e-300)[:, :, None, None]
        return AttentionStats(meta=info, q2=(self.q2 / norm).numpy(), k_mean=km, k_cov=kc, v_mean=vm, v_cov=vc,
                              o_gram=(self.qr2 / norm).numpy(), k_samples=self.k.stacked_samples(self.d),
                              v_samples=self.v.stacked_samples(self.dv))


def dynamic_cache(model: Any) -> Any:
    """A fresh transformers ``DynamicCache`` for ``model`` (its own layer classes)."""
    import transformers

    return transformers.DynamicCache(config=model.config)


def check_scored(windows: Sequence[Sequence[int]], n_sink: int, score: int, labels: str) -> None:
    """InvalidParameterError for labels or windows a sensitivity at the cache cannot take."""
    if labels not in CalibrationSettings.LABELS:
        raise InvalidParameterError(f"labels must be one of {', '.join(CalibrationSettings.LABELS)}, got {labels!r}")
    if score < 1 or any(len(w) < n_sink + score + 2 for w in windows):
        raise InvalidParameterError(
            f"windows need n_sink + 1 cached tokens, {score} scored and one more ({n_sink} + {score} + 2)")


def cache_gradients(model: Any, windows: Sequence[Sequence[int]], score: int, labels: str, seed: int,
                    progress: Callable[[Iterable[Any]], Iterable[Any]], model_type: str,
                    leaves: Callable[[Any], List[Tuple[Any, Any]]], add: Callable[[Any, Any], None],
                    allow_unused: bool = False) -> None:
    """The gradients a sensitivity at the cache sums, taken as a cache is used: per window the
    first ``len - score - 1`` tokens prefilled into a ``DynamicCache`` without gradients,
    ``leaves(cache)`` makes the cached tensors to differentiate inputs (``[(key, leaf)]``), the
    next ``score`` tokens are fed through the cache and ``add(key, gradient)`` takes the
    gradient of their next-token NLL (``labels``, :func:`scored_nll`) at each leaf (a leaf none
    of them read is refused, or skipped with ``allow_unused``: an indexer may pick none of a
    layer's entries). The model's parameters take no gradient meanwhile."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        for n, w in enumerate(progress(windows)):
            ids = torch.tensor([list(w)])
            ctx = len(w) - score - 1
            cache = dynamic_cache(model)
            with torch.no_grad():
                model(input_ids=ids[:, :ctx], cache=cache)
            made = leaves(cache)
            if not made:
                continue
            with torch.enable_grad():
                logits = model(input_ids=ids[:, ctx:-1], cache=cache).logits[0]
                nll = scored_nll(logits, ids, ctx, labels, seed, n)
                try:
                    grads = torch.autograd.grad(nll, [x for _, x in made], allow_unused=allow_unused)
                except RuntimeError as e:  # e.g. a recurrent layer updating its cached state in place
                    raise UnsupportedModelError(f"model type {model_type!r}: no gradient through its cache ({e})") from None
            for (key, _), g in zip(made, grads):
                if g is not None:
                    add(key, g)
    finally:
        for p in trainable:
            p.requires_grad_(True)
