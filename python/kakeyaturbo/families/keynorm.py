"""Keys normalised after RoPE by an RMS norm, with a learnt per-channel weight (HunYuan's
``key_layernorm``: ``w * normalise(R k)``) or without one (NanoChat's ``k_norm``: ``w = 1``).

An RMS norm divides a row by its root mean square, which a rotation keeps, so the cached keys
are ``w * R k'`` with ``k' = k / rms(k)``, the normalised keys before RoPE: taking ``w`` off and
then RoPE leaves keys without a position to code, and putting RoPE then ``w`` back gives the
cached keys again (:meth:`~kakeyaturbo.families.rope.LayerRope.with_key_norm`). Scores over
such keys are ``(w * q) . R k'``: attention over the codes scales the queries by ``w``.

:func:`key_norms` attaches each layer's norm to its :class:`~kakeyaturbo.families.rope.LayerRope`
for the families of :data:`KEY_NORM_AFTER_ROPE`, after checking on random rows that the norm
commutes with the layer's rotation as that algebra needs (a norm that subtracts the mean or adds
a bias does not)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .detect import probe_positions
from .rope import LayerRope, ModelRope, unscale_keys

#: Families whose attention normalises its keys after RoPE, by the attention module's attribute
#: holding the norm (queries are normalised too, which attention over the codes takes as given).
#: HunYuan-VL's image tokens are turned by a map that is no rotation, which the cache turns back
#: by each token's index (``LayerRope.multimodal``): exact, but their keys are not position-free.
KEY_NORM_AFTER_ROPE: Dict[str, str] = {
    "nanochat": "k_norm",
    "hunyuan_v1_dense": "key_layernorm",
    "hunyuan_v1_moe": "key_layernorm",
    "hunyuan_vl_text": "key_layernorm",
}


def _commutes(rope: Any, norm: Any, d: int) -> bool:
    """Whether ``norm`` after ``rope`` (a :class:`LayerRope`) equals ``w * R (norm(x) / w)`` on
    random rows at scattered positions, to float32 rounding."""
    w = getattr(norm, "weight", None)
    x = torch.randn(1, 2, 6, d, generator=torch.Generator().manual_seed(0)).to(rope.device)
    pos = probe_positions(rope)
    with torch.no_grad():
        want = norm(rope.apply(x, pos)).double()
        y = norm(x).float()
        got = rope.with_key_norm(norm).apply(y if w is None else unscale_keys(y, w.detach()), pos).double()
    if want.shape != got.shape or not bool(torch.isfinite(want).all()):
        return False
    return (want - got).abs().max().item() <= 1e-4 * max(want.abs().max().item(), 1e-30)


def key_norms(mt: str, rope: ModelRope, modules: Dict[int, Any],
              head_dims: Dict[int, int]) -> Tuple[Optional[ModelRope], Optional[str]]:
    """``rope`` with each rotating layer's key norm attached for a family of
    :data:`KEY_NORM_AFTER_ROPE` (``modules``, ``head_dims``: each layer index's attention module
    and head size), else ``rope`` itself; ``(None, why)`` when a layer's norm is missing, has a
    weight that is not one per channel, or does not commute with its rotation."""
    attr = KEY_NORM_AFTER_ROPE.get(mt)
    if attr is None:
        return rope, None
    layers: List[Optional[LayerRope]] = []
    for i, r in enumerate(rope.layers):
        if r is None:
            layers.append(None)
            continue
        norm = getattr(modules.get(i), attr, None)
        w = getattr(norm, "weight", None)
        if not callable(norm) or not (w is None or (isinstance(w, torch.Tensor) and w.shape == (head_dims[i],))):
            return None, (f"layer {i} has no {attr} with one weight per channel (or none) to take off its keys "
                          "after RoPE")
        if not _commutes(r, norm, head_dims[i]):
            return None, (f"layer {i}'s {attr} after RoPE does not commute with the rotation (not an RMS "
                          "norm with a per-channel weight), so its keys have no RoPE-free form")
        layers.append(r.with_key_norm(norm))
    return ModelRope(layers), None
