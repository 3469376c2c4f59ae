"""Calibration: what a model's attention looks like on calibration text, and the calibrated
codecs fitted from it.

`collect` runs a causal LM (Llama- or Qwen2-style attention) over calibration windows and
accumulates, per (layer, kv-head), pre-RoPE statistics from forward hooks on ``q_proj``,
``k_proj`` and ``v_proj``: the query second moment pooled over the query heads of each GQA
group, the mean and covariance of the keys and of the values (the first ``n_sink`` positions
of every window left out: they stay uncompressed), and a sample of rows for fitting Lloyd-Max
tables on the codec's own path. `AttentionStats.save` writes them as safetensors with a JSON
sidecar. `fit_stream` turns statistics into a calibration: an optional whitening
(``query``: ``L = chol(S_q)`` so that the squared error of whitened keys is the squared error
of ``q . k``; ``output``: the Gram matrix of the head's slice of ``o_proj``), a PCA basis in
the whitened space, spreads, and integer bits per component by reverse water-filling.
"""

from __future__ import annotations

import datetime
import heapq
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import (Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple,
                    Type, TypeVar)

import numpy as np

from ._calibrated import CalibratedCodec
from .errors import InvalidParameterError

#: N(0, 1) Lloyd-Max distortion at 0..8 bits (0 bits: the variance itself).
LLOYD_MAX_MSE = (1.0, 0.36338, 0.11748, 0.034548, 0.0095010, 0.0025047, 0.00064424,
                 0.00016348, 0.000041185)

#: Ridge added to the query covariance, relative to its mean diagonal (SPEC section 7).
RIDGE = 1e-3


def allocate_bits(variances: Sequence[float], budget: int, max_bits: int = 8,
                  distortion: Sequence[float] = LLOYD_MAX_MSE) -> np.ndarray:
    """Integer reverse water-filling: ``budget`` bits over components of the given variances,
    at most ``max_bits`` each, minimising ``sum_j var_j * distortion[b_j]``.

    ``distortion`` must be convex and decreasing in the bits (the Lloyd-Max errors are), so
    handing out one bit at a time to the component whose error falls most is optimal. Ties go
    to the lower index. Returns int64 bits, non-increasing when the variances are.
    """
    lam = np.asarray(variances, dtype=np.float64)
    if lam.ndim != 1 or np.any(~np.isfinite(lam)) or np.any(lam < 0):
        raise InvalidParameterError("variances must be a 1-D array of finite values >= 0")
    if budget < 0 or max_bits < 0 or max_bits >= len(distortion):
        raise InvalidParameterError(f"need budget >= 0 and 0 <= max_bits < {len(distortion)}")
    bits = np.zeros(len(lam), dtype=np.int64)
    heap = [(-(v * (distortion[0] - distortion[1])), j) for j, v in enumerate(lam) if max_bits > 0]
    heapq.heapify(heap)
    for _ in range(min(budget, max_bits * len(lam))):
        gain, j = heapq.heappop(heap)
        if gain >= 0:  # nothing left to gain: zero-variance components get no bits
            break
        bits[j] += 1
        b = bits[j]
        if b < max_bits:
            heapq.heappush(heap, (-(lam[j] * (distortion[b] - distortion[b + 1])), j))
    return bits


def water_fill_rates(variances: Sequence[float], rate: float) -> Tuple[np.ndarray, float]:
    """The closed form of reverse water-filling for Gaussian components: rates
    ``R_j = max(0, log2(var_j / theta) / 2)`` summing to ``rate``; returns (rates, theta)."""
    lam = np.asarray(variances, dtype=np.float64)
    pos = lam[lam > 0]
    if rate <= 0 or len(pos) == 0:
        return np.zeros(len(lam)), float(lam.max(initial=0.0))
    lo, hi = np.log2(pos.min()) - 2 * rate - 1, np.log2(pos.max())
    for _ in range(200):
        mid = (lo + hi) / 2
        r = np.maximum(0.0, 0.5 * (np.log2(np.maximum(lam, 1e-300)) - mid)).sum()
        lo, hi = (mid, hi) if r > rate else (lo, mid)
    theta = 2.0 ** ((lo + hi) / 2)
    return np.maximum(0.0, 0.5 * np.log2(np.maximum(lam, 1e-300) / theta)), float(theta)


