"""Rotary position embedding (RoPE) as transformers' decoder families apply it: the rotation,
its exact inverse and its transpose, and the rotation of one layer of a loaded model.

transformers applies RoPE as ``x * cos + rot(x) * sin`` to the first ``rot_dim`` channels of a
head (all of them unless the rotary is partial: Phi-3, GPT-NeoX), with ``cos``/``sin`` of shape
``[batch, T, rot_dim]`` from the model's rotary module, already scaled by the rope type's
``attention_scaling``. ``rot`` turns every pair of channels by 90 degrees; the families differ in
which channels pair up:

- ``"half"`` (Llama, Mistral, Qwen, Gemma, Phi-3, OLMo 2, GPT-NeoX, ...): channel ``i`` with
  ``i + rot_dim/2``, ``rot(x) = cat(-x2, x1)`` (``rotate_half``), cos/sin ``cat(f, f)``;
- ``"interleaved"`` (Cohere): channel ``2i`` with ``2i + 1``, cos/sin repeated per pair.

The rotary module's tables come in three forms (:data:`TABLES`), which :class:`LayerRope`
turns into the per-channel form above, so everything downstream sees one form:

- ``"channel"``: one entry per rotated channel, as above (most families);
- ``"frequency"``: one per frequency, ``[batch, T, rot_dim/2]``, and the family's
  ``apply_rotary_pos_emb`` pairs the halves itself (GPT-OSS);
- ``"halved"``: ``cat(f, f)``, of which the family's ``apply_rotary_pos_emb`` takes the first
  half and repeats each entry for an interleaved pair (GLM, GLM-4, ERNIE 4.5, Helium).

A module may hand its tables over as ``(sin, cos)`` (GPT-J, CodeGen: per frequency, for
interleaved pairs, applied by ``apply_rotary_pos_emb(x, sin, cos)`` to rows ``[batch, T, heads,
D]``): :class:`LayerRope`'s ``order`` says so, and it hands them on as ``(cos, sin)``.

Both channels of a pair share one angle, so per pair the map is ``s * R(theta)`` (``s`` the
scaling) and ``(x * cos - rot(x) * sin) / (cos**2 + sin**2)`` inverts it exactly; without the
division it is the transpose ``s * R(theta)^T``, which carries a gradient taken after RoPE back
to the rows before it.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import _core
from ..errors import UnsupportedModelError

#: The pairings of channels that :func:`apply_rope` knows (see the module docstring).
STYLES = ("half", "interleaved")
#: The forms of a rotary module's cos/sin tables that :class:`LayerRope` reads (the docstring).
TABLES = ("channel", "frequency", "halved")
#: The orders in which a rotary module returns its two tables (the docstring).
ORDERS = ("cos_sin", "sin_cos")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` along the last axis, ``x1``/``x2`` its two halves (the ``"half"`` pairing)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """``(-x1, x0, -x3, x2, ...)`` along the last axis (the ``"interleaved"`` pairing)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotate(x: torch.Tensor, style: str) -> torch.Tensor:
    if style == "half":
        return rotate_half(x)
    if style == "interleaved":
        return rotate_interleaved(x)
    raise ValueError(f"RoPE style must be one of {STYLES}, got {style!r}")


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rot = cos.shape[-1]
    if rot % 2 or rot > x.shape[-1]:
        raise ValueError(f"rotary dim {rot} must be even and <= head_dim {x.shape[-1]}")
    return rot


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "half") -> torch.Tensor:
    """RoPE as the model's attention applies it: ``x * cos + rot(x) * sin`` on the first
    ``rot_dim`` channels; the rest pass through (partial rotary).

    ``x``: ``[..., T, D]``; ``cos``/``sin``: ``[..., T, rot_dim]``, broadcastable against ``x``
    (for ``x`` of shape ``[batch, heads, T, D]`` pass ``cos[:, None]``). The arithmetic follows
    torch's type promotion of ``x`` and ``cos``; with both float32 the result is bit-identical to
    what the model computes (checked per family in ``tests/cache/test_families.py``).
    """
    rot = _check(x, cos, sin)
    if rot == x.shape[-1]:
        return (x * cos) + (_rotate(x, style) * sin)
    xr = x[..., :rot]
    out = (xr * cos) + (_rotate(xr, style) * sin)
    return torch.cat((out, x[..., rot:].to(out.dtype)), dim=-1)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "half") -> torch.Tensor:
    """:func:`apply_rope` in place on ``x`` (returned), bit for bit its result, without its
    temporaries of ``x``'s size but one: for a tensor the caller owns (the cache's decoded
    keys). Where ``x``'s dtype is not the promoted one of ``x`` and ``cos``, :func:`apply_rope`'s
    new tensor instead."""
    rot = _check(x, cos, sin)
    if torch.promote_types(x.dtype, cos.dtype) != x.dtype or torch.promote_types(x.dtype, sin.dtype) != x.dtype:
        return apply_rope(x, cos, sin, style)
    xr = x[..., :rot]
    turned = _rotate(xr, style).mul_(sin)
    xr.mul_(cos).add_(turned)
    return x


