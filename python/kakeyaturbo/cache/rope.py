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

from typing import Any, Callable, Tuple

import torch

from ..families.layout import rope_for
from ..families.rope import (STYLES, FnRope, LayerRope, ModelRope, apply_rope, layer_rope,
                             rope_transpose, rotate_half, rotate_interleaved, unapply_rope)

#: positions ``[T]`` or ``[batch, T]`` (integers) -> ``(cos, sin)``, each float32
#: ``[batch or 1, T, rot_dim]``: one layer's rotation (a :class:`LayerRope` is one).
RopeFn = Callable[[Any], Tuple[torch.Tensor, torch.Tensor]]

__all__ = ["STYLES", "FnRope", "LayerRope", "ModelRope", "RopeFn", "apply_rope", "layer_rope",
           "rope_for", "rope_transpose", "rotate_half", "rotate_interleaved", "unapply_rope"]
