"""Decode attention over the codes on a GPU: :func:`decode_attention_triton`, two launches
(``split.py``: partial softmaxes per (batch row, kv-head) pair and piece of positions;
``combine.py``: their combination and the synthesis of the value sum), the Triton version of
:func:`kakeyaturbo.decode_attention` (the Rust kernel is its oracle)."""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np
import torch

from .batch import LayerBatch, raw_rows
from .combine import combine_attention
from .split import split_attention


def decode_attention_triton(layer: LayerBatch, q: torch.Tensor, tail_k: Any, tail_v: Any, *,
                            sink_k: Any = None, sink_v: Any = None, scale: Optional[float] = None,
                            softcap: Optional[float] = None, window: Optional[int] = None,
                            mask: Any = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One attention step over a layer's sealed codes (:func:`~.batch.stack_layer`) and raw
    rows, on the layer's device; the arguments and rules of :func:`kakeyaturbo.decode_attention`:

    - ``q``: float32 ``[B, H_q, n_q, D_k]`` (in the keys' coding domain);
    - ``tail_k`` / ``tail_v``: ``[B, H_kv, R, D_k]`` / ``[.., D_v]`` (the last ``n_q`` rows the
      queries' own), ``sink_k`` / ``sink_v``: ``[B, H_kv, S, D]`` or None (tensors or arrays,
      moved to the device as float32);
    - ``scale`` (default ``1 / sqrt(D_k)``), ``softcap``, ``window`` (the last ``window``
      positions), ``mask``: additive float32 or boolean (True: attend) ``[B, n_q, T]`` or
      ``[B, 1, n_q, T]``.

    Returns ``(out float32 [B, H_q, n_q, D_v], lse float32 [B, H_q, n_q])`` (0 and ``-inf``
    for a query that sees nothing). Raises ValueError on shapes, dtypes or devices that do not
    fit, or a bad scale, softcap or window."""
    dev = layer.device
    b, hkv = layer.batch, layer.kv_heads
    dk, dv = layer.k.cal.dim, layer.v.cal.dim
    if (sink_k is None) != (sink_v is None):
        raise ValueError("pass both sink_k and sink_v, or neither")
    rk, s = raw_rows(sink_k, tail_k, b, hkv, dk, dev)
    rv, sv = raw_rows(sink_v, tail_v, b, hkv, dv, dev)
    if rk.shape[1] != rv.shape[1] or s != sv:
        raise ValueError("keys and values must have the same raw rows")
    if not isinstance(q, torch.Tensor):
        q = torch.from_numpy(np.asarray(q))
    q = q.to(dev).contiguous()
    nq = q.shape[2] if q.ndim == 4 else 0
    scale = 1.0 / math.sqrt(dk) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be finite and > 0, got {softcap}")
    if window is not None and int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    m = None
    if mask is not None:
        m = mask if isinstance(mask, torch.Tensor) else torch.from_numpy(np.asarray(mask))
        if m.ndim == 4:
            if m.shape[1] != 1:
                raise ValueError(f"a 4-D mask must be [B, 1, n_q, T], got {tuple(m.shape)}")
            m = m[:, 0]
        if m.dtype == torch.bool:
            m = torch.where(m, 0.0, float("-inf"))
        m = m.to(device=dev, dtype=torch.float32).contiguous()
    pm, pl, pacc, ncode = split_attention(layer, q, rk, rv, s, m, scale, softcap, window)
    return combine_attention(layer, pm, pl, pacc, ncode, q.shape[1], nq)
