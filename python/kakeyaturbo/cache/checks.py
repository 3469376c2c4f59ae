"""Checks of what a cache layer (:class:`~kakeyaturbo.cache.layer.KakeyaLayer`) is handed, made
before anything changes: a refused call leaves the layer as it was."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidInputError
from .codecs import STREAMS


def check_rows(layer: Any, key_states: Any, value_states: Any) -> None:
    """Refuses rows ``layer`` cannot hold (TypeError, InvalidInputError): not floating-point
    ``[B, H, q, D]`` tensors, K and V of another ``B``, ``H`` or ``q`` than each other or than
    the rows held, NaN or infinity (the codecs refuse them when they seal; checked on the CPU for
    every update, on another device only when this update seals a block, as sealing reads the
    rows back to the host anyway). Called for every layer at every decode step: each tensor's
    shape is read once."""
    ks = _shape(key_states, "key_states")
    vs = _shape(value_states, "value_states")
    if ks[:3] != vs[:3]:
        raise InvalidInputError(f"key_states {tuple(ks)} and value_states {tuple(vs)} must share B, H and q")
    q = ks[2]
    if not layer.is_initialized:
        sealing = q >= layer.block_size
    else:
        sealing = False
        for name, s in (("k", ks), ("v", vs)):
            held = layer._s[name].staging.shape
            if s[0] != held[0] or s[1] != held[1] or s[3] != held[3]:
                raise InvalidInputError(
                    f"layer {layer.index}: {name} rows of shape {tuple(s)} for a layer holding "
                    f"[B={held[0]}, H={held[1]}, D={held[3]}]")
            sealing = sealing or (held[2] + q >= layer.block_size and name in layer.streams)
    if sealing or key_states.is_cpu:
        rows = [key_states, value_states]
        if sealing and layer.is_initialized and not key_states.is_cpu:
            rows += [layer._s[name].staging for name in STREAMS]
        # One sum per tensor (a NaN or an infinity makes it non-finite; a decode step's rows
        # cost microseconds); only a sum that overflowed is looked at element-wise.
        if not math.isfinite(sum(float(x.sum()) for x in rows)) and \
                not all(bool(torch.isfinite(x).all()) for x in rows):
            raise InvalidInputError(f"layer {layer.index}: key or value rows hold NaN or infinite "
                                    "values; the cache is unchanged")


def _shape(x: Any, what: str) -> Any:
    """``x.shape``, once ``x`` is known to be a floating-point ``[B, H, q, D]`` tensor."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point torch tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    s = x.shape
    if len(s) != 4:
        raise InvalidInputError(f"{what} must be [B, H, q, D], got shape {tuple(s)}")
    return s


def batch_rows(idx: Any, batch: int, index: int) -> torch.Tensor:
    """``idx`` as the batch rows of layer ``index`` to keep: a non-empty 1-D integer tensor of
    rows in ``0 .. batch-1`` (TypeError, InvalidInputError)."""
    try:
        t = idx if isinstance(idx, torch.Tensor) else torch.as_tensor(idx)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"batch rows must be integers, got {type(idx).__name__} ({e})") from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"batch rows must be integers, got dtype {t.dtype}")
    if t.ndim != 1 or t.numel() == 0 or int(t.min()) < 0 or int(t.max()) >= batch:
        raise InvalidInputError(f"layer {index}: batch rows must be a non-empty 1-D list of rows in "
                                f"0..{batch - 1}, got {t.tolist() if t.numel() <= 16 else tuple(t.shape)}")
    return t


def selected_rows(indices: Any, batch: int, index: int) -> torch.Tensor:
    """``batch_select_indices``'s ``indices`` (anything that indexes ``batch`` rows: integers, a
    boolean mask, a slice of a tensor) as the rows of layer ``index`` to keep (InvalidInputError,
    TypeError as :func:`batch_rows`)."""
    try:
        rows = torch.arange(batch)[torch.as_tensor(indices).to("cpu")]
    except (IndexError, RuntimeError, TypeError, ValueError) as e:
        raise InvalidInputError(f"layer {index}: batch indices {indices!r} do not select "
                                f"rows of {batch} ({e})") from None
    return batch_rows(rows, batch, index)
