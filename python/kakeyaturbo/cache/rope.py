"""Rotary position embedding (RoPE) of Llama/Qwen2-style attention, its exact inverse, and the
cos/sin of a loaded model.

transformers applies RoPE as ``x * cos + rotate_half(x) * sin`` with ``cos``/``sin`` of shape
``[batch, T, rot_dim]`` (the frequencies repeated twice: ``cat(f, f)``) and
``rotate_half(x) = cat(-x2, x1)``. Per pair ``(i, i + rot_dim/2)`` that is a rotation by the
angle of the pair, scaled by the rope type's ``attention_scaling`` (1 for most types), so the
inverse is ``(x * cos - rotate_half(x) * sin) / (cos**2 + sin**2)``.

Keys in a transformers cache are stored after RoPE. A codec that wants the keys without it
(``pre_rope_keys``) gets them through :func:`unapply_rope` and hands back its decoded keys
through :func:`apply_rope`, with the cos/sin that :func:`rope_for` computes from the model's own
rotary module (so scaled variants such as ``linear``, ``llama3`` or ``yarn`` are respected).
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

#: positions ``[T]`` or ``[batch, T]`` (integers) -> ``(cos, sin)``, each float32
#: ``[batch or 1, T, rot_dim]``.
RopeFn = Callable[[Any], Tuple[torch.Tensor, torch.Tensor]]

#: Rope types whose frequencies depend on the longest position of each forward call, so that
#: the rotation a cached key received cannot be recomputed from its position alone.
_STATEFUL_ROPE_TYPES = ("dynamic", "longrope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` along the last axis, ``x1``/``x2`` its two halves (transformers' convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rot = cos.shape[-1]
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"rotary dim {rot} must be even and <= head_dim {x.shape[-1]}")
    return rot


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the model's attention applies it: ``x * cos + rotate_half(x) * sin``.

    ``x``: ``[..., T, D]``; ``cos``/``sin``: ``[..., T, rot_dim]``, broadcastable against ``x``
    (for ``x`` of shape ``[batch, heads, T, D]`` pass ``cos[:, None]``). When ``rot_dim < D``
    only the first ``rot_dim`` channels rotate (partial rotary); the rest pass through. The
    arithmetic follows torch's type promotion of ``x`` and ``cos``; with both float32 the result
    is bit-identical to what the model computes.
    """
    rot = _check(x, cos, sin)
    if rot == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    xr = x[..., :rot]
    out = (xr * cos) + (rotate_half(xr) * sin)
    return torch.cat((out, x[..., rot:].to(out.dtype)), dim=-1)


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The exact inverse of :func:`apply_rope`: ``(x * cos - rotate_half(x) * sin) / (cos**2 + sin**2)``.

    Same shapes as :func:`apply_rope`. Computed in float64 (the division makes it exact for
    rope types that scale cos and sin, and it absorbs the rounding of float32 cos/sin whose
    squares do not sum to exactly 1); returned in the promoted dtype of ``x`` and ``cos``.
    """
    rot = _check(x, cos, sin)
    out_dtype = torch.promote_types(x.dtype, cos.dtype)
    c, s = cos.double(), sin.double()
    xr = x[..., :rot].double()
    y = ((xr * c) - (rotate_half(xr) * s)) / (c * c + s * s)
    if rot < x.shape[-1]:
        y = torch.cat((y, x[..., rot:].double()), dim=-1)
    return y.to(out_dtype)


def _rotary_module(model: Any) -> Any:
    for owner in (getattr(model, "model", None), model):
        mod = getattr(owner, "rotary_emb", None) if owner is not None else None
        if mod is not None:
            return mod
    raise ValueError(
        f"{type(model).__name__} has no rotary embedding module at model.model.rotary_emb or "
        "model.rotary_emb (only Llama/Qwen2-style models with one rotary module are supported)"
    )


def rope_for(model: Any) -> RopeFn:
    """A callable ``positions -> (cos, sin)`` built from the model's own rotary module.

    ``positions``: integers ``[T]`` or ``[batch, T]`` (a tensor, array or list). Returns float32
    ``cos``/``sin`` of shape ``[batch or 1, T, rot_dim]`` on the module's device: exactly what
    ``model.model.rotary_emb(x, position_ids)`` gives a float32 model, so that
    :func:`apply_rope` with them reproduces the keys of the model's cache bit for bit.

    Raises ValueError when the model has no single rotary module, or when its rope type is
    ``dynamic`` or ``longrope``: their frequencies depend on the longest position of each
    forward call, so the rotation a cached key received cannot be recomputed from its position
    (and calling the module would change its state).
    """
    module = _rotary_module(model)
    rope_type = getattr(module, "rope_type", "default")
    if not isinstance(rope_type, str):
        raise ValueError(f"rotary module with per-layer-type rope types {rope_type!r} is not supported")
    if rope_type in _STATEFUL_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} recomputes its frequencies per forward call; the rotation of a "
            "cached key cannot be recomputed from its position"
        )
    inv_freq = getattr(module, "inv_freq", None)
    device = inv_freq.device if isinstance(inv_freq, torch.Tensor) else torch.device("cpu")
    # The module reads only the dtype and device of its first argument.
    probe = torch.empty(0, dtype=torch.float32, device=device)

    def rope(positions: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        pos = torch.as_tensor(positions, device=device).long()
        if pos.ndim == 1:
            pos = pos[None]
        if pos.ndim != 2:
            raise ValueError(f"positions must be [T] or [batch, T], got shape {tuple(pos.shape)}")
        with torch.no_grad():
            cos, sin = module(probe, pos)
        return cos, sin

    return rope
