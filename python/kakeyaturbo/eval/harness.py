"""The EVAL.md protocol: prefill `ctx` tokens, replace every compressed layer's prefix K and V
by its decoded value, score the next `n_eval` tokens teacher-forced through that cache, and
compare with the uncompressed run on the same windows."""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from .._extras import require

require("kakeyaturbo.eval.harness")

import torch  # noqa: E402

from ..cache import codec_for, compress_cache
from ..cache.prefix import cache_splits, held_span, sink_rows
from ..errors import InvalidParameterError
from ..families import describe
from ..families.layout import COMPRESSOR
from ..recipes import Recipe
from . import baselines, metrics, peers

#: (stream "k"/"v", one head's [T, D] float32) -> (decoded, all-in bits).
Quantiser = Callable[[str, np.ndarray], Tuple[np.ndarray, int]]


@dataclass
class Method:
    name: str
    quantise: Quantiser
    boundary: Sequence[int] = ()
    #: ``codec`` (kakeyaturbo), ``baseline`` (a numpy re-implementation of a published formula)
    #: or ``peer`` (a real library run through its own code, :mod:`kakeyaturbo.eval.peers`).
    kind: str = "baseline"
    #: Leading tokens kept uncompressed (the attention sink), counted at 16 bits.
    n_sink: int = 0
    streams: Sequence[str] = ("k", "v")
    #: A `kakeyaturbo.cache.StreamCodec`; when set, `compress_prefix` codes the cache through
    #: `kakeyaturbo.cache.compress_cache` (blobs, all-in bits) and `quantise` is not called.
    codec: Any = None
    #: Bytes stored once per model (calibrations), reported apart from the per-token bits.
    model_bytes: int = 0
    #: For a library peer: ``(prefilled DynamicCache, model config) -> (cache, bits, elements)``,
    #: the library's own cache holding the prefix; scored through it instead of a copy.
    fill: Any = None
    #: What runs the method, for the report: ``kakeyaturbo``, ``numpy`` or the library.
    impl: str = "numpy"


def peer_method(name: str) -> Method:
    """The library peer ``name`` (:data:`kakeyaturbo.eval.peers.PEERS`) as a method."""
    peer = peers.get(name)
    return Method(name, _no_quantise, kind="peer", impl=peer.library(),
                  fill=lambda cache, config, peer=peer: peers.fill(peer, cache, config))


def _no_quantise(stream: str, x: np.ndarray) -> Tuple[np.ndarray, int]:
    raise AssertionError("codec methods are coded through compress_cache")


def codec_method(recipe: Recipe, num_layers: int, *, stats: Any = None,
                 sensitivity: Any = None, codec: Any = None, groups: Sequence[Any] = ()) -> Method:
    """The method of a recipe: its per-block codec, or (``mode = "calibrated"``) the
    calibrated codecs fitted from ``stats`` (:class:`kakeyaturbo.calibration.AttentionStats`)
    and, where the recipe asks, ``sensitivity`` (:class:`kakeyaturbo.calibration.Sensitivity`),
    with ``groups`` the ``(stats, sensitivity)`` of the model's other groups of K/V layers of one
    shape, or ``codec``, codecs fitted already (a ``ModelCodec`` of this recipe, e.g. loaded from a
    codec file)."""
    if codec is None:
        codec = codec_for(recipe, stats=stats, sensitivity=sensitivity, groups=groups)
    elif (getattr(codec, "recipe", None) != recipe or stats is not None or sensitivity is not None
          or groups):
        raise InvalidParameterError(f"codec_method: the codec given for recipe {recipe.name!r} must "
                                    "have been fitted for it, and comes without statistics")
    model_bytes = int(getattr(codec, "model_bytes", 0))
    return Method(f"kakeyaturbo:{recipe.name}", _no_quantise, recipe.boundary(num_layers), "codec",
                  recipe.n_sink, recipe.streams, codec=codec, model_bytes=model_bytes,
                  impl="kakeyaturbo")


