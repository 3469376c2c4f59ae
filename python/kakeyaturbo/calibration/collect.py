"""Statistics collected from a model (torch), for any decoder family: every layer's queries, keys
and values are seen as the model hands them to attention (after any q/k norm, after RoPE;
:class:`kakeyaturbo.families.AttentionCapture`) and RoPE is removed with the layer's own rotary
module, so the statistics are those of what goes into RoPE. `collect` gathers the moments (and
the attention weights the model computes anyway), `collect_sensitivity` the gradients at the
cached rows."""

from __future__ import annotations

import datetime
import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidParameterError
from ..recipes import CalibrationSettings
from .checks import RotatedKeys, check_keys_rotate_last, check_same_output, fingerprint
from .compressed import collect_compressed, collect_compressed_sensitivity
from .latent import collect_latent, collect_latent_sensitivity
from .moments import Moments, SampledRows, attention_p2, layer_meta, no_logits, scored_nll
from .stats import AttentionStats, Sensitivity

# `kakeyaturbo.families` (torch) is imported inside the functions that need it: the calibration
# fit, allocation and statistics store run on numpy alone.

#: Where the statistics are taken (recorded in their meta, part of the calibration cache key).
CAPTURE_POINT = "attention interface: q/k after any q/k norm with RoPE removed, v as cached"


def attention_modules(model: Any) -> List[Any]:
    """The self-attention modules of the K/V layers a calibration covers
    (:meth:`~kakeyaturbo.families.ModelLayout.calibration_group`), in layer order (one per
    layer, or InvalidParameterError naming the model type)."""
    from ..families import attention_modules as _attention_modules
    from ..families import describe

    layout = describe(model)
    mods = _attention_modules(model)
    want = layout.calibration_group()[0]
    if any(i not in mods for i in want):
        raise InvalidParameterError(
            f"model type {layout.model_type!r}: attention modules found for layers {sorted(mods)}, "
            f"expected {list(want)}")
    return [mods[i] for i in want]


def _at_cache(model: Any, groups: Groups) -> Optional[str]:
    """``"latent"`` for a model with multi-head latent attention, ``"compressed"`` for one with
    compressed attention (their statistics are taken at the cache, :mod:`.latent` and
    :mod:`.compressed`, one group of layers), else None."""
    from ..families import describe

    layout = describe(model)
    kind = "latent" if layout.latent else \
        "compressed" if any(s.kind == "compressed" for s in layout.layers) else None
    if kind is None:
        return None
    known = list(layout.shape_groups()[0][0])
    if groups is not None and (len(groups) != 1 or any(g is not None and [int(i) for i in g] != known
                                                       for g in groups)):
        raise InvalidParameterError(f"model type {layout.model_type!r}: its {kind} layers {known} are one "
                                    f"group, asked for once; got {[None if g is None else list(g) for g in groups]}")
    return kind


class _Group:
    """One group of K/V layers of one shape being collected: its layers (the model's indices, in
    order), shape, and the layers that attend over one of them (KV sharing: layer -> the one it
    reads)."""

    def __init__(self, layers: Tuple[int, ...], hq: int, hkv: int, d: int, shared: Dict[int, int],
                 dv: Optional[int] = None) -> None:
        self.layers, self.hq, self.hkv, self.d, self.shared = layers, hq, hkv, d, shared
        self.dv = dv or d  # the values' width (MiMo-V2-Flash's are narrower than its keys)
        self.group = hq // hkv
        self.row = {i: j for j, i in enumerate(layers)}  # model layer index -> row of the statistics
        self.row.update({i: self.row[src] for i, src in shared.items()})


Groups = Optional[Sequence[Optional[Sequence[int]]]]


