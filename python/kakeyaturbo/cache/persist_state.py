"""What a saved prefix keeps of a layer beyond its K/V rows (a version-3 file,
:mod:`kakeyaturbo.cache.persist`): a hybrid model's recurrent and convolution states (transformers'
``LinearAttentionLayer``, and Falcon-H1's :class:`~kakeyaturbo.cache.extra_layers.KakeyaStateLayer`)
and the indexer's keys of dynamic sparse attention (DeepSeek V3.2, GLM-5, HY-V4:
:class:`~kakeyaturbo.cache.extra_layers.KakeyaIndexedLayer`), raw, as transformers holds them.

Per layer the header lists its tensors (``state``: name, dtype, shape) and flags (``flags``:
whether a state index has seen a token); their bytes follow the layer's streams. A reader knows
each name's meaning and refuses any other name, and checks every shape against what the model's
own layer holds after one token (:func:`expected`: the batch and token axes excepted) before it
reads a byte."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..errors import CorruptDataError, InvalidParameterError
from .extra_layers import KakeyaIndexedLayer

#: The version of a file that holds layer states.
VERSION = 3
#: Dtypes a state tensor may have (raw rows' and the position ids').
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64}
#: Per name prefix, the axis of the batch and of the tokens (None: the state does not grow).
_AXES = {"conv": (0, None), "recurrent": (0, None), "indexer_keys": (0, 1), "indexer_position_ids": (1, 2)}


def layer_state(layer: Any) -> Tuple[List[Tuple[str, torch.Tensor]], Dict[str, bool]]:
    """``([(name, tensor)], {flag: bool})`` of what ``layer`` holds beyond K/V rows (empty lists
    for a layer without). InvalidParameterError while a hybrid layer records the past (assisted
    decoding between a draft and its check)."""
    tensors: List[Tuple[str, torch.Tensor]] = []
    flags: Dict[str, bool] = {}
    if isinstance(layer, LinearAttentionCacheLayerMixin):
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
    return tensors, flags


def holds_states(layout: Any) -> bool:
    """Whether a model's cache layers hold states beyond K/V rows (a hybrid's, an indexer's)."""
    return layout.stateful or any(s.cache_type == "indexed_attention" for s in layout.layers)


def expected(model: Any) -> Dict[int, Dict[str, Tuple[Tuple[int, ...], torch.dtype]]]:
    """Per layer, the shape and dtype of every state tensor the model's own cache holds after one
    token (batch 1): what a file's states are checked against."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    p = next(iter(model.parameters()), None)
    ids = torch.zeros((1, 1), dtype=torch.long, device=None if p is None else p.device)
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
        out[i] = got
    return out


def check_states(entries: List[Dict[str, Any]], flags: Dict[str, bool],
                 want: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], batch: int, seen: int, where: str) -> None:
    """CorruptDataError naming the file unless the state tensors ``entries`` lists (header
    fields, checked for type already) are those the model's layer holds (``want``: empty for a
    cache that holds no token), each of its dtype and of its shape at ``batch`` rows (and
    ``seen`` tokens where the state grows with the tokens), and the flags those of its state
    indices."""
    indices = {name.partition(".")[2] for name in want if name.startswith(("conv.", "recurrent."))}
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
            need[t_axis] = seen
        if DTYPES[e["dtype"]] != dtype or list(e["shape"]) != need:
            raise CorruptDataError(f"{where} is inconsistent: state {name!r} of {e['dtype']} {e['shape']} in its "
                                   f"header, the model's layer holds {str(dtype).replace('torch.', '')} {need}")


def restore(layer: Any, tensors: Dict[str, torch.Tensor], flags: Dict[str, bool]) -> None:
    """Puts states :func:`layer_state` gave (read back from a file) into a fresh ``layer``."""
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
    if isinstance(layer, KakeyaIndexedLayer):
        layer.indexer_keys = tensors.get("indexer_keys")
        layer.indexer_position_ids = tensors.get("indexer_position_ids")
        layer.is_indexer_initialized = layer.indexer_keys is not None


def check_header(layer: Dict[str, Any], i: int, max_dim: int, max_elements: int) -> None:
    """Types and ranges of a layer's ``state`` and ``flags`` header fields (ValueError,
    TypeError): names of a known kind, dtypes known, shapes of bounded integers."""
    state, flags = layer.get("state", []), layer.get("flags", {})
    if not isinstance(state, list) or not isinstance(flags, dict):
        raise TypeError(f"layer {i} state or flags")
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