def attribution_methods(method: Method, num_layers: int, groups: int) -> List[Method]:
    """Variants of a codec method that compress only part of the cache, to attribute its loss:
    K only, V only, and each of ``groups`` runs of consecutive layers alone (the other layers
    uncompressed). Bits stay all-in over the whole model, so compare their dppl and KL."""
    out = [replace(method, name=f"{method.name}[{s} only]", streams=(s,))
           for s in ("k", "v") if s in method.streams]
    if groups > 0:
        bounds = np.linspace(0, num_layers, min(groups, num_layers) + 1).round().astype(int)
        for a, b in zip(bounds[:-1], bounds[1:]):
            others = sorted(set(range(num_layers)) - set(range(a, b)) | set(method.boundary))
            out.append(replace(method, name=f"{method.name}[layers {a}-{b - 1}]", boundary=others))
    return out


def baseline_methods(names: Sequence[str]) -> List[Method]:
    """The numpy baselines by name (``NAME+sink``: the first token kept raw, counted at 16 bits)."""
    out = []
    for n in names:
        base, n_sink = baselines.parse(n)
        if base not in baselines.BASELINES:
            raise InvalidParameterError(f"unknown baseline {n!r}; known: {', '.join(baselines.BASELINES)} "
                                        f"(each also with {baselines.SINK_SUFFIX!r})")
        fn = baselines.BASELINES[base]
        out.append(Method(n, lambda s, x, fn=fn: fn(x, s), n_sink=n_sink))
    return out


def _forward(model: Any, ids: Any, cache: Any = None, keep: "int | None" = None) -> Tuple[Any, Any]:
    """One forward pass; the cache keyword is `cache` in transformers 5.24, `past_key_values`
    before it. ``keep``: the logits of the last ``keep`` positions only, where the model's
    forward can (a prefill needs none: at 16k tokens and a 152k vocabulary all of them would take
    10 GB)."""
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    extra = {"logits_to_keep": keep} if keep is not None and "logits_to_keep" in params else {}
    out = model(input_ids=ids, use_cache=True, **{key: cache}, **extra)
    new = getattr(out, "cache", None)
    return out.logits, new if new is not None else out.past_key_values


def compress_prefix(cache: Any, method: Method, rope: Any = None, model: Any = None) -> Tuple[int, int]:
    """Replaces, in place, every layer of a filled `cache` by the method's reconstruction;
    returns (bits, elements) over all layers, elements as the layers hold them (a sliding-window
    layer its last window - 1 tokens). `rope` (`kakeyaturbo.cache.rope.rope_for(model)`) is
    needed by codecs that code keys without RoPE, `model` by a cache of compressed attention
    (DeepSeek V4: where its entries split into keys and values; see `compress_cache`)."""
    splits = cache_splits(cache, model)
    if method.codec is not None:
        stats = compress_cache(cache, method.codec, n_sink=method.n_sink, boundary=method.boundary,
                               streams=method.streams, rope=rope, splits=splits)
        return stats["bits"], stats["elements"]

    bits = elems = 0
    for i, layer in enumerate(cache.layers):
        # A hybrid model's recurrent / convolution state layers hold no K/V rows: left as they are.
        k0, v0 = getattr(layer, "keys", None), getattr(layer, "values", None)
        if k0 is None or v0 is None or k0.numel() == 0:
            continue
        indexer = getattr(layer, "indexer_keys", None)  # dynamic sparse attention: raw, as compress_cache
        if isinstance(indexer, torch.Tensor):
            elems += indexer.numel()
            bits += 16 * indexer.numel()
        entries = getattr(layer, "compressed_kv", None)
        if isinstance(entries, dict):  # compressed attention (DeepSeek V4), as compress_cache treats it
            raw = [k0] + [t for name, t in entries.items() if name != COMPRESSOR and t is not None]
            elems += sum(t.numel() for t in raw)
            bits += 16 * sum(t.numel() for t in raw)
            e = entries.get(COMPRESSOR)
            if e is None or e.numel() == 0:
                continue
            elems += e.numel()
            e = e.unsqueeze(1)  # [1, 1, entries, D]: keys (no RoPE) and values (rotated), as compress_cache
            w = splits[i]
            for stream, t in (("k", e[..., :w]), ("v", e[..., w:])):
                coded = i not in method.boundary and stream in method.streams
                bits += _quantise(method, stream, t, min(method.n_sink, e.shape[2])) if coded else 16 * t.numel()
            continue
        elems += k0.numel() + v0.numel()
        if i in method.boundary:
            bits += 16 * (k0.numel() + v0.numel())
            continue
        first, held = held_span(layer)
        s = sink_rows(method.n_sink, first, held)
        for stream, t in (("k", k0), ("v", v0)):
            bits += _quantise(method, stream, t, s) if stream in method.streams else 16 * t.numel()
    return bits, elems


