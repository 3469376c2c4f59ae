"""Decode attention over the codes on a GPU: :func:`decode_attention_triton`, two launches
(``split.py``: partial softmaxes per (batch row, kv-head) pair and piece of positions;
``combine.py``: their combination and the synthesis of the value sum), the Triton version of
:func:`kakeyaturbo.decode_attention` (the Rust kernel is its oracle)."""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import numpy as np
import torch

from ...codec import _checks
from ...codec.attention import RopeTable, sink_logits_array, with_sink_logits
from ...codec.calibrated import SYNTHESES
from ...errors import InvalidInputError
from .batch import LayerBatch, RopeBatch, raw_rows, stack_rope
from .combine import combine_attention
from .split import split_attention


def decode_attention_triton(layer: LayerBatch, q: torch.Tensor, tail_k: Any, tail_v: Any, *,
                            sink_k: Any = None, sink_v: Any = None, scale: Optional[float] = None,
                            softcap: Optional[float] = None, window: Optional[int] = None,
                            mask: Any = None, rope: Union[None, RopeTable, RopeBatch] = None,
                            positions: Any = None, synthesis: str = "bf16", sink_logits: Any = None
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """One attention step over a layer's sealed codes (:func:`~.batch.stack_layer`) and raw
    rows, on the layer's device; the arguments and rules of :func:`kakeyaturbo.decode_attention`:

    - ``q``: float32 ``[B, H_q, n_q, D_k]`` (in the keys' coding domain);
    - ``tail_k`` / ``tail_v``: ``[B, H_kv, R, D_k]`` / ``[.., D_v]`` (the last ``n_q`` rows the
      queries' own), ``sink_k`` / ``sink_v``: ``[B, H_kv, S, D]`` or None (tensors or arrays,
      moved to the device as float32);
    - ``scale`` (default ``1 / sqrt(D_k)``), ``softcap``, ``window`` (the last ``window``
      positions), ``mask``: additive float32 or boolean (True: attend) ``[B, n_q, T]`` or
      ``[B, 1, n_q, T]``;
    - ``rope`` and ``positions`` (both or neither): the keys were coded before RoPE.
      ``rope``: a :class:`kakeyaturbo.RopeTable` (copied to the device on every call) or the
      :class:`~.batch.RopeBatch` of :func:`~.batch.stack_rope` (staged once); its rotary
      dimension at most ``D_k``. ``positions``: integers ``[B, T_c]`` (tensor or array), each
      sealed row's position, a row of the table (``0 <= p < n_pos``; checked unless a tensor
      on a GPU, which is trusted: checking it would read the device). Each sealed key is
      synthesised, rotated to its position and dotted with the queries inside the kernel;
      ``q`` and the raw rows are after RoPE, as the model hands them over. ``synthesis``:
      ``"bf16"`` (the default, as the Rust kernel's) multiplies ``M`` and the centroids rounded
      to bfloat16, ``"f32"`` the decoded keys' float32 factors, ``"i16"`` the Rust kernel's
      16-bit fixed-point factors (summed in float32 here, exactly in integers there).
    - ``sink_logits``: ``[H_q]`` or None, learnt sinks (GPT-OSS), applied to the result as
      :func:`kakeyaturbo.codec.attention.with_sink_logits` does (checked as
      :func:`kakeyaturbo.decode_attention` checks them; a tensor on a GPU only for its shape and
      dtype, so that no value is read back).

    Returns ``(out float32 [B, H_q, n_q, D_v], lse float32 [B, H_q, n_q])`` (0 and ``-inf``
    for a query that sees nothing). Raises ValueError on shapes, dtypes or devices that do not
    fit, or a bad scale, softcap, window, rotary table or position; as
    :func:`kakeyaturbo.decode_attention` does, InvalidInputError for no query heads or tokens,
    a non-finite value in ``q`` or the raw rows, or a mask value that is NaN or ``+inf`` (in
    host memory: on a GPU the values are trusted, as the positions are, since checking them would
    read the device at every step), and TypeError for a window that is not an int, a scale or
    softcap that is not a number, or a mask that is neither floating point nor boolean."""
    dev = layer.device
    b, hkv = layer.batch, layer.kv_heads
    dk, dv = layer.k.cal.dim, layer.v.cal.dim
    if (sink_k is None) != (sink_v is None):
        raise InvalidInputError("pass both sink_k and sink_v, or neither")
    rk, s = raw_rows(sink_k, tail_k, b, hkv, dk, dev)
    rv, sv = raw_rows(sink_v, tail_v, b, hkv, dv, dev)
    if rk.shape[1] != rv.shape[1] or s != sv:
        raise InvalidInputError("keys and values must have the same raw rows")
    if not isinstance(q, torch.Tensor):
        q = torch.from_numpy(np.asarray(q))
    q = q.to(dev).contiguous()
    nq = q.shape[2] if q.ndim == 4 else 0
    if q.ndim == 4 and (q.shape[1] == 0 or q.shape[1] % hkv):
        raise InvalidInputError(f"query heads ({q.shape[1]}) must be a positive multiple of the kv-heads ({hkv})")
    if q.ndim == 4 and nq == 0:
        raise InvalidInputError("n_q must be >= 1")
    for name, t in (("q", q), ("sink keys", rk[:, :s]), ("sink values", rv[:, :s]),
                    ("tail keys", rk[:, s:]), ("tail values", rv[:, s:])):
        _check_finite(name, t)
    scale = 1.0 / math.sqrt(dk) if scale is None else _checks.real(scale, "scale")
    softcap = None if softcap is None else _checks.real(softcap, "softcap", positive=True)
    window = None if window is None else _checks.integer(window, "window", 1, 2**32 - 1)  # as the Rust kernel
    m = None
    if mask is not None:
        m = mask if isinstance(mask, torch.Tensor) else torch.from_numpy(np.asarray(mask))
        if m.ndim == 4:
            if m.shape[1] != 1:
                raise InvalidInputError(f"a 4-D mask must be [B, 1, n_q, T], got {tuple(m.shape)}")
            m = m[:, 0]
        if m.dtype == torch.bool:
            m = torch.where(m, 0.0, float("-inf"))
        elif not m.dtype.is_floating_point:
            raise TypeError(f"mask must be float32 (additive) or bool, got {m.dtype}")
        m = m.to(device=dev, dtype=torch.float32).contiguous()
        bad = torch.isnan(m) | (m == float("inf")) if m.device.type == "cpu" else None
        if bad is not None and bool(bad.any()):
            i = int(torch.nonzero(bad.reshape(-1))[0, 0])
            raise InvalidInputError(f"mask values must be finite or -inf; flat index {i} is "
                                    f"{'NaN' if math.isnan(float(m.reshape(-1)[i])) else 'inf'}")
    if synthesis not in SYNTHESES:
        raise InvalidInputError(f"synthesis must be one of {', '.join(map(repr, SYNTHESES))}, got {synthesis!r}")
    sinks = None
    if isinstance(sink_logits, torch.Tensor) and sink_logits.device.type != "cpu":
        # On a GPU, trusted as the positions are: shape and dtype checked, values not read.
        if tuple(sink_logits.shape) != (q.shape[1],) or not sink_logits.dtype.is_floating_point:
            raise InvalidInputError(f"sink_logits must be floating point [H_q={q.shape[1]}], got "
                                    f"{sink_logits.dtype} {tuple(sink_logits.shape)}")
        sinks = sink_logits.detach().to(dev, torch.float32)
    elif sink_logits is not None:
        sinks = torch.from_numpy(sink_logits_array(sink_logits, q.shape[1])).to(dev)
    rb, pos = _rope(layer, rope, positions)
    pm, pl, pacc, ncode = split_attention(layer, q, rk, rv, s, m, scale, softcap, window, rb, pos,
                                          synthesis)
    out, lse = combine_attention(layer, pm, pl, pacc, ncode, q.shape[1], nq)
    return (out, lse) if sinks is None else with_sink_logits(out, lse, sinks)


def _check_finite(name: str, t: torch.Tensor) -> None:
    """InvalidInputError naming the first non-finite value of ``t`` (flat index, as Rust); a
    tensor on a GPU is not read."""
    if t.device.type != "cpu":
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise InvalidInputError(f"{name} holds a non-finite value at flat index "
                                f"{int(torch.nonzero(bad.reshape(-1))[0, 0])}")


def _rope(layer: LayerBatch, rope: Any, positions: Any
          ) -> Tuple[Optional[RopeBatch], Optional[torch.Tensor]]:
    """The rotary table on the layer's device and the positions as int32 ``[B, T_c]`` there,
    checked as :func:`kakeyaturbo.decode_attention` checks them (None, None without RoPE).
    Raises ValueError for one without the other, a table that is neither a ``RopeTable`` nor
    a ``RopeBatch`` (or on another device), a rotary dimension over ``D_k``, positions that
    are not integers ``[B, T_c]`` or (host positions) lie outside the table."""
    if (rope is None) != (positions is None):
        raise InvalidInputError("pass both rope and positions, or neither")
    if rope is None:
        return None, None
    dev = layer.device
    if isinstance(rope, RopeTable):
        rope = stack_rope(rope, dev)
    elif not isinstance(rope, RopeBatch):
        raise InvalidInputError(f"rope must be a kakeyaturbo.RopeTable or a RopeBatch, got {type(rope).__name__}")
    elif rope.device != dev:
        raise InvalidInputError(f"rope is on {rope.device}, expected {dev}")
    dk, b, tc = layer.k.cal.dim, layer.batch, layer.k.rows
    if rope.rot_dim > dk:
        raise InvalidInputError(f"the rotary dimension {rope.rot_dim} exceeds D_k = {dk}")
    if isinstance(positions, torch.Tensor):
        p = positions
        integer = not (p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool)
    else:
        a = np.asarray(positions)
        integer = a.dtype.kind in "iu"
        p = torch.from_numpy(a.astype(np.int64)) if integer else a
    if not integer:
        raise InvalidInputError(f"positions must be integers, got {p.dtype}")
    if p.ndim != 2 or tuple(p.shape) != (b, tc):
        raise InvalidInputError(f"positions must be [B={b}, T_c={tc}], got shape {tuple(p.shape)}")
    # Host positions are range-checked; a tensor on a GPU is trusted (checking it would read
    # the device on every decode step), as _common.rows_tensor trusts one.
    if p.numel() and not (isinstance(p, torch.Tensor) and p.device.type != "cpu"):
        lo, hi = int(p.min()), int(p.max())
        if lo < 0 or hi >= rope.n_positions:
            raise InvalidInputError(f"positions must lie in [0, {rope.n_positions}) (the table's rows), "
                             f"got {lo} .. {hi}")
    return rope, p.to(device=dev, dtype=torch.int32).contiguous()
