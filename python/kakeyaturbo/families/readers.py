"""Layers that attend over rows other than their own tokens': KV sharing (a layer reading an
earlier layer's K/V rows: Gemma 3n, Gemma 4, Kolibri 1.1) and cross-attention (an image's rows:
Llama 3.2 Vision, ``mllama``), as their configs name them."""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Optional

from ..errors import UnsupportedModelError


def kv_sources(cfg: Any) -> Optional[Dict[int, int]]:
    """KV sharing (Gemma 3n, Gemma 4, Kolibri 1.1): each ``reuse`` layer's producer, the last
    ``store`` layer of its layer type before it (``config.kv_sharing_modes``), or the one
    ``config.kv_source_layers`` names (Kolibri 1.1: not always the last); ``{}`` without sharing,
    None where the config says layers share but not how."""
    try:
        modes = getattr(cfg, "kv_sharing_modes", None)
    except Exception:  # a config whose sharing does not add up
        return None
    if not modes or "reuse" not in modes:
        return None if getattr(cfg, "num_kv_shared_layers", 0) else {}
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) != len(modes):
        return None
    out: Dict[int, int] = {}
    sources = getattr(cfg, "kv_source_layers", None)  # Kolibri 1.1: each layer's producer, by index
    for i, mode in enumerate(modes):
        if mode == "reuse" and isinstance(sources, (list, tuple)) and len(sources) == len(modes):
            j = sources[i]
            if not (isinstance(j, int) and 0 <= j < i and modes[j] == "store" and types[j] == types[i]):
                return None
            out[i] = j
        elif mode == "reuse":
            store = [j for j in range(i) if modes[j] == "store" and types[j] == types[i]]
            if not store:
                return None
            out[i] = store[-1]
    return out


def cross_layers(cfg: Any, mt: str, n: int) -> FrozenSet[int]:
    """The cross-attention layers ``config.cross_attention_layers`` names (mllama's), checked."""
    named = getattr(cfg, "cross_attention_layers", None) or ()
    if not isinstance(named, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                       and 0 <= i < n for i in named):
        raise UnsupportedModelError(f"model type {mt!r}: cross_attention_layers {named!r} are not layer "
                                    f"indices below {n}")
    return frozenset(named)