def _quantise(method: Method, stream: str, t: Any, s: int) -> int:
    """Replaces the rows of ``t`` (``[1, H, T, D]``) after the first ``s`` by the method's
    reconstruction, in place; returns the bits, the ``s`` raw rows at 16 bits each."""
    heads = []
    bits = 0
    for h in range(t.shape[1]):
        x = np.ascontiguousarray(t[0, h].float().numpy(), dtype=np.float32)
        y = x.copy()
        bits += 16 * s * x.shape[1]
        if s < x.shape[0]:
            y[s:], b = method.quantise(stream, np.ascontiguousarray(x[s:]))
            bits += b
        heads.append(torch.from_numpy(y))
    t.copy_(torch.stack(heads)[None].to(t.dtype))
    return bits


@dataclass
class Scores:
    nll: List[np.ndarray] = field(default_factory=list)
    agree: List[np.ndarray] = field(default_factory=list)
    kl: List[np.ndarray] = field(default_factory=list)
    bits: int = 0
    elems: int = 0
    seconds: float = 0.0


def evaluate(model: Any, windows: Sequence[Sequence[int]], ctx: int, methods: Sequence[Method],
             progress: Callable[[Any], Any] = lambda it: it) -> Dict[str, Any]:
    """Runs every method on every window; returns per-method comparisons against the
    uncompressed reference. Each window holds ctx + n_eval + 1 tokens: the prefix, the
    continuation fed through the cache, and one more target."""
    ref = Scores()
    per = {m.name: Scores() for m in methods}
    rope = None
    if any(getattr(m.codec, "pre_rope_keys", False) and "k" in m.streams for m in methods):
        rope = describe(model).require_rope()
    with torch.no_grad():
        for w in progress(windows):
            ids = torch.tensor([list(w)])
            cont, target = ids[:, ctx:-1], ids[0, ctx + 1:]
            _, prefilled = _forward(model, ids[:, :ctx], keep=1)

            def score(method: "Method | None") -> np.ndarray:
                bits = elems = 0
                t0 = time.perf_counter()
                if method is not None and method.fill is not None:
                    cache, bits, elems = method.fill(prefilled, model.config)
                else:
                    # Every method starts from its own copy of the whole prefilled cache: a
                    # sliding-window layer's state is more than its keys and values.
                    cache = copy.deepcopy(prefilled)
                if method is not None and method.fill is None:
                    bits, elems = compress_prefix(cache, method, rope, model)
                logits, _ = _forward(model, cont, cache)
                s = per[method.name] if method is not None else ref
                s.seconds += time.perf_counter() - t0
                s.bits += bits
                s.elems += elems
                return torch.log_softmax(logits[0].double(), dim=-1).numpy()

            lp_ref = score(None)
            ref.nll.append(-lp_ref[np.arange(len(target)), target.numpy()])
            top_ref = lp_ref.argmax(axis=1)
            for m in methods:
                lp = score(m)
                s = per[m.name]
                s.nll.append(-lp[np.arange(len(target)), target.numpy()])
                s.agree.append(lp.argmax(axis=1) == top_ref)
                s.kl.append(np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=1))
    results = {}
    nll_ref = np.stack(ref.nll)
    for m in methods:
        s = per[m.name]
        c = metrics.compare(nll_ref, np.stack(s.nll), np.stack(s.agree), np.stack(s.kl))
        bpe = s.bits / s.elems
        results[m.name] = dict(c.to_dict(), kind=m.kind, impl=m.impl, bits_per_element=bpe,
                               ratio_vs_bf16=16.0 / bpe, boundary_layers=list(m.boundary),
                               seconds=s.seconds, model_bytes=m.model_bytes)
    return results
