"""What a saved prefix keeps of a layer beyond its K/V rows (a version-3 file,
:mod:`kakeyaturbo.cache.persist`): a hybrid model's recurrent and convolution states (transformers'
``LinearAttentionLayer``, and Falcon-H1's :class:`~kakeyaturbo.cache.extra_layers.KakeyaStateLayer`)
the indexer's keys of dynamic sparse attention (DeepSeek V3.2, GLM-5, HY-V4:
:class:`~kakeyaturbo.cache.extra_layers.KakeyaIndexedLayer`), and a compressed-attention layer's
window, compressor buffers, overlap state and indexer entries (DeepSeek V4:
:mod:`~kakeyaturbo.cache.compressed`; its coded entries are the layer's streams), raw, as
transformers holds them.

Per layer the header lists its tensors (``state``: name, dtype, shape), flags (``flags``:
whether a state index has seen a token) and counts (``counts``: a compressed layer's tokens and
entries); the tensors' bytes follow the layer's streams. A reader knows each name's meaning and
refuses any other name, and checks every shape against what the model's own layer holds after a
first call (:func:`expected`: the batch axis, and the token axis at the length the counts give)
before it reads a byte."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..errors import CorruptDataError, InvalidParameterError
from ..families.layout import COMPRESSOR
from .compressed import CompressedEntries
from .extra_layers import KakeyaIndexedLayer

#: The version of a file that holds layer states.
VERSION = 3
#: Dtypes a file's raw rows may have.
ROW_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Dtypes a state tensor may have (raw rows' and the position ids').
DTYPES = {**ROW_DTYPES, "int64": torch.int64}
#: Per name prefix, the axis of the batch and of the tokens (None: the state does not grow).
_AXES = {"conv": (0, None), "recurrent": (0, None), "indexer_keys": (0, 1), "indexer_position_ids": (1, 2),
         "window": (0, 2), "buffer_kv": (0, 1), "buffer_gate": (0, 1), "overlap_kv": (0, None),
         "overlap_gate": (0, None), "indexer_entries": (0, 1)}
#: A compressed-attention layer's per-series fields (DeepSeek V4's cache layers).
_SERIES = ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate")
States = Tuple[List[Tuple[str, torch.Tensor]], Dict[str, bool], Dict[str, int]]


def _compressed(layer: Any) -> List[Tuple[str, torch.Tensor]]:
    """The state tensors of a compressed-attention layer (the model's own or a
    :class:`CompressedEntries`): the window, each series' buffers and overlap, the indexer's
    entries (the compressor's entries are the layer's streams, not state)."""
    out = [("window", layer.keys)]
    for f in _SERIES:
        out += [(f"{f}.{name}", t) for name, t in getattr(layer, f, {}).items() if t is not None]
    ix = layer.compressed_kv.get("indexer")
    return out + ([("indexer_entries", ix)] if ix is not None else [])


def layer_state(layer: Any) -> States:
    """``([(name, tensor)], {flag: bool}, {count: int})`` of what ``layer`` holds beyond K/V rows
    (empty for a layer without). InvalidParameterError while a hybrid layer records the past
    (assisted decoding between a draft and its check), or for a state of a dtype no file holds
    (it would be written and then refused on loading)."""
    tensors: List[Tuple[str, torch.Tensor]] = []
    flags: Dict[str, bool] = {}
    counts: Dict[str, int] = {}
    if isinstance(layer, CompressedEntries):
        if layer.is_initialized:
            tensors = _compressed(layer)
            counts = {"cumulative_length": int(layer.cumulative_length),
                      **{f"entry_count.{n}": int(c) for n, c in layer.entry_count.items()}}
    if isinstance(layer, LinearAttentionCacheLayerMixin) and not _empty(layer):
        if layer.record_past:
            raise InvalidParameterError("cannot save a cache while it records the past (assisted decoding): "
                                        "save it after the draft's check")
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                tensors.append((f"conv.{i}", layer.conv_states[i]))
            if layer.is_recurrent_states_initialized[i]:
                tensors.append((f"recurrent.{i}", layer.recurrent_states[i]))
            flags[f"previous.{i}"] = bool(layer.has_previous_state[i])
    if isinstance(layer, KakeyaIndexedLayer):
        for name in ("indexer_keys", "indexer_position_ids"):
            t = getattr(layer, name)
            if t is not None:
                tensors.append((name, t))
    for name, t in tensors:
        if str(t.dtype).replace("torch.", "") not in DTYPES:
            raise InvalidParameterError(f"cannot save state {name!r} of dtype {t.dtype}; known: {list(DTYPES)}")
    return tensors, flags, counts


def _empty(layer: Any) -> bool:
    """Whether a linear layer holds nothing (a new cache's, or one :meth:`KakeyaCache.reset`
    made fresh): saved without flags, as the model's layer that has seen no token (its flags
    were written, which loading refused)."""
    return not any(layer.has_previous_state.values()) and not any(
        isinstance(t, torch.Tensor) for t in (*layer.conv_states.values(), *layer.recurrent_states.values()))


def holds_states(layout: Any) -> bool:
    """Whether a model's cache layers hold states beyond K/V rows (a hybrid's, an indexer's, a
    compressed layer's)."""
    return layout.stateful or any(s.cache_type == "indexed_attention" or s.kind == "compressed"
                                  for s in layout.layers)


