"""Rotary position embedding (RoPE) of a model's keys, its exact inverse, and the rotation of
every layer of a loaded model: :mod:`kakeyaturbo.families.rope` (where the pairings, partial
rotary and per-layer-type rotary modules are described), under the name the cache API gives it.

Keys in a transformers cache are stored after RoPE. A codec that wants the keys without it
(``pre_rope_keys``) gets them through :meth:`LayerRope.remove` (:func:`unapply_rope`) and hands
back its decoded keys through :meth:`LayerRope.apply` (:func:`apply_rope`), with the cos/sin of
each layer's own rotary module (:func:`rope_for`), so scaled variants (``linear``, ``llama3``,
``yarn``), Gemma 3's per-layer-type frequencies and partial rotary are respected bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from ..errors import InvalidParameterError
from ..families.layout import rope_for
from ..families.rope import (STYLES, FnRope, LayerRope, ModelRope, apply_rope, layer_rope, layer_ropes,
                             rope_transpose, rotate_half, rotate_interleaved, unapply_rope)

#: positions ``[T]`` or ``[batch, T]`` (integers) -> ``(cos, sin)``, each float32
#: ``[batch or 1, T, rot_dim]``: one layer's rotation (a :class:`LayerRope` is one).
RopeFn = Callable[[Any], Tuple[torch.Tensor, torch.Tensor]]

#: The positions :func:`check_rope` probes a rotation with.
_PROBE = torch.arange(2)[None]

__all__ = ["STYLES", "FnRope", "LayerRope", "ModelRope", "RopeFn", "apply_rope", "check_rope",
           "layer_rope", "layer_ropes", "rope_for", "rope_of_layer", "rope_transpose", "rotate_half",
           "rotate_interleaved", "unapply_rope"]


def rope_of_layer(rope: Any, layer: int) -> Optional[LayerRope]:
    """:func:`layer_rope`, with InvalidParameterError naming ``rope`` for a :class:`ModelRope`
    that has no entry for ``layer`` (one of a model with fewer layers)."""
    if isinstance(rope, ModelRope) and not 0 <= layer < len(rope):
        raise InvalidParameterError(f"rope holds the rotation of {len(rope)} layers, but the cache has a "
                                    f"layer {layer}: give the rope of this model (rope_for(model))")
    return layer_rope(rope, layer)


def check_rope(rope: Any, num_layers: Optional[int], head_dims: Sequence[Optional[int]] = ()) -> None:
    """Checks, once, a ``rope`` the caller passed for a codec that codes keys without RoPE:
    a :class:`ModelRope` must have one entry per layer (``num_layers``, where known); each
    distinct rotation is called on two positions and must give float ``(cos, sin)`` of one shape
    ``[1, 2, rot_dim]``, ``rot_dim`` even and, where the model gives the layer's ``head_dims[i]``,
    at most that. InvalidParameterError naming ``rope`` otherwise (TypeError for a ``rope`` that
    is no rotation at all)."""
    if isinstance(rope, ModelRope) and num_layers is not None and len(rope) != num_layers:
        raise InvalidParameterError(f"rope holds the rotation of {len(rope)} layers, but the cache has "
                                    f"{num_layers}: give the rope of this model (rope_for(model))")
    if not isinstance(rope, ModelRope):  # one rotation for every layer: probed once
        r = layer_rope(rope, 0)
        if r is not None:
            dims = [d for d in head_dims if d is not None]
            _probe(r, head_dims.index(min(dims)) if dims else 0, min(dims) if dims else None, 0)
        return
    rots: Dict[int, int] = {}  # one probe per distinct rotation
    for i, r in enumerate(rope.layers):
        if r is not None:
            rots[id(r)] = _probe(r, i, head_dims[i] if i < len(head_dims) else None, rots.get(id(r), 0))


def _probe(r: LayerRope, layer: int, head_dim: Optional[int], seen: int) -> int:
    """The rotary dim of ``r`` (probed once; ``seen``: the one found before, else 0), checked
    against ``head_dim``."""
    rot = seen
    if not rot:
        try:
            out = r(_PROBE)
        except Exception as e:
            raise InvalidParameterError(f"rope (layer {layer}: {r!r}) failed on positions {_PROBE.tolist()}: "
                                        f"{type(e).__name__}: {e}") from e
        ok = (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
              and out[0].shape == out[1].shape and out[0].ndim == 3 and tuple(out[0].shape[:2]) == (1, 2)
              and out[0].dtype.is_floating_point and out[1].dtype.is_floating_point)
        rot = out[0].shape[-1] if ok else 0
        if not ok or rot < 2 or rot % 2:
            got = tuple((type(t).__name__, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                        for t in (out if isinstance(out, tuple) else (out,)))
            raise InvalidParameterError(
                f"rope (layer {layer}: {r!r}) must give float (cos, sin) of one shape [1, T, rot_dim] (rot_dim "
                f"even) for positions [1, T], got {got} for positions {_PROBE.tolist()}")
    if head_dim is not None and rot > head_dim:
        raise InvalidParameterError(f"rope rotates {rot} channels, but layer {layer} of the model has "
                                    f"head_dim {head_dim}: give the rope of this model (rope_for(model))")
    return rot
