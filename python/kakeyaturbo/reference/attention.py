"""The torch reference of attention over the codes: decode every sealed block (through the Rust
decoder, :meth:`kakeyaturbo.CalibratedCodec.decode`), put the full K and V together with the raw
rows, and run plain attention in float64 with the same scaling, softcap, causal and sliding
window rules and mask as :func:`kakeyaturbo.decode_attention` (keys coded before RoPE: the
decoded sealed keys rotated in float64 with the table's cos/sin at their positions).

It is the definition the kernels (Rust, Triton) are checked against; nothing in it is fast.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np
import torch

from ..codec.attention import LayerCodes, RopeTable, additive_mask
from ..errors import InvalidInputError

__all__ = ["decoded_kv", "reference_attention"]


def rotate(k: np.ndarray, rope: RopeTable, positions: np.ndarray) -> np.ndarray:
    """RoPE on rows ``k [T, D]`` at ``positions [T]`` in float64 (the table's pairing; channels
    past its rotary dimension pass through)."""
    h = rope.rot_dim // 2
    c = rope.cos[positions].astype(np.float64)
    s = rope.sin[positions].astype(np.float64)
    x = k.astype(np.float64)
    out = x.copy()
    if rope.style == "half":
        a, b = x[:, :h], x[:, h:2 * h]
        out[:, :h], out[:, h:2 * h] = a * c - b * s, b * c + a * s
    else:
        a, b = x[:, 0:2 * h:2], x[:, 1:2 * h:2]
        out[:, 0:2 * h:2], out[:, 1:2 * h:2] = a * c - b * s, b * c + a * s
    return out


def decoded_kv(codes: LayerCodes, sink_k: Any, sink_v: Any, tail_k: Any, tail_v: Any,
               rope: Optional[RopeTable] = None, positions: Any = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every position's keys and values, float64 ``[B, H_kv, T, D_k]`` and ``[.., D_v]``: the
    sink rows, each sealed block decoded (keys coded before RoPE rotated to ``positions``), the
    tail rows (``sink_*`` may be None)."""
    b, hkv = codes.batch, codes.kv_heads
    ks, vs = [], []
    for bi in range(b):
        kr, vr = [], []
        for h in range(hkv):
            k = [] if sink_k is None else [np.asarray(sink_k)[bi, h]]
            v = [] if sink_v is None else [np.asarray(sink_v)[bi, h]]
            sealed = []
            for i in range(codes.num_blocks(bi, h)):
                sealed.append(codes.k_codecs[h].decode(codes.blob(bi, h, "k", i)))
                v.append(codes.v_codecs[h].decode(codes.blob(bi, h, "v", i)))
            if sealed:
                ks_ = np.concatenate(sealed)
                if rope is not None:
                    ks_ = rotate(ks_, rope, np.asarray(positions)[bi])
                k.append(ks_)
            k.append(np.asarray(tail_k)[bi, h])
            v.append(np.asarray(tail_v)[bi, h])
            kr.append(torch.from_numpy(np.concatenate(k).astype(np.float64)))
            vr.append(torch.from_numpy(np.concatenate(v).astype(np.float64)))
        ks.append(torch.stack(kr))
        vs.append(torch.stack(vr))
    return torch.stack(ks), torch.stack(vs)


def _check_shapes(codes: LayerCodes, q: torch.Tensor, tail_k: Any, latent: bool) -> None:
    """InvalidInputError, as :func:`kakeyaturbo.decode_attention` raises it, for a query that
    does not fit the layer: ``[B, H_q, n_q, D_k]`` (``D_k + D_v`` with ``latent``) with ``H_q``
    a positive multiple of the kv-heads and ``1 <= n_q <=`` the tail's rows."""
    b, hkv = codes.batch, codes.kv_heads
    dq = codes.k_dim + codes.v_dim if latent else codes.k_dim
    tail = np.shape(tail_k)
    if q.ndim != 4 or q.shape[0] != b or q.shape[3] != dq:
        raise InvalidInputError(f"q must be [B={b}, H_q, n_q, {dq}], got shape {tuple(q.shape)}")
    if q.shape[1] == 0 or q.shape[1] % hkv:
        raise InvalidInputError(f"query heads ({q.shape[1]}) must be a positive multiple of the kv-heads ({hkv})")
    if not 1 <= q.shape[2] <= (tail[2] if len(tail) == 4 else 0):
        raise InvalidInputError(f"q {tuple(q.shape)}: its tokens must be 1 .. the tail's rows ({tail})")


def reference_attention(codes: LayerCodes, q: Any, tail_k: Any, tail_v: Any, *,
                        sink_k: Any = None, sink_v: Any = None, scale: Optional[float] = None,
                        softcap: Optional[float] = None, window: Optional[int] = None,
                        mask: Any = None, rope: Optional[RopeTable] = None, positions: Any = None,
                        sink_logits: Any = None, latent: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over the decoded cache in float64; the arguments of
    :func:`kakeyaturbo.decode_attention`. Returns ``(out [B, H_q, n_q, D_v], lse [B, H_q,
    n_q])`` float64 tensors: a query that sees no position has output 0 and lse ``-inf`` (with
    ``sink_logits``, the softmax is taken over the scores and the head's sink logit, whose
    weight is then dropped, as GPT-OSS's attention does: lse is the sink's there). With
    ``latent`` the scores read ``[k, v]`` and the sum runs over ``k`` (out ``[.., D_k]``)."""
    qd = torch.from_numpy(np.asarray(q, dtype=np.float64))
    _check_shapes(codes, qd, tail_k, latent)
    k, v = decoded_kv(codes, sink_k, sink_v, tail_k, tail_v, rope, positions)
    if latent:
        k, v = torch.cat([k, v], dim=-1), k
    b, hq, nq, dk = qd.shape
    group = hq // codes.kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    t = k.shape[2]
    s = (qd @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dk) if scale is None else float(scale))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(t - nq, t)[:, None]
    pos = torch.arange(t)[None, :]
    seen = pos <= qpos
    if window is not None:
        seen &= qpos - pos < window
    s = s.masked_fill(~seen, float("-inf"))
    m = additive_mask(mask, b, nq, t)
    if m is not None:
        s = s + torch.from_numpy(m.astype(np.float64))[:, None]
    if sink_logits is not None:
        sl = torch.as_tensor(np.asarray(sink_logits, dtype=np.float64))
        s = torch.cat([s, sl[None, :, None, None].expand(b, hq, nq, 1)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[..., :1, :])], dim=-2)  # the sink holds no value
    top = s.amax(dim=-1, keepdim=True)
    none = torch.isinf(top) & (top < 0)
    p = torch.exp(s - torch.where(none, torch.zeros_like(top), top))
    den = p.sum(dim=-1, keepdim=True)
    out = torch.where(none, torch.zeros(()), (p @ v) / torch.where(none, torch.ones_like(den), den))
    lse = torch.where(none, torch.full_like(top, float("-inf")), top + torch.log(den))[..., 0]
    return out, lse