def lloyd_max(samples: np.ndarray, bits: int, iters: int = 100) -> np.ndarray:
    """A ``2**bits``-level Lloyd-Max table fitted to 1-D samples (1-D Lloyd iteration from the
    N(0, 1) table scaled to the samples' rms); strictly ascending float64."""
    from ._api import centroids_gaussian

    z = np.sort(np.asarray(samples, dtype=np.float64).ravel())
    if z.size < 2 ** bits:
        raise InvalidParameterError(f"{z.size} samples cannot fit a {bits}-bit table")
    c = centroids_gaussian(bits).astype(np.float64) * max(np.sqrt(np.mean(z * z)), 1e-12)
    csum = np.concatenate([[0.0], np.cumsum(z)])
    for _ in range(iters):
        cut = np.searchsorted(z, (c[1:] + c[:-1]) / 2, side="right")
        lo = np.concatenate([[0], cut])
        hi = np.concatenate([cut, [z.size]])
        cnt = hi - lo
        new = np.where(cnt > 0, (csum[hi] - csum[lo]) / np.maximum(cnt, 1), c)
        if np.allclose(new, c, rtol=0, atol=1e-9):
            c = new
            break
        c = new
    # Keep the table strictly ascending even if a cell emptied.
    for i in range(1, len(c)):
        if c[i] <= c[i - 1]:
            c[i] = np.nextafter(np.float32(c[i - 1]), np.float32(np.inf))
    return c


# ---- statistics -------------------------------------------------------------------------------


_S = TypeVar("_S", bound="_Stored")