def _groups(model: Any, side: str, groups: Groups
            ) -> Tuple[Any, List[_Group], Tuple[int, ...], Dict[int, int]]:
    """``(rope, groups, kv, reads)``: the RoPE to take off the keys (``side`` ``"before"``; None
    ``"after"``, where the keys are taken as cached, so a rotation that cannot be recomputed,
    Phi-4's ``longrope``, does not matter), the groups of K/V layers to collect (``groups``: layer
    lists of :meth:`~kakeyaturbo.families.ModelLayout.shape_groups`, None in it for the
    calibration group; None: every group, the calibration group first), every layer holding
    its own K/V rows, and every layer that attends over another's (layer -> the one it reads)."""
    from ..families import describe

    layout = describe(model)
    known = layout.shape_groups()
    out = []
    for group in ([g[0] for g in known] if groups is None else groups):
        if group is None:
            layers, (hq, hkv, d) = known[0]
        else:
            found = [g for g in known if list(g[0]) == [int(i) for i in group]]
            if not found:
                raise InvalidParameterError(
                    f"model type {layout.model_type!r}: layers {list(group)} are not one of its groups of K/V "
                    f"layers of one shape {[list(g[0]) for g in known]}")
            layers, (hq, hkv, d) = found[0]
        if any(g.layers == layers for g in out):
            raise InvalidParameterError(f"layers {list(layers)} asked twice")
        shared = {s.index: s.reads for s in layout.layers if s.kind == "shared" and s.reads in layers}
        out.append(_Group(layers, hq, hkv, d, shared, layout.layers[layers[0]].v_dim))
    rope = layout.require_rope() if side == "before" else None
    reads = {s.index: s.reads for s in layout.layers if s.kind == "shared"}
    return rope, out, layout.kv_layers, reads


def _check_static(rope: Any, windows: Sequence[Sequence[int]]) -> None:
    """UnsupportedModelError, before the model runs, for windows reaching a dynamic rope type's
    limit (keys past it have no RoPE-free form: ``LayerRope.static_until``)."""
    from ..families.rope import past_static_limit

    limit = min((r.static_until for r in (rope.layers if rope is not None else []) if r is not None and r.static_until),
                default=None)
    if limit is not None and max((len(w) for w in windows), default=0) > limit:
        raise past_static_limit(f"windows of up to {max(len(w) for w in windows)} tokens (at most {limit} serve)",
                                limit)


def _pre_rope(rope: Any, layer: int, x: Any, kwargs: Dict[str, Any], query: bool = False) -> Any:
    """Keys (or, ``query``, queries) ``x [1, H, T, D]`` after RoPE -> float64 before it."""
    from ..families.capture import positions as call_positions

    r = rope.layer(layer)
    x = x.detach().double()
    if r is None:
        return x
    return (r.remove_from_query if query else r.remove)(x, call_positions(kwargs, x.shape[0], x.shape[2]))


ROPE_SIDES = ("before", "after")
#: Whose next tokens the sensitivity's loss scores (:func:`collect_sensitivity`).
LABELS = CalibrationSettings.LABELS


def _side(rope: str) -> str:
    if rope not in ROPE_SIDES:
        raise InvalidParameterError(f"rope must be 'before' or 'after', got {rope!r}")
    return rope