def over_heads(cos: torch.Tensor, sin: torch.Tensor, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[batch, T, rot]`` (as a rotary module gives them) on the device of
    ``like`` ``[batch, heads, T, D]``, shaped to broadcast over its heads."""
    return cos.to(like.device)[:, None], sin.to(like.device)[:, None]


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "half") -> torch.Tensor:
    """The inverse of :func:`apply_rope`: ``x * c' - rot(x) * s'`` with ``c' = cos / (cos**2 +
    sin**2)`` and ``s'`` alike (the division makes it exact for rope types that scale cos and sin,
    and absorbs the rounding of float32 cos/sin whose squares do not sum to exactly 1).

    Same shapes as :func:`apply_rope`; returned in the promoted dtype of ``x`` and ``cos``. ``c'``
    and ``s'`` are computed in float64 (over ``cos``'s shape, which broadcasts over heads), then
    the rows in that dtype (at least float32): a float32 result lies within a few units in the
    last place of the exact inverse. (The cache seals keys on the CPU through :meth:`LayerRope.remove_rows`, the
    same arithmetic in one pass of the Rust core.)
    """
    rot = _check(x, cos, sin)
    out_dtype = torch.promote_types(x.dtype, cos.dtype)
    work = torch.promote_types(out_dtype, torch.float32)  # (16-bit tables: rounded once, at the end)
    c, s = cos.double(), sin.double()
    norm = c * c + s * s
    c, s = (c / norm).to(work), (s / norm).to(work)
    xr = x[..., :rot].to(work)
    y = (xr * c) - (_rotate(xr, style) * s)
    if rot < x.shape[-1]:
        y = torch.cat((y, x[..., rot:].to(work)), dim=-1)
    return y.to(out_dtype)


def kernel_rows(x: torch.Tensor) -> np.ndarray:
    """``x`` as the Rust core reads rows: a bfloat16 tensor on the CPU as its bits (``uint16``, its
    own memory where contiguous, widened exactly there), anything else as a float32 C-contiguous
    host array (its own memory where it is one already)."""
    x = x.detach()
    if x.dtype is torch.bfloat16 and x.is_cpu:
        return x.contiguous().view(torch.int16).numpy().view(np.uint16)
    if x.dtype is torch.float32 and x.is_cpu and x.is_contiguous():
        return x.numpy()
    return x.to("cpu", torch.float32).contiguous().numpy()


def unscale_keys(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` divided channel by channel by ``w [D]`` (0 where ``w`` is 0: a norm with a
    zero weight leaves that channel 0, and putting ``w`` back gives it again), in the promoted
    dtype of ``x`` and float32: a new tensor."""
    w = w.to(device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))
    return torch.where(w != 0, x / torch.where(w != 0, w, torch.ones_like(w)), torch.zeros_like(w))


def rope_transpose(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "half") -> torch.Tensor:
    """The transpose of :func:`apply_rope` as a linear map, ``g * cos - rot(g) * sin`` (the
    channels past ``rot_dim`` pass through): a gradient with respect to the rows after RoPE,
    carried back to the rows before it. Computed in float64, returned in ``g``'s dtype."""
    rot = _check(g, cos, sin)
    c, s = cos.double(), sin.double()
    gr = g[..., :rot].double()
    y = (gr * c) - (_rotate(gr, style) * s)
    if rot < g.shape[-1]:
        y = torch.cat((y, g[..., rot:].double()), dim=-1)
    return y.to(g.dtype)


def past_static_limit(what: str, limit: int) -> UnsupportedModelError:
    """The error for ``what`` (positions, a forward call, windows) reaching a dynamic rope type's
    limit (:attr:`LayerRope.static_until`)."""
    return UnsupportedModelError(
        f"{what}: the model's dynamic rope type recomputes its frequencies past max_position_embeddings ({limit}) "
        "from each forward call's longest position, so keys there have no RoPE-free form; code them as the cache "
        "holds them ([k] rope = 'after', statistics collected with rope='after')")