class _Stored:
    """Arrays (``ARRAYS``) saved as safetensors with a JSON sidecar holding ``meta``; ``KIND``
    names the file in errors."""

    ARRAYS: Tuple[str, ...] = ()
    KIND = "file"
    meta: Dict[str, Any]

    def save(self, path: "os.PathLike[str] | str") -> Tuple[Path, Path]:
        """Writes ``path`` (safetensors) and ``path`` + ``.json`` (the sidecar: meta)."""
        from safetensors.numpy import save_file

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: np.ascontiguousarray(getattr(self, k)) for k in self.ARRAYS}, str(p))
        side = p.with_name(p.name + ".json")
        side.write_text(json.dumps(self.meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        return p, side

    @classmethod
    def load(cls: Type[_S], path: "os.PathLike[str] | str") -> _S:
        from safetensors.numpy import load_file

        p = Path(path)
        try:
            arrays = load_file(str(p))
            meta = json.loads(p.with_name(p.name + ".json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InvalidParameterError(f"cannot read {cls.KIND} {str(p)!r}: {e}") from e
        missing = [k for k in cls.ARRAYS if k not in arrays]
        if missing:
            raise InvalidParameterError(f"{cls.KIND} {str(p)!r} lacks {missing}")
        return cls(meta=meta, **{k: arrays[k] for k in cls.ARRAYS})  # type: ignore[call-arg]


@dataclass
class AttentionStats(_Stored):
    """Per (layer, kv-head) statistics of a model's attention, pre-RoPE. Arrays are float64
    ``[L, H_kv, ...]``; ``*_samples`` float32 ``[L, H_kv, S, D]``."""

    meta: Dict[str, Any]
    q2: np.ndarray
    k_mean: np.ndarray
    k_cov: np.ndarray
    v_mean: np.ndarray
    v_cov: np.ndarray
    o_gram: np.ndarray
    k_samples: np.ndarray
    v_samples: np.ndarray

    ARRAYS = ("q2", "k_mean", "k_cov", "v_mean", "v_cov", "o_gram", "k_samples", "v_samples")
    KIND = "calibration"

    @property
    def num_layers(self) -> int:
        return int(self.q2.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.q2.shape[1])


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


@dataclass
class Sensitivity(_Stored):
    """How much a model's loss reacts to errors in its cached keys and values: per (layer,
    kv-head) the second moment ``sum_t g_t g_t^T`` of the gradient of the loss with respect to
    each cached pre-RoPE key (``k``) and value (``v``) row, float64 ``[L, H_kv, D, D]``, summed
    over the cached positions and averaged over windows (an empirical Fisher). To second order
    an error ``e_t`` in row ``t`` raises the loss by ``e_t^T F e_t / 2``, so ``F`` weighs every
    coded component by what it costs the model."""

    meta: Dict[str, Any]
    k: np.ndarray
    v: np.ndarray

    ARRAYS = ("k", "v")
    KIND = "sensitivity"

    def __post_init__(self) -> None:
        for name in self.ARRAYS:
            a = np.asarray(getattr(self, name), dtype=np.float64)
            if a.ndim != 4 or a.shape[2] != a.shape[3] or a.shape != np.shape(self.k):
                raise InvalidParameterError(
                    f"sensitivity {name!r} must be [layers, kv_heads, D, D] like 'k', got {a.shape}")
            if not np.all(np.isfinite(a)):
                raise InvalidParameterError(f"sensitivity {name!r} holds NaN or inf")
            setattr(self, name, a)

    def of(self, stream: str) -> np.ndarray:
        return self.k if stream == "k" else self.v


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


# ---- fitting ------------------------------------------------------------------------------------


def whitening_factor(second_moment: np.ndarray, ridge: float = RIDGE) -> np.ndarray:
    """Lower-triangular ``L`` with ``L L^T = S + ridge * mean(diag S) I``: a row ``x`` whitened
    as ``x L`` has ``|e L|^2 = e^T S e`` for any error ``e`` (up to the ridge)."""
    s = np.asarray(second_moment, dtype=np.float64)
    s = (s + s.T) / 2
    s = s + ridge * max(float(np.mean(np.diag(s))), 1e-30) * np.eye(len(s))
    return np.linalg.cholesky(s)


@dataclass
class StreamFit:
    """One stream's calibration, before it becomes a :class:`CalibratedCodec`."""

    mean: np.ndarray
    analysis: np.ndarray
    synthesis: np.ndarray
    spread: np.ndarray
    bits: np.ndarray
    variances: np.ndarray
    whitening: Optional[np.ndarray] = None

    def codec(self, **kw: Any) -> CalibratedCodec:
        return CalibratedCodec(self.mean, self.analysis, self.synthesis, self.spread, self.bits, **kw)


def row_budget(bits_per_element: float, d: int, norm: bool) -> int:
    """Index bits per row for a target of all-in bits per element: the target times D, less
    the 16-bit scale, rounded down to whole bytes (rows are byte-aligned)."""
    b = int(np.floor(bits_per_element * d + 1e-9)) - (16 if norm else 0)
    return max(0, b // 8 * 8)


def spectrum(cov: np.ndarray, whitening: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending, >= 0) and eigenvectors (columns) of ``cov`` in the whitened
    space ``x -> x L``: the variances water-filling allocates over."""
    c = np.asarray(cov, dtype=np.float64)
    if whitening is not None:
        w = np.asarray(whitening, dtype=np.float64)
        c = w.T @ c @ w
    lam, u = np.linalg.eigh((c + c.T) / 2)
    order = np.argsort(lam)[::-1]
    return np.maximum(lam[order], 0.0), u[:, order]


def _synthesis(u: np.ndarray, whitening: Optional[np.ndarray]) -> np.ndarray:
    """Synthesis rows of the components ``u`` (columns, in the whitened space): ``U^T L^-1``,
    so that a coefficient error ``e`` is the row error ``e @ synthesis``."""
    if whitening is None:
        return np.asarray(u.T)
    return np.linalg.solve(np.asarray(whitening, dtype=np.float64).T, u).T


def fit_stream(mean: np.ndarray, cov: np.ndarray, bits_per_element: float, *,
               whitening: Optional[np.ndarray] = None, norm: bool = True,
               max_bits: int = 8, bits: Optional[np.ndarray] = None) -> StreamFit:
    """PCA of ``cov`` in the whitened space (``x -> x L``), water-filled to the target (or
    given ``bits`` per component, in the order of :func:`spectrum`).

    Components are sorted by bits, then by variance (so that equal widths form one band even
    when an allocation is not monotone in the variances); those allocated 0 bits are dropped
    (they decode as the mean). ``analysis = U^T L^T`` and ``synthesis = U^T L^-1`` (rows), so that
    ``x = mean + sum_j <x - mean, analysis_j> synthesis_j`` at full rank.
    """
    d = len(mean)
    lam, u = spectrum(cov, whitening)
    w = None if whitening is None else np.asarray(whitening, dtype=np.float64)
    if bits is None:
        bits = allocate_bits(lam, row_budget(bits_per_element, d, norm), max_bits)
    bits = np.asarray(bits, dtype=np.int64)
    keep = np.flatnonzero(bits > 0)
    if keep.size == 0:
        raise InvalidParameterError(
            f"{bits_per_element} bits per element leave no bits for the components at D = {d}")
    keep = keep[np.argsort(-bits[keep], kind="stable")]
    ut = u[:, keep].T
    analysis = ut if w is None else ut @ w.T
    synthesis = _synthesis(ut.T, w)
    floor = max(float(lam[0]), 1e-30) * 1e-12
    return StreamFit(mean=np.asarray(mean, dtype=np.float64), analysis=analysis,
                     synthesis=synthesis, spread=np.sqrt(np.maximum(lam[keep], floor)),
                     bits=bits[keep], variances=lam, whitening=whitening)


def _stream_inputs(stats: AttentionStats, stream: str, layer: int, head: int,
                   settings: Dict[str, Any], sensitivity: Optional[Sensitivity] = None
                   ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """(mean, covariance, whitening factor) of one (stream, layer, kv-head) for the settings."""
    if stream == "k":
        mean, cov = stats.k_mean[layer, head], stats.k_cov[layer, head]
    else:
        mean, cov = stats.v_mean[layer, head], stats.v_cov[layer, head]
    if not settings["center"]:
        cov = cov + np.outer(mean, mean)  # the second moment about zero
        mean = np.zeros_like(mean)
    w = None
    if settings["whiten"] == "query":
        w = whitening_factor(stats.q2[layer, head])
    elif settings["whiten"] == "output":
        w = whitening_factor(stats.o_gram[layer, head])
    elif settings["whiten"] == "fisher":
        if sensitivity is None:
            raise InvalidParameterError("whiten = 'fisher' needs the model's sensitivity")
        w = whitening_factor(sensitivity.of(stream)[layer, head])
    return mean, cov, w


def sensitivity_weights(synthesis: np.ndarray, fisher: np.ndarray) -> np.ndarray:
    """``w_j = s_j^T F s_j`` for synthesis rows ``s_j``: the loss per unit of squared error in
    component ``j`` (an error ``e`` in the coefficients is ``e @ synthesis`` in the row)."""
    s = np.asarray(synthesis, dtype=np.float64)
    return np.maximum(np.einsum("ja,ab,jb->j", s, np.asarray(fisher, dtype=np.float64), s), 0.0)


def weighted_spectrum(stats: AttentionStats, sensitivity: Sensitivity, stream: str, layer: int,
                      head: int, settings: Dict[str, Any]) -> np.ndarray:
    """The variances of one (stream, layer, kv-head)'s components, in the order of
    :func:`spectrum`, each times its :func:`sensitivity_weights`: what an error in it costs the
    model's loss, comparable across layers, heads and streams."""
    _, cov, w = _stream_inputs(stats, stream, layer, head, settings, sensitivity)
    lam, u = spectrum(cov, w)
    return lam * sensitivity_weights(_synthesis(u, w), sensitivity.of(stream)[layer, head])


def _add_bits(sp: np.ndarray, b: np.ndarray, n: int, max_bits: int) -> Tuple[float, np.ndarray]:
    """``n`` more bits for one head's components, one at a time where the error falls most:
    (the fall in ``sum_j sp_j * mse(b_j)``, the new bits); ``-inf`` if they do not fit."""
    lm = np.asarray(LLOYD_MAX_MSE)
    b = b.copy()
    gain = 0.0
    for _ in range(n):
        room = b < max_bits
        if not np.any(room):
            return -np.inf, b
        g = np.where(room, sp * (lm[b] - lm[np.minimum(b + 1, len(lm) - 1)]), -np.inf)
        j = int(np.argmax(g))
        gain += float(g[j])
        b[j] += 1
    return gain, b


def _take_bits(sp: np.ndarray, b: np.ndarray, n: int) -> Tuple[float, np.ndarray]:
    """``n`` bits taken back from one head's components, one at a time where the error rises
    least: (the rise, the new bits)."""
    lm = np.asarray(LLOYD_MAX_MSE)
    b = b.copy()
    loss = 0.0
    for _ in range(n):
        have = b > 0
        c = np.where(have, sp * (lm[np.maximum(b - 1, 0)] - lm[b]), np.inf)
        j = int(np.argmin(c))
        loss += float(c[j])
        b[j] -= 1
    return loss, b


def global_allocation(spectra: Sequence[np.ndarray], row_budgets: Sequence[int],
                      max_bits: int = 8) -> List[np.ndarray]:
    """Water-filling across several (layer, kv-head) at once: the pooled budget goes where the
    (whitened or weighted) variances are largest, whichever head they belong to; then each
    head's row is trimmed to whole bytes by taking back its least useful bits, and the bytes
    so freed go back, one byte at a time, to the head whose error falls most with it (so the
    total never exceeds the pooled budget, and every head keeps at least one byte)."""
    sps = [np.asarray(sp, dtype=np.float64) for sp in spectra]
    total = int(sum(row_budgets))
    bits = allocate_bits(np.concatenate(sps), total, max_bits)
    out, at = [], 0
    for sp in sps:
        b = bits[at:at + len(sp)]
        at += len(sp)
        b = _take_bits(sp, b, int(b.sum()) % 8)[1]  # whole bytes
        if b.sum() == 0:  # every head keeps at least one byte of codes
            b = _add_bits(sp, b, min(8, max_bits * len(b)), max_bits)[1]
        out.append(b)
    left = total - sum(int(b.sum()) for b in out)
    while left < 0:  # the minimum bytes overdrew the budget: take bytes back where it costs least
        asks = [_take_bits(sp, b, 8) if b.sum() >= 16 else (np.inf, b) for sp, b in zip(sps, out)]
        worst = int(np.argmin([c for c, _ in asks]))
        if not np.isfinite(asks[worst][0]):
            raise InvalidParameterError("the pooled budget cannot give every head one byte")
        out[worst] = asks[worst][1]
        left += 8
    offers = [_add_bits(sp, b, 8, max_bits) for sp, b in zip(sps, out)] if left >= 8 else []
    while left >= 8:
        best = int(np.argmax([g for g, _ in offers]))
        if not np.isfinite(offers[best][0]) or offers[best][0] <= 0:
            break
        out[best] = offers[best][1]
        offers[best] = _add_bits(sps[best], out[best], 8, max_bits)
        left -= 8
    return out


def fit_codec(stats: AttentionStats, stream: str, layer: int, head: int,
              settings: Dict[str, Any],
              centroids: Optional[Mapping[int, np.ndarray]] = None,
              bits: Optional[np.ndarray] = None,
              sensitivity: Optional[Sensitivity] = None) -> CalibratedCodec:
    """The calibrated codec of one (stream, layer, kv-head) for the recipe settings of that
    stream (:data:`kakeyaturbo.recipes.CALIBRATED_DEFAULTS` names), with optional custom
    Lloyd-Max tables by bit width and an optional given allocation."""
    mean, cov, w = _stream_inputs(stats, stream, layer, head, settings, sensitivity)
    fit = fit_stream(mean, cov, float(settings["bits"]), whitening=w, norm=settings["norm"],
                     max_bits=int(settings["max_bits"]), bits=bits)
    widths = set(int(b) for b in fit.bits)
    tables = {b: t for b, t in (centroids or {}).items() if b in widths} or None
    return fit.codec(rotation_seed=int(settings["rotation_seed"]), metric=str(settings["metric"]),
                     norm=bool(settings["norm"]), outlier_threshold=settings["outlier_threshold"],
                     centroids=tables)


def fit_tables(codecs: Mapping[Tuple[int, int], CalibratedCodec], samples: np.ndarray,
               min_samples: int = 64) -> Dict[int, np.ndarray]:
    """Lloyd-Max tables by bit width, fitted on the codec's own scaled coordinates ``z`` of the
    calibration sample rows (``samples [L, H, S, D]``), pooled over every (layer, kv-head) of
    the stream. Widths with fewer than ``min_samples * 2**b`` values keep the N(0, 1) table."""
    pooled: Dict[int, List[np.ndarray]] = {}
    for (layer, head), c in codecs.items():
        rows = np.ascontiguousarray(samples[layer, head], dtype=np.float32)
        if len(rows) == 0:
            continue
        z = c.encode_parts(rows)["z"]
        for off, width, b in c.bands:
            pooled.setdefault(int(b), []).append(z[:, off:off + width].ravel())
    out = {}
    for b, parts in pooled.items():
        z = np.concatenate(parts)
        if z.size >= min_samples * 2 ** b:
            out[b] = lloyd_max(z, b)
    return out


class ModelCodec:
    """The calibrated codecs of a whole model for one recipe: a
    :class:`kakeyaturbo.cache.StreamCodec` (keys are coded without RoPE, as calibrated).

    ``model_bytes``: the calibrations' bytes, stored once per model and counted apart from
    the per-token bits.
    """

    pre_rope_keys = True

    def __init__(self, stats: AttentionStats, recipe: Any, *, threads: Optional[int] = None,
                 sensitivity: Optional[Sensitivity] = None) -> None:
        if getattr(recipe, "mode", None) != "calibrated":
            raise InvalidParameterError(f"recipe {getattr(recipe, 'name', recipe)!r} is not calibrated")
        if recipe.needs_sensitivity and sensitivity is None:
            raise InvalidParameterError(
                f"recipe {recipe.name!r} allocates by sensitivity or whitens by it: pass the "
                "model's Sensitivity (kakeyaturbo.calibrate.cached_sensitivity)")
        if sensitivity is not None and sensitivity.k.shape != stats.q2.shape:
            raise InvalidParameterError(
                f"sensitivity of shape {sensitivity.k.shape} (layers, kv-heads, D, D) does not "
                f"match the statistics' {stats.q2.shape}")
        self.recipe = recipe
        self.threads = threads
        self.codecs: Dict[Tuple[str, int, int], CalibratedCodec] = {}
        #: Custom Lloyd-Max tables by stream and bit width (``tables = "calibrated"``).
        self.tables: Dict[str, Dict[int, np.ndarray]] = {}
        keys = [(layer, h) for layer in range(stats.num_layers) for h in range(stats.kv_heads)]
        # allocation = "sensitivity": one pooled water-filling over every (stream, layer,
        # kv-head) that asks for it, on variances weighed by what their errors cost the loss.
        pooled = [(s, key) for s in recipe.streams
                  if recipe.stream(s)["allocation"] == "sensitivity" for key in keys]
        shared: Dict[Tuple[str, int, int], np.ndarray] = {}
        if pooled:
            assert sensitivity is not None
            spectra = [weighted_spectrum(stats, sensitivity, s, *key, recipe.stream(s))
                       for s, key in pooled]
            budgets = [row_budget(float(recipe.stream(s)["bits"]), sp.size, recipe.stream(s)["norm"])
                       for (s, _), sp in zip(pooled, spectra)]
            max_bits = min(int(recipe.stream(s)["max_bits"]) for s, _ in pooled)
            for (s, key), b in zip(pooled, global_allocation(spectra, budgets, max_bits)):
                shared[(s, *key)] = b
        for s in recipe.streams:
            settings = recipe.stream(s)
            alloc: Dict[Tuple[int, int], Optional[np.ndarray]] = {
                key: shared.get((s, *key)) for key in keys}
            if settings["allocation"] == "global":
                spectra = [spectrum(*_stream_inputs(stats, s, *key, settings, sensitivity)[1:])[0]
                           for key in keys]
                d = spectra[0].size
                budget = row_budget(float(settings["bits"]), d, settings["norm"])
                alloc = dict(zip(keys, global_allocation(spectra, [budget] * len(keys),
                                                         int(settings["max_bits"]))))
            first = {key: fit_codec(stats, s, *key, settings, bits=alloc[key],
                                    sensitivity=sensitivity) for key in keys}
            if settings["tables"] == "calibrated":
                self.tables[s] = fit_tables(first, stats.k_samples if s == "k" else stats.v_samples)
                first = {key: fit_codec(stats, s, *key, settings, self.tables[s], alloc[key],
                                        sensitivity) for key in keys}
            for key, c in first.items():
                self.codecs[(s, *key)] = c
        self.model_bytes = sum(c.model_bytes for c in self.codecs.values())

    def __repr__(self) -> str:
        return f"ModelCodec({self.recipe.name!r}, {len(self.codecs)} calibrations)"

    def _codec(self, stream: str, layer: int, head: int) -> CalibratedCodec:
        try:
            return self.codecs[(stream, layer, head)]
        except KeyError:
            raise InvalidParameterError(
                f"no calibration for stream {stream!r}, layer {layer}, kv-head {head}") from None

    def encode(self, stream: str, layer: int, head: int, x: np.ndarray) -> bytes:
        return self._codec(stream, layer, head).encode(x, threads=self.threads)

    def decode(self, stream: str, layer: int, head: int, blob: bytes) -> np.ndarray:
        return self._codec(stream, layer, head).decode(blob, threads=self.threads)


# ---- calibration text and the statistics cache -----------------------------------------------


def calibration_windows(tok: Any, text_path: "os.PathLike[str] | str", windows: int,
                        window: int) -> List[List[int]]:
    """``windows`` token windows of ``window`` tokens from the **calibration** split of the
    text (articles split by title hash, disjoint from the evaluation split)."""
    from .eval import data, model as model_mod

    calib, _ = data.split(data.load_articles(Path(text_path)))
    ids: List[int] = []
    for t in calib:
        ids.extend(tok.encode(t + "\n\n", add_special_tokens=False))
        if len(ids) >= windows * window:
            break
    wins = data.windows(ids, window, windows, model_mod.bos_id(tok))
    if not wins:
        raise InvalidParameterError("the calibration split holds no full window")
    return wins


def stats_path(model_path: "os.PathLike[str] | str", text_path: "os.PathLike[str] | str",
               settings: Dict[str, Any]) -> Path:
    """Where :func:`cached_stats` keeps the statistics of a (model, text, settings)."""
    from .eval.data import CACHE

    mp, tp = Path(model_path), Path(text_path)
    size = mp.stat().st_size if mp.is_file() else 0
    key = (f"{mp.stem}-{size}-{tp.stem}-{settings['windows']}x{settings['window']}-"
           f"{settings['weighting']}")
    return CACHE / "calibration" / f"{key}.safetensors"


def cached_stats(model: Any, tok: Any, model_path: "os.PathLike[str] | str",
                 text_path: "os.PathLike[str] | str", settings: Dict[str, Any], *,
                 n_sink: int = 1, progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it
                 ) -> AttentionStats:
    """The statistics a recipe's ``[calibration]`` asks for: its ``path`` if given, else the
    cached file for this model, text and settings, collected (and cached) when missing."""
    if settings.get("path"):
        return AttentionStats.load(settings["path"])
    path = stats_path(model_path, text_path, settings)
    if path.exists():
        return AttentionStats.load(path)
    wins = calibration_windows(tok, text_path, int(settings["windows"]), int(settings["window"]))
    stats = collect(model, wins, n_sink=n_sink, weighting=settings["weighting"], progress=progress,
                    meta={"model": Path(model_path).name, "text": Path(text_path).name,
                          "split": "calibration"})
    stats.save(path)
    return stats


def sensitivity_path(model_path: "os.PathLike[str] | str", text_path: "os.PathLike[str] | str",
                     settings: Dict[str, Any], n_sink: int) -> Path:
    """Where :func:`cached_sensitivity` keeps the sensitivity of a (model, text, settings)."""
    from .eval.data import CACHE

    mp, tp = Path(model_path), Path(text_path)
    size = mp.stat().st_size if mp.is_file() else 0
    key = (f"{mp.stem}-{size}-{tp.stem}-{settings['sensitivity_windows']}x{settings['window']}-"
           f"score{settings['score']}-sink{n_sink}-sensitivity")
    return CACHE / "calibration" / f"{key}.safetensors"


def cached_sensitivity(model: Any, tok: Any, model_path: "os.PathLike[str] | str",
                       text_path: "os.PathLike[str] | str", settings: Dict[str, Any], *,
                       n_sink: int = 1,
                       progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it
                       ) -> Sensitivity:
    """The :class:`Sensitivity` a recipe's ``[calibration]`` asks for: its
    ``sensitivity_path`` if given, else the cached file for this model, text and settings,
    gathered (and cached) on the calibration split when missing."""
    if settings.get("sensitivity_path"):
        return Sensitivity.load(settings["sensitivity_path"])
    path = sensitivity_path(model_path, text_path, settings, n_sink)
    if path.exists():
        return Sensitivity.load(path)
    wins = calibration_windows(tok, text_path, int(settings["sensitivity_windows"]),
                               int(settings["window"]))
    sens = collect_sensitivity(model, wins, n_sink=n_sink, score=int(settings["score"]),
                               progress=progress,
                               meta={"model": Path(model_path).name, "text": Path(text_path).name,
                                     "split": "calibration"})
    sens.save(path)
    return sens


def model_codec_for(recipe: Any, model: Any, tok: Any, model_path: "os.PathLike[str] | str",
                    text_path: "os.PathLike[str] | str", *,
                    progress: Callable[[str], Callable[[Iterable[Any]], Iterable[Any]]] = (
                        lambda _desc: lambda it: it),
                    threads: Optional[int] = None) -> ModelCodec:
    """The :class:`ModelCodec` of a calibrated recipe for a loaded model: its statistics and,
    where the recipe asks, its sensitivity, each from the cache or gathered on the calibration
    split of ``text_path`` (``progress(description)`` wraps the windows)."""
    n_sink = max(int(recipe.n_sink), 1)
    stats = cached_stats(model, tok, model_path, text_path, recipe.calibration, n_sink=n_sink,
                         progress=progress("calibration"))
    sens = None
    if recipe.needs_sensitivity:
        sens = cached_sensitivity(model, tok, model_path, text_path, recipe.calibration,
                                  n_sink=n_sink, progress=progress("sensitivity"))
    return ModelCodec(stats, recipe, threads=threads, sensitivity=sens)