def _check_windows(model: Any, windows: Sequence[Sequence[int]], n_sink: Any, same_length: bool) -> None:
    """InvalidParameterError before any forward pass unless ``windows`` is one or more windows of
    integer token ids of the model's vocabulary (all of one length where ``same_length``), each
    longer than ``n_sink`` (an integer >= 0)."""
    if isinstance(n_sink, bool) or not isinstance(n_sink, numbers.Integral) or n_sink < 0:
        raise InvalidParameterError(f"n_sink must be an integer >= 0, got {n_sink!r}")
    try:
        count = 0 if isinstance(windows, (str, bytes)) else len(windows)
    except TypeError:
        count = 0
    if count == 0:
        raise InvalidParameterError("calibration needs one or more windows (lists of token ids), got none")
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    vocab = getattr(emb, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    lengths = set()
    for n, w in enumerate(windows):
        try:
            a = np.asarray(w)
        except (TypeError, ValueError):  # ragged nesting
            a = np.asarray(None)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise InvalidParameterError(f"window {n} must be a list of integer token ids")
        if a.size <= n_sink:
            raise InvalidParameterError(f"window {n} holds {a.size} tokens: it needs more than n_sink = {n_sink}")
        if a.min() < 0 or (vocab is not None and a.max() >= vocab):
            raise InvalidParameterError(f"window {n} holds token ids outside the model's vocabulary "
                                        f"[0, {vocab}): {int(a.min())} .. {int(a.max())}")
        lengths.add(a.size)
    if same_length and len(lengths) > 1:
        raise InvalidParameterError(f"the windows must all be of one length, got lengths {sorted(lengths)}")


def _with_fingerprint(model: Any, meta: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``meta`` with the fingerprint of the model's attention weights (what
    :meth:`~kakeyaturbo.calibration.Calibration.for_model` and pooling check)."""
    return dict(meta or {}, fingerprint=fingerprint(model))


def weights_o_gram(model: Any, layers: Optional[Sequence[int]] = None) -> np.ndarray:
    """The ``o_gram`` :func:`collect` records for a group of K/V layers (``layers``; None: the
    calibration group), from the model's output projections alone (no forward pass)."""
    from ..families import attention_modules as _attention_modules
    from ..families import output_projection

    _, (g,), _, _ = _groups(model, "after", [layers])
    mods = _attention_modules(model)
    o_gram = np.zeros((len(g.layers), g.hkv, g.dv, g.dv))
    for i in sorted(i for i in g.row if i in mods):
        w_o = output_projection(mods[i], g.hq, g.dv).weight.detach().double().numpy()
        for h in range(g.hkv):
            blk = w_o[:, h * g.group * g.dv:(h + 1) * g.group * g.dv].reshape(w_o.shape[0], g.group, g.dv)
            o_gram[g.row[i], h] += np.einsum("xrd,xre->de", blk, blk)
    return o_gram


def collect(model: Any, windows: Sequence[Sequence[int]], *, n_sink: int = 1, samples: int = 512,
            seed: int = 0, weighting: str = "attention",
            progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
            meta: Optional[Dict[str, Any]] = None, rope: str = "before",
            layers: Optional[Sequence[int]] = None) -> AttentionStats:
    """Runs ``model`` over ``windows`` (token id lists) and gathers :class:`AttentionStats` of its
    queries, keys and values before RoPE (after q/k norms where the family has them). ``samples``
    rows per (layer, kv-head) are drawn uniformly (seeded) from the positions ``>= n_sink`` of all
    windows.

    ``weighting="attention"`` weighs what the errors cost: key and value ``j`` by
    ``sum_i p_ij^2`` and query ``i`` by ``sum_{j >= n_sink} p_ij^2`` (``p`` the attention
    probabilities of the GQA group, as the model computes them: sliding windows, softcapping;
    :func:`attention_p2`), since an error ``e_j`` reaches the output of query ``i`` through
    ``p_ij`` (values: ``p_ij e_j``; keys: ``p_ij (q_i . e_j) (v_j - o_i)``). Tokens that draw
    attention are often atypical; unweighted moments (``"uniform"``) let the bits go to the bulk
    of tokens that hardly matter. One forward pass per window, without the LM head where the
    model allows (``logits_to_keep``); with ``"attention"`` each layer's attention output is
    computed from the probabilities the weights need (the model's own attention would compute
    them a second time), with ``"uniform"`` by the model's own implementation.

    ``rope="after"`` takes the queries, keys and their samples as attention receives them,
    RoPE applied (for codecs that code keys the way the cache holds them, so that attention can
    be computed from the codes; values are the same either way).

    The statistics cover the model's K/V layers of one shape, ``layers`` (one of
    :meth:`~kakeyaturbo.families.ModelLayout.shape_groups`' layer lists; default the calibration
    group: all of them, or Gemma 4's full layers), one row each (``meta["layer_index"]`` names
    them where they are not ``0 .. L-1``: a hybrid's); a layer that shares another's K/V (Gemma
    3n, Gemma 4) adds its queries, attention weights and output projection to the row of the
    layer it reads.

    Raises UnsupportedModelError (a ValueError) for a model whose keys' RoPE cannot be removed
    (``rope="before"`` only: after it, keys are taken as cached, whatever their rotation),
    whose keys change after RoPE (checked on the first window, keys before RoPE only) or whose
    K/V layers leave no such group, InvalidParameterError on a bad ``weighting`` or ``rope``.
    """
    return collect_groups(model, windows, groups=[layers], n_sink=n_sink, samples=samples, seed=seed,
                          weighting=weighting, progress=progress, meta=meta, rope=rope)[0]


def collect_groups(model: Any, windows: Sequence[Sequence[int]], *, groups: Groups = None,
                   n_sink: int = 1, samples: int = 512, seed: int = 0, weighting: str = "attention",
                   progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                   meta: Optional[Dict[str, Any]] = None, rope: str = "before") -> List[AttentionStats]:
    """:func:`collect` for several groups of K/V layers of one shape in one pass over the windows:
    ``groups`` lists them (:meth:`~kakeyaturbo.families.ModelLayout.shape_groups`' layer lists,
    None for the calibration group; default every group, the calibration group first), and the
    statistics of each come back in that order, as :func:`collect` gives them one group at a time
    (to float32 rounding: layers of every group collected return the attention output computed
    from the probabilities, where a pass for one group runs the model's own attention in the
    others)."""
    import torch

    from ..families import AttentionCapture, output_projection

    if weighting not in ("attention", "uniform"):
        raise InvalidParameterError(f"weighting must be 'attention' or 'uniform', got {weighting!r}")
    side = _side(rope)
    _check_windows(model, windows, n_sink, same_length=True)
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 0:
        raise InvalidParameterError(f"samples must be an integer >= 0, got {samples!r}")
    meta = _with_fingerprint(model, meta)
    at_cache = _at_cache(model, groups)
    if at_cache is not None:
        fn = collect_latent if at_cache == "latent" else collect_compressed
        return [fn(model, windows, n_sink=n_sink, samples=samples, seed=seed, weighting=weighting,
                   progress=progress, meta=meta, rope=side)]
    rope, specs, own, reads = _groups(model, side, groups)
    _check_static(rope, windows)
    at = {i: (n, g, j) for n, g in enumerate(specs) for i, j in g.row.items()}  # layer -> (group, row)

    def domain(i: int, x: Any, kwargs: Dict[str, Any], query: bool = False) -> Any:
        return _pre_rope(rope, i, x, kwargs, query) if side == "before" else x.detach().double()

    q2 = [torch.zeros((len(g.layers), g.hkv, g.d, g.d), dtype=torch.float64) for g in specs]
    q_count = [torch.zeros((len(g.layers), g.hkv), dtype=torch.float64) for g in specs]
    k_acc = [Moments(len(g.layers), g.hkv, g.d) for g in specs]
    v_acc = [Moments(len(g.layers), g.hkv, g.dv) for g in specs]
    drawn = SampledRows(windows, n_sink, samples, seed)
    sel: List[int] = []

    def handler(i: int, module: Any, q: Any, k: Any, v: Any, mask: Any, kwargs: Dict[str, Any],
                attend: Any) -> Tuple[Any, Any]:
        if first_window:
            rotated = spy.take()  # what apply_rotary_pos_emb returned for this layer
            if i in own:
                first_keys[i] = (k.detach(), rotated)
        if i not in at:  # a K/V layer of a group not collected: attention as it is
            return attend(q, k, v)
        t = q.shape[2]
        n, g, j = at[i]
        qp = domain(i, q, kwargs, query=True)[0].reshape(g.hkv, g.group * t, g.d)
        if weighting == "attention":  # the output from the probabilities the weights need
            wq, wk_t, o = attention_p2(module, q, k, mask, kwargs, n_sink, v=v)
            out = (o, None)
            if first_window:
                check_same_output(model, i, o, attend(q, k, v)[0])
            wq = wq.reshape(g.hkv, g.group * t)  # per query
            wk = wk_t[:, n_sink:]  # [hkv, t - n_sink] per key
        else:
            out = attend(q, k, v)
            wq = torch.ones((g.hkv, g.group * t), dtype=torch.float64)
            wk = None
        q2[n][j] += torch.bmm((qp * wq[..., None]).transpose(1, 2), qp)
        q_count[n][j] += wq.sum(dim=1)
        for acc, x in ((k_acc[n], domain(i, k, kwargs)), (v_acc[n], v.detach().double())):
            x = x[0, :, n_sink:]  # [hkv, t - n_sink, d]
            acc.add(j, x, wk)
            if sel and i not in g.shared:  # a shared layer's rows are its producer's
                for h in range(g.hkv):
                    acc.samples[j][h].append(x[h, sel].numpy().astype(np.float32))
        return out

    # The first window also checks every layer: the weighted output is the model's own, and
    # (keys before RoPE) attention reads the keys RoPE returned.
    first_keys: Dict[int, Tuple[Any, List[Any]]] = {}
    first_window = True
    spy = RotatedKeys(model)
    cap = AttentionCapture(model, handler)
    # Layers that share K/V then compute the last positions only (Gemma 4), where the statistics
    # need every query of the window (and transformers' sdpa masks such a layer's few queries
    # as if they were the first positions: their attention is not the model's full pass).
    head = {} if reads else no_logits(model)
    with torch.no_grad(), cap:
        for w_i, w in enumerate(progress(windows)):
            sel[:] = drawn.of(w_i)
            if not first_window:
                model(input_ids=torch.tensor([list(w)]), use_cache=False, **head)
                continue
            with spy:
                model(input_ids=torch.tensor([list(w)]), use_cache=False, **head)
            if side == "before":
                check_keys_rotate_last(model, rope, first_keys)
            cap.check([i for g in specs for i in g.layers])
            first_window = False
            first_keys.clear()
    out = []
    for n, g in enumerate(specs):
        o_gram = np.zeros((len(g.layers), g.hkv, g.dv, g.dv))
        for i, a in sorted((i, a) for i, a in cap.seen.items() if i in g.row):
            w_o = output_projection(a, g.hq, g.dv).weight.detach().double().numpy()  # [hidden, hq * dv]
            for h in range(g.hkv):
                for r in range(g.group):
                    blk = w_o[:, (h * g.group + r) * g.dv:(h * g.group + r + 1) * g.dv]
                    o_gram[g.row[i], h] += blk.T @ blk
        km, kc = k_acc[n].moments()
        vm, vc = v_acc[n].moments()
        info = dict(meta or {})
        info.update(windows=len(windows), window=len(windows[0]) if windows else 0, n_sink=n_sink,
                    tokens=sum(len(w) for w in windows), **layer_meta(g.layers), q_heads=g.hq,
                    kv_heads=g.hkv, head_dim=g.d, samples=len(drawn.pick), date=datetime.date.today().isoformat(),
                    weighting=weighting, hooks=CAPTURE_POINT, rope=side)
        q2n = (q2[n] / q_count[n].clamp_min(1e-300)[:, :, None, None]).numpy()
        out.append(AttentionStats(meta=info, q2=q2n, k_mean=km, k_cov=kc, v_mean=vm, v_cov=vc,
                                  o_gram=o_gram, k_samples=k_acc[n].stacked_samples(g.d),
                                  v_samples=v_acc[n].stacked_samples(g.dv)))
    return out


def collect_sensitivity(model: Any, windows: Sequence[Sequence[int]], *, n_sink: int = 1,
                        score: int = 64,
                        progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                        meta: Optional[Dict[str, Any]] = None, rope: str = "before",
                        labels: str = "text", seed: int = 0,
                        layers: Optional[Sequence[int]] = None) -> Sensitivity:
    """Runs ``model`` over ``windows`` (token id lists) with gradients and gathers its
    :class:`Sensitivity`, the way the evaluation uses a cache: the first ``ctx = len - score -
    1`` tokens of a window are the cached prefix, the next ``score`` tokens are fed through it
    and their next-token NLL is the loss. The gradients are taken at the cached rows of every
    layer's keys and values as attention receives them (after RoPE) and carried back through the
    layer's RoPE (its transpose), so they are those of the keys the calibrated codecs code
    (before RoPE, after any k norm); positions ``< n_sink`` are left out, they stay
    uncompressed. Each cached row is made an independent input, as in a cache (an error in one
    layer's cached rows does not reach the other layers' cached rows, which were filled before
    it), while the fed tokens stay differentiable through every layer; in a model with
    recurrent or convolution states (hybrids) the states over the cached positions are held as
    computed, as a cache holds them. ``rope="after"`` keeps
    the keys' gradients as attention receives the keys (RoPE applied), for codecs that code them
    that way. ``layers``: the K/V layers, as :func:`collect` takes them.

    ``labels`` names the next tokens whose NLL is the loss: ``"text"``, the window's own (the
    empirical Fisher: positions weigh by how surprised the model is), or ``"model"``, each drawn
    from the model's own next-token distribution at that position (independently, seeded by
    ``seed`` and the window's index): the expected outer product of those gradients is the
    Gauss-Newton curvature of the loss, the same for any label, which is what a small
    zero-mean coding error costs in expectation, in NLL as in KL from the uncompressed model."""
    return collect_sensitivity_groups(model, windows, groups=[layers], n_sink=n_sink, score=score,
                                      progress=progress, meta=meta, rope=rope, labels=labels, seed=seed)[0]


def collect_sensitivity_groups(model: Any, windows: Sequence[Sequence[int]], *, groups: Groups = None,
                               n_sink: int = 1, score: int = 64,
                               progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                               meta: Optional[Dict[str, Any]] = None, rope: str = "before",
                               labels: str = "text", seed: int = 0) -> List[Sensitivity]:
    """:func:`collect_sensitivity` for several groups of K/V layers of one shape (``groups`` as
    :func:`collect_groups` takes them) from one gradient pass per window: the same loss, its
    gradients at the cached rows of every group's layers at once."""
    import torch

    from ..families import AttentionCapture, describe
    from ..families.capture import positions as call_positions

    side = _side(rope)
    if labels not in LABELS:
        raise InvalidParameterError(f"labels must be one of {', '.join(LABELS)}, got {labels!r}")
    _check_windows(model, windows, n_sink, same_length=False)
    meta = _with_fingerprint(model, meta)
    at_cache = _at_cache(model, groups)
    if at_cache is not None:
        fn = collect_latent_sensitivity if at_cache == "latent" else collect_compressed_sensitivity
        return [fn(model, windows, n_sink=n_sink, score=score, progress=progress, meta=meta, rope=side,
                   labels=labels, seed=seed)]
    rope, specs, own, reads = _groups(model, side, groups)
    _check_static(rope, windows)
    kv_layers = [i for g in specs for i in g.layers]
    row = {i: (m, j) for m, g in enumerate(specs) for j, i in enumerate(g.layers)}  # layer -> (group, row)
    if score < 1 or any(len(w) < n_sink + score + 2 for w in windows):
        raise InvalidParameterError(
            f"windows need n_sink + 1 cached tokens, {score} scored and one more ({n_sink} + {score} + 2)")
    fisher = [{s: np.zeros((len(g.layers), g.hkv, w, w)) for s, w in (("k", g.d), ("v", g.dv))} for g in specs]
    leaves: Dict[Tuple[str, int], Any] = {}
    shared_parts: Dict[int, Tuple[Any, Any]] = {}  # each layer's K/V with its leaves in, for those sharing it
    where: Dict[int, Any] = {}  # RoPE positions of each layer's cached rows, and longrope's factors
    ctx = 0

    def prefix_fixed(out: Tuple[Any, Any], q: Any, k: Any, v: Any, attend: Any) -> Tuple[Any, Any]:
        """The attention output with the cached positions' own rows as the model computed them
        before any error (a recurrent layer after this one carries them into its state, which a
        cache does not recompute); only the fed tokens see the cached rows as inputs."""
        fixed = attend(q, k.detach(), v.detach())[0]
        return torch.cat([fixed[:, :ctx], out[0][:, ctx:]], dim=1), out[1]

    def handler(i: int, module: Any, q: Any, k: Any, v: Any, mask: Any, kwargs: Dict[str, Any],
                attend: Any) -> Tuple[Any, Any]:
        if i in reads:  # attends over the rows of the layer it reads: the same inputs
            out = attend(q, *shared_parts[reads[i]])
            return prefix_fixed(out, q, *shared_parts[reads[i]], attend) if stateful else out
        if i not in own:
            return attend(q, k, v)
        parts = []
        for s, x in (("k", k), ("v", v)):
            cached = x[:, :, :ctx].detach()
            if i in kv_layers:
                cached.requires_grad_(True)
                leaves[(s, i)] = cached
            # A K/V layer of a group not collected: its cached rows are fixed inputs too, as in a
            # cache (else the gradients at the collected rows would run through them).
            parts.append(torch.cat([cached, x[:, :, ctx:]], dim=2))
        if i in kv_layers:
            at = call_positions(kwargs, k.shape[0], k.shape[2])
            r = None if rope is None else rope.layer(i)
            where[i] = (at[:, :ctx], None if r is None else r.long_call(at))  # (longrope: the call's factors)
        shared_parts[i] = (parts[0], parts[1])
        out = attend(q, parts[0], parts[1])
        return prefix_fixed(out, q, k, v, attend) if stateful else out

    # In a model with recurrent (or convolution) states the cached positions' attention outputs
    # reach the fed tokens through those states too: they are kept as computed. (Without such
    # states they reach them only through later layers' cached rows, which are inputs here.)
    stateful = describe(model).stateful
    keep = bool(no_logits(model)) and not reads  # (see collect: KV sharing needs every position)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    cap = AttentionCapture(model, handler)
    try:
        with torch.enable_grad(), cap:
            for n, w in enumerate(progress(windows)):
                leaves.clear()
                ids = torch.tensor([list(w)])
                t = len(w)
                ctx = t - score - 1
                if keep:  # the LM head over the scored positions (and the last) only
                    logits = model(input_ids=ids, use_cache=False,
                                   logits_to_keep=score + 1).logits[0, :-1]
                else:
                    logits = model(input_ids=ids, use_cache=False).logits[0, ctx:t - 1]
                nll = scored_nll(logits, ids, ctx, labels, seed, n)
                cap.check(kv_layers)
                keys = [(s, i) for i in kv_layers for s in ("k", "v")]
                grads = torch.autograd.grad(nll, [leaves[key] for key in keys])
                for (s, i), g in zip(keys, grads):
                    r = None if rope is None else rope.layer(i)
                    if s == "k" and r is not None:
                        g = r.transpose(g.double(), *where[i])
                    g = g[0, :, n_sink:].double()  # [hkv, ctx - n_sink, d]
                    m, j = row[i]
                    fisher[m][s][j] += torch.bmm(g.transpose(1, 2), g).numpy()
    finally:
        for p in trainable:
            p.requires_grad_(True)
    out = []
    for m, g in enumerate(specs):
        info = dict(meta or {})
        info.update(windows=len(windows), window=len(windows[0]) if windows else 0, n_sink=n_sink,
                    score=score, labels=labels, **layer_meta(g.layers), kv_heads=g.hkv, head_dim=g.d,
                    cached="independent", date=datetime.date.today().isoformat(),
                    hooks=f"gradients at the cached rows; {CAPTURE_POINT}", rope=side)
        n = max(len(windows), 1)
        out.append(Sensitivity(meta=info, k=fisher[m]["k"] / n, v=fisher[m]["v"] / n))
    return out
