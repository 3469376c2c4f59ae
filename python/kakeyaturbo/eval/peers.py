"""Library peers: the KV-cache quantisers a Hugging Face user would install instead, run through
their own library's code (transformers' ``QuantizedCache`` with the ``quanto`` and ``hqq``
backends, and its per-tensor ``fp8`` layer), on the same windows and protocol as the codec.

A peer's cache is filled with the prefilled keys and values through the library's own
``update`` (what the attention modules call during prefill: the prefix attends to itself at
full precision, then the library quantises it), and the continuation is scored through that
cache, so the library dequantises as it does in ``generate``. Bits are what the library holds:
every tensor it stores (packed codes, scales and zero points in the dtype it keeps them, the
full-precision residual window) counted at its element size, over the whole model.

Only the module names of the libraries are known here; they are imported when a peer runs.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from .._extras import EVAL_EXTRA, missing


@dataclass(frozen=True)
class Peer:
    """One configuration of transformers' ``QuantizedCache``: ``backend`` (``quanto``, ``hqq``
    or ``fp8``), ``nbits``, ``q_group_size`` and ``residual_length`` (the newest tokens the
    library keeps in full precision) as transformers takes them (None: the library's default),
    and the distribution that provides the backend."""

    name: str
    backend: str
    nbits: Optional[int]
    package: str
    module: str
    q_group_size: Optional[int] = None
    residual_length: Optional[int] = None

    def cache_kwargs(self) -> Dict[str, Any]:
        kw = {"nbits": self.nbits, "q_group_size": self.q_group_size,
              "residual_length": self.residual_length}
        return {k: v for k, v in kw.items() if v is not None}

    def library(self) -> str:
        """The libraries that run it, with their installed versions."""
        names = ["transformers"] + ([self.package] if self.package != "transformers" else [])
        out = []
        for n in names:
            try:
                out.append(f"{n} {importlib.metadata.version(n)}")
            except importlib.metadata.PackageNotFoundError:
                out.append(n)
        return " + ".join(out)


#: Versions the ``eval`` extra pins (pyproject.toml); named in the skip message.
PINS = {"optimum-quanto": "0.2.7", "hqq": "0.2.8.post1"}

# Group size 64 and a 128-token residual window: transformers' defaults for QuantizedCache.
PEERS: Dict[str, Peer] = {p.name: p for p in (
    Peer("quanto-int4", "quanto", 4, "optimum-quanto", "optimum.quanto", 64, 128),
    Peer("quanto-int2", "quanto", 2, "optimum-quanto", "optimum.quanto", 64, 128),
    Peer("hqq-int4", "hqq", 4, "hqq", "hqq", 64, 128),
    Peer("hqq-int3", "hqq", 3, "hqq", "hqq", 64, 128),
    Peer("hqq-int2", "hqq", 2, "hqq", "hqq", 64, 128),
    Peer("hf-fp8", "fp8", None, "transformers", "transformers"),
)}


def get(name: str) -> Peer:
    """The peer called ``name``; KeyError listing the known ones otherwise."""
    try:
        return PEERS[name]
    except KeyError:
        raise KeyError(f"unknown peer {name!r}; known: {', '.join(PEERS)}") from None


def unavailable(name: str) -> Optional[str]:
    """Why peer ``name`` cannot run here (its package is not installed, with the command that
    installs it), or None."""
    peer = get(name)
    gone = missing([peer.module, "torch", "transformers"])
    if not gone:
        return None
    pin = f"{peer.package}=={PINS[peer.package]}" if peer.package in PINS else peer.package
    return (f"peer {name} skipped: {peer.package if peer.module in gone else gone[0]} is not "
            f"installed ({EVAL_EXTRA}, or pip install {pin})")


def unsupported(name: str, model: Any) -> Optional[str]:
    """Why transformers' ``QuantizedCache`` cannot serve ``model`` (it takes full-attention
    layers only: no sliding-window layers, no hybrid's state layers, none reading another's
    K/V), or None."""
    from ..families import describe

    layout = describe(model)
    other = [what for what, has in (("sliding-window", any(layout.sliding)),
                                    ("chunked-attention", any(s.kind == "chunked" for s in layout.layers)),
                                    ("compressed-attention", any(s.kind == "compressed" for s in layout.layers)),
                                    ("recurrent or convolution state", any(s.kind == "state" for s in layout.layers)),
                                    ("KV-sharing", any(s.kind == "shared" for s in layout.layers)))
             if has]
    if other:
        return (f"peer {name} skipped: transformers' QuantizedCache takes full-attention layers "
                f"only, and model type {layout.model_type!r} has {' and '.join(other)} layers")
    return None


def _ninja_on_path() -> None:
    """optimum-quanto builds its C++ extension on first use with ``ninja``, which pip installs
    into the environment's ``bin/``; a script run as ``.venv/bin/python`` (not activated) does
    not have that on its PATH. Puts it there when ``ninja`` is not found otherwise."""
    if shutil.which("ninja") is None:
        here = Path(sys.executable).parent
        if (here / "ninja").exists():
            os.environ["PATH"] = os.pathsep.join([str(here), os.environ.get("PATH", "")])


def make_cache(peer: Peer, config: Any) -> Any:
    """A fresh transformers ``QuantizedCache`` of ``peer`` for a model ``config``."""
    from transformers.cache_utils import QuantizedCache

    if peer.backend == "quanto":
        _ninja_on_path()

    return QuantizedCache(backend=peer.backend, config=config, **peer.cache_kwargs())


def stored_bytes(obj: Any) -> int:
    """Bytes of every tensor inside ``obj`` (tensors, tensor subclasses that flatten into inner
    tensors as optimum-quanto's do, and tuples, lists and dicts of them), each counted at its
    element size; other values (shapes, flags) count nothing."""
    import torch

    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(stored_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(stored_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(stored_bytes(x) for x in obj.values())
    return 0


def held_bits(cache: Any) -> int:
    """All-in bits a ``QuantizedCache`` holds: the quantised states of every layer and its
    full-precision residual rows, at their stored sizes."""
    total = 0
    for layer in cache.layers:
        total += stored_bytes(getattr(layer, "_quantized_keys", None))
        total += stored_bytes(getattr(layer, "_quantized_values", None))
        for raw in (layer.keys, layer.values):
            if raw is not None and raw.dim() == 4:
                total += raw.numel() * raw.element_size()
    return 8 * total


def fill(peer: Peer, prefilled: Any, config: Any) -> Tuple[Any, int, int]:
    """``(cache, bits, elements)``: a ``QuantizedCache`` of ``peer`` holding the K and V of a
    prefilled ``DynamicCache`` (handed to each layer's ``update`` as the attention modules hand
    them), the bits it holds, and the K and V elements of the prefix."""
    cache = make_cache(peer, config)
    elems = 0
    for i, layer in enumerate(prefilled.layers):
        k, v = layer.keys, layer.values
        if k is None or k.numel() == 0:
            continue
        elems += k.numel() + v.numel()
        cache.layers[i].update(k.clone(), v.clone())
    return cache, held_bits(cache), elems