def expected(model: Any, layout: Any) -> Dict[int, Dict[str, Tuple[Tuple[int, ...], torch.dtype]]]:
    """Per layer, the shape and dtype of every state tensor the model's own cache holds after a
    first call (batch 1) of one token, or of as many as a compressed layer takes per entry (so
    that its overlap state exists): what a file's states are checked against."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    p = next(iter(model.parameters()), None)
    n = max([1] + [int(s.rate or 1) for s in layout.layers if s.cache_type == "compressed_sparse_attention"])
    ids = torch.zeros((1, n), dtype=torch.long, device=None if p is None else p.device)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    out: Dict[int, Dict[str, Tuple[Tuple[int, ...], torch.dtype]]] = {}
    for i, layer in enumerate(cache.layers):
        got: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for j in range(layer.number_of_states):
                for name, held in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                    t = held.get(j) if isinstance(held, dict) else None
                    if isinstance(t, torch.Tensor):
                        got[f"{name}.{j}"] = (tuple(t.shape), t.dtype)
        for name in ("indexer_keys", "indexer_position_ids"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                got[name] = (tuple(t.shape), t.dtype)
        if isinstance(getattr(layer, "compressed_kv", None), dict):
            got.update((name, (tuple(t.shape), t.dtype)) for name, t in _compressed(layer))
        out[i] = got
    return out


def check_states(entries: List[Dict[str, Any]], flags: Dict[str, bool], counts: Dict[str, int],
                 want: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], batch: int, seen: int, spec: Any,
                 where: str) -> None:
    """CorruptDataError naming the file unless the state tensors ``entries`` lists (header
    fields, checked for type already) are those the model's layer (``spec``) holds (``want``:
    empty for a cache that holds no token), each of its dtype and of its shape at ``batch`` rows
    and, where the state grows, at the length ``seen`` tokens (a compressed layer: its counts)
    give; the flags those of its state indices, the counts a compressed layer's."""
    indices = {name.partition(".")[2] for name in want if name.startswith(("conv.", "recurrent."))}
    lengths = _lengths(counts, want, seen, spec, where) if want and spec.kind == "compressed" else {}
    if lengths:  # no overlap state before a series' first entry
        want = {n: v for n, v in want.items() if not n.startswith("overlap") or counts[f"entry_count.{_series(n)}"]}
    elif counts:
        raise CorruptDataError(f"{where} is inconsistent: counts {sorted(counts)} for a layer that keeps none")
    names = [e["name"] for e in entries]
    if sorted(names) != sorted(want) or sorted(flags) != sorted(f"previous.{j}" for j in indices):
        raise CorruptDataError(f"{where} is inconsistent: states {sorted(names)} and flags {sorted(flags)} in its "
                               f"header, the model's layer holds {sorted(want)} (of state indices {sorted(indices)})")
    for e in entries:
        name = e["name"]
        shape, dtype = want[name]
        b_axis, t_axis = _AXES[name.split(".")[0]]
        need = list(shape)
        need[b_axis] = batch
        if t_axis is not None:
            need[t_axis] = lengths.get(name, seen)
        if DTYPES[e["dtype"]] != dtype or list(e["shape"]) != need:
            raise CorruptDataError(f"{where} is inconsistent: state {name!r} of {e['dtype']} {e['shape']} in its "
                                   f"header, the model's layer holds {str(dtype).replace('torch.', '')} {need}")


def _series(name: str) -> str:
    return name.partition(".")[2]


