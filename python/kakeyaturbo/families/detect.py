"""Finding a rotary module's :class:`~kakeyaturbo.families.rope.LayerRope`: the pairing, table
form and order (and turning direction) under which :func:`~kakeyaturbo.families.rope.apply_rope`
reproduces a family's ``apply_rotary_pos_emb`` bit for bit on random rows, probed at scattered
positions (:func:`probe_positions`); Llama 4's complex rotations (:func:`detect_complex_rope`)."""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch

from .rope import ORDERS, STYLES, TABLES, LayerRope, apply_rope, tabulated_rows


def _rotated_key(apply_fn: Any, x: torch.Tensor, cos: Any, sin: Any) -> Optional[torch.Tensor]:
    """``x`` rotated by a modeling module's ``apply_rotary_pos_emb``, handed the module's two
    tables in its order: ``(q, k, cos, sin) -> (q, k)`` as most families write it, or ``(x, cos,
    sin) -> x`` (Gemma 4 rotates queries and keys by separate calls), also on rows ``[batch, T,
    heads, D]`` (GPT-J's ``(x, sin, cos)``); None when it takes none of them."""
    for args, back in (((x, x.clone(), cos, sin), False), ((x, cos, sin), False),
                       ((x.transpose(1, 2), cos, sin), True)):
        try:
            with torch.no_grad():
                out = apply_fn(*args)
        except Exception:
            continue
        if len(args) == 4 and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
            return out[1]
        if len(args) == 3 and isinstance(out, torch.Tensor):
            return out.transpose(1, 2) if back else out
    return None


def probe_positions(rope: LayerRope) -> torch.Tensor:
    """Scattered positions ``[1, 6]`` to probe ``rope`` at, within the rows of a tabulated
    rotary (GPT-J, CodeGen) and below a dynamic rope type's limit."""
    pos = torch.tensor([[0, 1, 5, 77, 1000, 3]])
    for limit in (tabulated_rows(rope.module), rope.static_until):
        if limit is not None:
            pos = pos % limit
    return pos


def detect_rope(apply_fn: Any, module: Any, layer_type: Optional[str], head_dim: int) -> Optional[LayerRope]:
    """The :class:`LayerRope` of ``module`` (and ``layer_type``) under which :func:`apply_rope`
    reproduces ``apply_fn(q, k, cos, sin)`` or ``apply_fn(k, cos, sin)`` (a modeling module's
    ``apply_rotary_pos_emb``, handed the module's own cos/sin) bit for bit on random rows, or None when no pairing does (or the
    function does not take those arguments).

    Rows of the full ``head_dim`` are tried first (the function splits off the rotated channels
    itself: Phi-3, GPT-NeoX); then, for a partial rotary, rows of the rotated width only (the
    attention splits them off before calling it: Phi, StableLM, always the first ``rot_dim``
    channels). The table forms are tried in the order of :data:`TABLES`, then the orders of
    :data:`ORDERS`, each turning either way (``reverse``)."""
    pos = probe_positions(LayerRope(module, layer_type, "half"))
    raw = LayerRope(module, layer_type, "half").module_tables(pos)  # as the module returns them
    for order, table, style, reverse in itertools.product(ORDERS, TABLES, STYLES, (False, True)):
        rope = LayerRope(module, layer_type, style, table, order, reverse)
        cos, sin = rope(pos)
        widths = [head_dim] + ([cos.shape[-1]] if cos.shape[-1] < head_dim else [])
        for width in widths:
            if cos.shape[-1] > width:
                continue
            x = torch.randn(1, 2, pos.shape[1], width, generator=torch.Generator().manual_seed(0))
            x = x.to(cos.device)
            out = _rotated_key(apply_fn, x, *raw)
            if out is None:  # a different signature or convention: not one we can reproduce
                continue
            mine = apply_rope(x, cos[:, None], sin[:, None], style=style)
            if mine.shape == out.shape and torch.equal(mine, out):
                return rope
    return None


def detect_complex_rope(apply_fn: Any, module: Any, layer_type: Optional[str],
                        head_dim: int) -> Optional[LayerRope]:
    """The :class:`LayerRope` of a rotary module that gives complex rotations (Llama 4's
    ``freqs_cis``, ``cos + i sin`` per frequency) applied by ``apply_fn(xq, xk, freqs_cis)`` to
    rows ``[batch, T, heads, D]`` as complex products of the channel pairs ``(2i, 2i + 1)``: the
    interleaved pairing of a table per frequency, when it reproduces ``apply_fn``'s keys bit for bit
    on random rows; else None."""
    rope = LayerRope(module, layer_type, "interleaved", "frequency")
    pos = probe_positions(rope).to(rope.device)
    kw = {} if layer_type is None else {"layer_type": layer_type}
    x = torch.randn(1, pos.shape[1], 2, head_dim, generator=torch.Generator().manual_seed(0)).to(rope.device)
    try:
        with torch.no_grad():
            freqs = module(torch.empty(0, device=rope.device), pos, **kw)
            if not (isinstance(freqs, torch.Tensor) and freqs.is_complex()):
                return None
            _, want = apply_fn(x, x, freqs)
            got = rope.apply(x.transpose(1, 2), pos).transpose(1, 2)
    except (RuntimeError, ValueError, TypeError):
        return None
    return rope if got.shape == want.shape and torch.equal(got, want) else None