@contextlib.contextmanager
def _original_state(module: Any, layer_type: Optional[str]) -> Iterator[None]:
    """A dynamic rope type's ``module`` with its original frequencies for the block (a call of
    the model's past its limit leaves them grown, and a later one as long as the limit keeps
    them), then its own buffers and ``*max_seq_len_cached`` attributes put back: the cache's
    calls give the rotation below the limit and leave the model's module as they found it.
    Nothing for None."""
    if module is None:
        yield
        return
    buffers = dict(module._buffers)
    lengths = {k: v for k, v in vars(module).items() if k.endswith("max_seq_len_cached")}
    prefix = "" if layer_type is None else f"{layer_type}_"
    original = getattr(module, f"{prefix}original_inv_freq", None)
    try:
        if isinstance(original, torch.Tensor) and f"{prefix}inv_freq" in buffers:
            module._buffers[f"{prefix}inv_freq"] = original.clone()
            setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)
        yield
    finally:
        module._buffers.update(buffers)
        for k, v in lengths.items():
            setattr(module, k, v)


class LayerRope:
    """The RoPE of one attention layer of a loaded model.

    ``module``: the model's rotary module; ``layer_type``: passed to it when it serves several
    layer types (Gemma 3: a local and a global base frequency), else None; ``style``: the
    pairing (:data:`STYLES`), found by :func:`kakeyaturbo.families.describe`;
    ``table``: the form of the module's tables (:data:`TABLES`), turned here into one entry per
    channel; ``order``: the order the module returns them in (:data:`ORDERS`); ``reverse``: the
    family turns each pair the other way, by ``-theta`` (NanoChat's ``rotate_half`` is
    ``cat(x2, -x1)``): the sin is negated.

    Calling it with integer positions ``[T]`` or ``[batch, T]`` (or the ``[3, batch, T]`` of a
    multimodal rotary module: temporal, height, width) gives float32 ``cos``/``sin``
    ``[batch or 1, T, rot_dim]``: exactly what the module gives a float32 model (in the
    per-channel form), so that :meth:`apply` reproduces the model's cached keys bit for bit.

    ``key_norm`` (:meth:`with_key_norm`; None otherwise): the layer's RMS norm of the keys after
    RoPE (HunYuan's ``key_layernorm``), ``w * normalise(R k)`` (``w = 1`` for NanoChat's).
    Normalising commutes with the rotation, so the cached keys are ``w * R k'``, ``k'`` the
    normalised keys before RoPE: :meth:`apply` multiplies by ``w`` after rotating,
    :meth:`remove` divides by it first (:func:`unscale_keys`), :meth:`transpose` multiplies a
    gradient by it first. The rotation's tables and :meth:`same_as` do not depend on it.
    """

    key_norm: Any = None

    def __init__(self, module: Any, layer_type: Optional[str], style: str, table: str = "channel",
                 order: str = "cos_sin", reverse: bool = False) -> None:
        if style not in STYLES:
            raise ValueError(f"RoPE style must be one of {STYLES}, got {style!r}")
        if table not in TABLES:
            raise ValueError(f"RoPE table form must be one of {TABLES}, got {table!r}")
        if order not in ORDERS:
            raise ValueError(f"RoPE table order must be one of {ORDERS}, got {order!r}")
        self.module = module
        self.layer_type = layer_type
        self.style = style
        self.table = table
        self.order = order
        self.reverse = reverse
        inv = getattr(module, "inv_freq", None)
        if layer_type is not None:
            inv = getattr(module, f"{layer_type}_inv_freq", inv)
        self.device = inv.device if isinstance(inv, torch.Tensor) else torch.device("cpu")

    def __repr__(self) -> str:
        lt = f", layer_type={self.layer_type!r}" if self.layer_type is not None else ""
        tf = f", table={self.table!r}" if self.table != "channel" else ""
        tf += f", order={self.order!r}" if self.order != "cos_sin" else ""
        tf += ", reverse=True" if self.reverse else ""
        tf += ", key_norm" if self.key_norm is not None else ""
        return f"LayerRope({type(self.module).__name__}{lt}, style={self.style!r}{tf})"

    @property
    def multimodal(self) -> bool:
        """Whether the module rotates by three positions per token (``mrope_section`` of three:
        Qwen2-VL and its successors), so takes ``[3, batch, T]``, turning both channels of each
        pair by one angle however the positions differ: a rotation the cache can take off
        (probed once). HunYuan-VL's sections split pairs between positions (an image token's map
        is then no rotation), and may be four: it is rotated by one position per token."""
        found = self.__dict__.get("_multimodal")
        if found is None:
            found = self.__dict__["_multimodal"] = self._three_sections() and self._pairs_kept()
        return found

    def _three_sections(self) -> bool:
        sections = getattr(self.module, "mrope_section", None)
        return sections is not None and len(sections) == 3

    def _pairs_kept(self) -> bool:
        try:
            cos, sin = self(torch.tensor([5, 9, 13]).view(3, 1, 1))
        except (RuntimeError, ValueError, TypeError):  # a module that takes no three positions per token
            return False
        h = cos.shape[-1] // 2
        if self.style == "half":
            return all(torch.equal(t[..., :h], t[..., h:]) for t in (cos, sin))
        return all(torch.equal(t[..., 0::2], t[..., 1::2]) for t in (cos, sin))

    def same_as(self, other: "Optional[LayerRope]") -> bool:
        """Whether ``other`` rotates exactly as this one does."""
        return (isinstance(other, LayerRope) and other.module is self.module
                and other.layer_type == self.layer_type and other.style == self.style
                and other.table == self.table and other.order == self.order and other.reverse == self.reverse)

    @property
    def long_after(self) -> Optional[int]:
        """``original_max_position_embeddings`` where the module is ``longrope`` (Phi-3.5,
        Phi-4-mini): a forward call whose largest position is at least this many rotates every
        token it computes by the long factors, any other call by the short ones. None for other
        rope types."""
        kind = getattr(self.module, "rope_type", None)
        params = getattr(getattr(self.module, "config", None), "rope_parameters", None) or {}
        if isinstance(kind, dict):
            kind = kind.get(self.layer_type)
            params = params.get(self.layer_type) or {}
        n = params.get("original_max_position_embeddings") if kind == "longrope" else None
        return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    @property
    def static_until(self) -> Optional[int]:
        """``max_position_embeddings`` (the module's ``original_max_seq_len``) where the module is
        a ``dynamic`` rope type (dynamic NTK scaling): below it every call rotates by the original
        frequencies; a call reaching past it recomputes them from its longest position, so a
        cached key's rotation is then no function of its position alone. None for other rope
        types."""
        kind = getattr(self.module, "rope_type", None)
        if isinstance(kind, dict):
            kind = kind.get(self.layer_type)
        n = getattr(self.module, "original_max_seq_len", None)
        dynamic = isinstance(kind, str) and "dynamic" in kind
        return int(n) if dynamic and isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def __call__(self, positions: Any, long: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin at ``positions``; ``long`` (``longrope`` only: :attr:`long_after`) picks the
        factors, which the module otherwise picks by the largest position given."""
        cos, sin = self.module_tables(positions, long)
        if self.reverse:
            sin = -sin
        if self.table == "channel":
            return cos, sin
        if self.table == "halved":
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half], sin[..., :half]
        if self.style == "half":
            return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)

    def module_tables(self, positions: Any, long: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin as the rotary module gives them (not widened; as ``(cos, sin)``); ``long``
        as in :meth:`__call__`."""
        pos = torch.as_tensor(positions, device=self.device).long()
        if pos.ndim == 1:
            pos = pos[None]
        if pos.ndim != 2 and not (pos.ndim == 3 and pos.shape[0] == 3 and self._three_sections()):
            raise ValueError(f"positions must be [T], [batch, T] or (multimodal RoPE) [3, batch, T], "
                             f"got shape {tuple(pos.shape)} for {self!r}")
        limit, n = self.long_after if long is not None else None, pos.shape[-1]
        if limit is not None and pos.ndim == 2:
            # The module takes the factors by the largest position it is given: one more column
            # past the limit asks for the long ones; the short ones need every position below it.
            if long:
                pos = torch.cat([pos, torch.full_like(pos[:, :1], limit)], dim=-1)
            elif n and int(pos.max()) >= limit:
                raise ValueError(f"positions up to {int(pos.max())}: the short factors of {self!r} "
                                 f"rotate positions below {limit} only")
        static = self.static_until
        if static is not None and pos.numel() and int(pos.max()) >= static:
            raise past_static_limit(f"positions up to {int(pos.max())} for {self!r}", static)
        # The module reads only the dtype and device of its first argument.
        probe = torch.empty(0, dtype=torch.float32, device=self.device)
        kw = {} if self.layer_type is None else {"layer_type": self.layer_type}
        with torch.no_grad(), _original_state(self.module if static is not None else None, self.layer_type):
            out = self.module(probe, pos, **kw)
        # Llama 4's module gives the rotations as complex numbers (``freqs_cis``): cos + i sin.
        cos, sin = (out.real, out.imag) if isinstance(out, torch.Tensor) and out.is_complex() else out
        if pos.shape[-1] != n:
            cos, sin = cos[..., :n, :], sin[..., :n, :]
        return (sin, cos) if self.order == "sin_cos" else (cos, sin)

    def _cs(self, positions: Any, like: torch.Tensor, long: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        return over_heads(*self(positions, long), like)

    def with_key_norm(self, norm: Any) -> "LayerRope":
        """A copy of this rotation followed by ``norm`` (a module with a per-channel ``weight``
        whose output is ``weight * normalise(x)``, normalising commuting with the rotation:
        checked by :func:`kakeyaturbo.families.keynorm.key_norms`)."""
        out = copy.copy(self)
        out.key_norm = norm
        return out

    def key_scale(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The weight of :attr:`key_norm` ``[D]`` in ``like``'s device and its dtype promoted with
        float32 (read at each call: it follows the model to another device), or None (no norm, or
        one without a weight)."""
        w = getattr(self.key_norm, "weight", None)  # (NanoChat's norm has none)
        return None if w is None else w.detach().to(like.device, torch.promote_types(like.dtype, torch.float32))

    def turn(self, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, back: bool = False) -> torch.Tensor:
        """RoPE (and the key norm's weight) put on ``y`` with these cos/sin (broadcasting over
        it), in place where :func:`apply_rope_` can; or, ``back``, taken off (a new tensor)."""
        w = self.key_scale(y)
        if back:
            return unapply_rope(y if w is None else unscale_keys(y, w), cos, sin, style=self.style)
        y = apply_rope_(y, cos, sin, style=self.style)
        return y if w is None else y.mul_(w.to(y.dtype))

    def remove_rows(self, y: torch.Tensor, rows: int, cos: torch.Tensor, sin: torch.Tensor) -> np.ndarray:
        """The first ``rows`` rows of keys ``y [B, H, T, D]`` with RoPE (and the key norm's
        weight) taken off, as a float32 array ``[B, H, rows, D]`` for the encoder: ``cos``/``sin``
        ``[1 or B, rows, rot]`` as the rotary module gives them. Float32 or bfloat16 rows on the
        CPU go to the Rust core in one pass (``_core.unrope_keys``, within a few units in the last
        place of :func:`unapply_rope`); anything else through :meth:`turn`."""
        if (y.is_cpu and y.dtype in (torch.float32, torch.bfloat16) and cos.dtype is torch.float32
                and sin.dtype is torch.float32 and cos.is_cpu and sin.is_cpu and cos.ndim == 3
                and cos.shape[1] == rows):
            w = self.key_scale(y)
            x = kernel_rows(y if w is None else unscale_keys(y[..., :rows, :].detach(), w))  # (float32)
            c, s = (kernel_rows(t) for t in (cos, sin))
            return _core.unrope_keys(x, c, s, self.style, rows)
        out = self.turn(y[..., :rows, :], cos[:, None].to(y.device), sin[:, None].to(y.device), back=True)
        return out.detach().to("cpu", torch.float32).contiguous().numpy()

    def apply(self, x: torch.Tensor, positions: Any, long: Optional[bool] = None) -> torch.Tensor:
        """RoPE on ``x [batch, heads, T, D]`` at ``positions`` (``[T]`` or ``[batch, T]``);
        ``long`` as in :meth:`__call__`; then the key norm's weight, where there is one."""
        y = apply_rope(x, *self._cs(positions, x, long), style=self.style)
        w = self.key_scale(y)
        return y if w is None else y * w

    def remove(self, x: torch.Tensor, positions: Any, long: Optional[bool] = None) -> torch.Tensor:
        """The inverse of :meth:`apply` (float64 inside, ``x``'s dtype promoted with float32 out)."""
        return self.turn(x, *self._cs(positions, x, long), back=True)

    def remove_from_query(self, q: torch.Tensor, positions: Any, long: Optional[bool] = None) -> torch.Tensor:
        """A query after RoPE in the domain of the keys before it: RoPE taken off ``w * q`` (the
        key norm's weight, where there is one, moved onto the query, whose products with the keys
        before RoPE at its own position are then its scores)."""
        w = self.key_scale(q)
        return unapply_rope(q if w is None else q * w, *self._cs(positions, q, long), style=self.style)

    def transpose(self, g: torch.Tensor, positions: Any, long: Optional[bool] = None) -> torch.Tensor:
        """A gradient at the rows after RoPE (and the key norm's weight) carried back to the rows
        before it."""
        w = self.key_scale(g)
        return rope_transpose(g if w is None else (g * w).to(g.dtype), *self._cs(positions, g, long), style=self.style)

    def long_call(self, positions: Any) -> Optional[bool]:
        """Whether a forward call at ``positions`` (all of them) rotates by the long factors
        (``longrope``); None for other rope types."""
        limit = self.long_after
        return None if limit is None else int(torch.as_tensor(positions).max()) + 1 > limit


class FnRope(LayerRope):
    """A :class:`LayerRope` from a plain ``positions -> (cos, sin)`` callable (the form
    :func:`rope_for` returned before per-layer RoPE), with the ``"half"`` pairing unless told."""

    def __init__(self, fn: Any, style: str = "half") -> None:
        if style not in STYLES:
            raise ValueError(f"RoPE style must be one of {STYLES}, got {style!r}")
        self.module = fn
        self.layer_type = None
        self.style = style
        self.table = "channel"
        self.order = "cos_sin"
        self.reverse = False
        self.device = torch.device("cpu")

    def __repr__(self) -> str:
        return f"FnRope({self.module!r}, style={self.style!r})"

    def module_tables(self, positions: Any, long: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.module(positions)  # (a callable has no longrope factors to pick)
        return cos.float(), sin.float()


def layer_rope(rope: Any, layer: int) -> Optional[LayerRope]:
    """The rotation of ``layer`` from what callers pass as ``rope``: a :class:`ModelRope` (per
    layer; None for a layer without RoPE), one :class:`LayerRope` for every layer, a plain
    ``positions -> (cos, sin)`` callable (every layer, ``"half"`` pairing), or None."""
    if rope is None or isinstance(rope, LayerRope):
        return rope
    if isinstance(rope, ModelRope):
        return rope.layer(layer)
    if callable(rope):
        return FnRope(rope)
    raise TypeError(f"rope must be a ModelRope, a LayerRope or a positions -> (cos, sin) callable, "
                    f"got {type(rope).__name__}")


class ModelRope:
    """The RoPE of every layer of a model: ``layers[i]`` a :class:`LayerRope`, or None for a layer
    that applies none (SmolLM3's NoPE layers). Called with positions, it gives the cos/sin that
    every layer shares, and raises ValueError where layers differ (Gemma 3): use
    :meth:`layer` there."""

    def __init__(self, layers: Sequence[Optional[LayerRope]]) -> None:
        self.layers = tuple(layers)

    def __repr__(self) -> str:
        return f"ModelRope({list(self.layers)!r})"

    def __len__(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> Optional[LayerRope]:
        return self.layers[i]

    @property
    def uniform(self) -> bool:
        """Whether every layer applies the same rotation."""
        first = self.layers[0] if self.layers else None
        return first is not None and all(first.same_as(r) for r in self.layers[1:])

    def __call__(self, positions: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.uniform:
            raise ValueError("the layers of this model rotate differently (per-layer-type RoPE or NoPE "
                             "layers): take the cos/sin of one layer with .layer(i)")
        assert self.layers[0] is not None
        return self.layers[0](positions)


def tabulated_rows(module: Any) -> Optional[int]:
    """The positions a rotary module holds a table of (GPT-J's, CodeGen's ``max_positions``: it
    indexes that table by position), or None for a module that computes any position."""
    limit = getattr(module, "max_positions", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def layer_ropes(rope: Any) -> List[LayerRope]:
    """The :class:`LayerRope` of every layer of ``rope`` (a :class:`ModelRope`, one
    :class:`LayerRope`, or a plain callable: none)."""
    layers = rope.layers if isinstance(rope, ModelRope) else [rope]
    return [r for r in layers if isinstance(r, LayerRope)]