def _lengths(counts: Dict[str, int], want: Dict[str, Any], seen: int, spec: Any, where: str) -> Dict[str, int]:
    """A compressed layer's counts checked (its tokens, its series' entries: ``seen`` of the
    compressor's held as the layer's streams) and the lengths of its growing states they give."""
    series = sorted({_series(n) for n in want if n.startswith("buffer_kv.")})
    if sorted(counts) != sorted(["cumulative_length"] + [f"entry_count.{n}" for n in series]):
        raise CorruptDataError(f"{where} is inconsistent: counts {sorted(counts)}, the model's layer keeps "
                               f"the tokens and the entries of {series}")
    tokens, rate = counts["cumulative_length"], int(spec.rate)
    if counts[f"entry_count.{COMPRESSOR}"] != seen or any(counts[f"entry_count.{n}"] * rate > tokens for n in series):
        raise CorruptDataError(f"{where} is inconsistent: {seen} entries held, counts {counts}, one entry per {rate} "
                               "tokens")
    out = {"window": min(tokens, int(spec.window) - 1),
           "indexer_entries": counts.get("entry_count.indexer", 0)}
    for n in series:
        out[f"buffer_kv.{n}"] = out[f"buffer_gate.{n}"] = tokens - counts[f"entry_count.{n}"] * rate
    return out


def restore(layer: Any, tensors: Dict[str, torch.Tensor], flags: Dict[str, bool], counts: Dict[str, int],
            tokens: int) -> None:
    """Puts states :func:`layer_state` gave (read back from a file) into a fresh ``layer`` of a
    cache that saw ``tokens`` tokens."""
    if isinstance(layer, CompressedEntries) and "window" in tensors:
        window = tensors["window"]
        layer.lazy_initialization(window, window)
        layer.keys = layer.values = window
        layer.cumulative_length = counts["cumulative_length"]
        layer.entry_count = {_series(k): v for k, v in counts.items() if k.startswith("entry_count.")}
        for name, t in tensors.items():
            field, _, series = name.partition(".")
            if field in _SERIES:
                getattr(layer, field)[series] = t
        if "indexer_entries" in tensors:
            layer.compressed_kv["indexer"] = tensors["indexer_entries"]
        return
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for name, t in tensors.items():
            kind, _, j = name.partition(".")
            if kind == "conv":
                layer.lazy_initialization(conv_states=t, state_idx=int(j), conv_kernel_size=t.shape[-1])
                layer.conv_states[int(j)].copy_(t)
            elif kind == "recurrent":
                layer.lazy_initialization(recurrent_states=t, state_idx=int(j))
                layer.recurrent_states[int(j)].copy_(t)
        for name, v in flags.items():
            layer.has_previous_state[int(name.partition(".")[2])] = bool(v)
        # transformers 5.25: a linear layer counts the tokens it saw (its get_seq_length, which
        # the model reads from the cache's first layer for the next positions).
        held = getattr(layer, "cumulative_length_linear", None)
        if isinstance(held, torch.Tensor):
            held.fill_(tokens)
    if isinstance(layer, KakeyaIndexedLayer):
        layer.indexer_keys = tensors.get("indexer_keys")
        layer.indexer_position_ids = tensors.get("indexer_position_ids")
        layer.is_indexer_initialized = layer.indexer_keys is not None


def check_header(layer: Dict[str, Any], i: int, max_dim: int, max_elements: int) -> None:
    """Types and ranges of a layer's ``state`` and ``flags`` header fields (ValueError,
    TypeError): an object, names of a known kind, dtypes known, shapes of bounded integers."""
    if not isinstance(layer, dict):
        raise TypeError(f"layer {i} is {type(layer).__name__}, not an object")
    state, flags, counts = layer.get("state", []), layer.get("flags", {}), layer.get("counts", {})
    if not isinstance(state, list) or not isinstance(flags, dict) or not isinstance(counts, dict):
        raise TypeError(f"layer {i} state, flags or counts")
    for k, v in counts.items():
        ok = k == "cumulative_length" or k in (f"entry_count.{COMPRESSOR}", "entry_count.indexer")
        if not ok or isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= max_elements:
            raise ValueError(f"layer {i} count {k!r} = {v!r}")
    names = set()
    for e in state:
        name = e["name"]
        if not isinstance(name, str) or name.split(".")[0] not in _AXES or name in names:
            raise ValueError(f"layer {i} state {name!r}")
        names.add(name)
        if e["dtype"] not in DTYPES or not isinstance(e["shape"], list) or not e["shape"]:
            raise ValueError(f"layer {i} state {name!r}: dtype {e['dtype']!r}, shape {e['shape']!r}")
        n = 1
        for d in e["shape"]:
            if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= max_dim:
                raise ValueError(f"layer {i} state {name!r}: shape {e['shape']!r}")
            n *= d
        if n > max_elements:
            raise ValueError(f"layer {i} state {name!r}: {n} elements")
    for k, v in flags.items():
        if not isinstance(v, bool) or not k.startswith("previous.") or not k[9:].isdigit():
            raise ValueError(f"layer {i} flag {k!r} = {v!r}")
