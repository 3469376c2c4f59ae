"""Decode attention over the codes, second launch: one program per (batch row, kv-head) pair
combines the pieces' partial softmaxes (rescaled to the largest maximum), synthesises the
code-domain value sum once per query (``u = s H(r a)`` per sub-band, ``u S' + pc mean``),
adds the raw rows' sum and divides by the denominator ``l``; ``lse = M + log l``."""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import triton
import triton.language as tl

from .._common import band_hadamard, empty, is_interpreter
from .batch import LayerBatch
from ...errors import InvalidInputError


@triton.jit(do_not_specialize=["HKV", "G", "NQ", "DV", "NCODE", "NS", "WACC"])
def _combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, out_ptr, lse_ptr,
    vsyn_ptr, vmean_ptr, vsigns_ptr, vwidth_ptr, vrnorm_ptr,
    HKV, G, NQ, DV, NCODE, NS, WACC,
    QP: tl.constexpr, MPV: tl.constexpr, LOG_MPV: tl.constexpr, BDC: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, QP)
    rvalid = r < G * NQ
    qrow = (b * (HKV * G) + h * G + r // NQ) * NQ + r % NQ
    big = tl.full((QP,), float("-inf"), tl.float32)
    for s in range(0, NS):
        big = tl.maximum(big, tl.load(pm_ptr + (bh * NS + s) * QP + r))
    safe = tl.where(big == float("-inf"), 0.0, big)
    cols = tl.arange(0, MPV)
    den = tl.zeros((QP,), tl.float32)
    pc = tl.zeros((QP,), tl.float32)
    a = tl.zeros((QP, MPV), tl.float32)
    for s in range(0, NCODE):
        at = (bh * NS + s) * QP + r
        f = tl.exp(tl.load(pm_ptr + at) - safe)
        ls = tl.load(pl_ptr + at) * f
        den += ls
        pc += ls
        a += tl.load(pacc_ptr + at[:, None] * WACC + cols[None, :]) * f[:, None]
    at = (bh * NS + NCODE) * QP + r
    f = tl.exp(tl.load(pm_ptr + at) - safe)
    den += tl.load(pl_ptr + at) * f
    hv = h * MPV + cols
    y = a * tl.load(vrnorm_ptr + hv)[None, :]
    y = band_hadamard(y, tl.load(vwidth_ptr + hv)[None, :], QP, MPV, LOG_MPV)
    u = y * tl.load(vsigns_ptr + hv)[None, :]
    seen = den > 0
    inv = tl.where(seen, 1.0 / tl.where(seen, den, 1.0), 0.0)
    # u S' + pc mean + raw, in chunks of BDC columns (S' may be 256 x 256).
    for d0 in range(0, DV, BDC):
        dc = d0 + tl.arange(0, BDC)
        dcm = dc < DV
        syn = tl.load(vsyn_ptr + hv[:, None] * DV + dc[None, :], mask=dcm[None, :], other=0.0)
        mean = tl.load(vmean_ptr + h * DV + dc, mask=dcm, other=0.0)
        raw = tl.load(pacc_ptr + at[:, None] * WACC + dc[None, :], mask=dcm[None, :], other=0.0)
        o = tl.dot(u, syn, input_precision="ieee") + pc[:, None] * mean[None, :] + raw * f[:, None]
        o = tl.where(seen[:, None], o * inv[:, None], 0.0)
        tl.store(out_ptr + qrow[:, None] * DV + dc[None, :], o, mask=rvalid[:, None] & dcm[None, :])
    lse = tl.where(seen, big + tl.log(tl.where(seen, den, 1.0)), float("-inf"))
    tl.store(lse_ptr + qrow, lse, mask=rvalid)


def _settings(mp: int) -> Dict[str, int]:
    """Columns per chunk of the synthesis (its tiles sit in shared memory) and warps."""
    if is_interpreter():
        return {"BDC": 64, "num_warps": 4}
    return {"BDC": 64 if mp <= 128 else 32, "num_warps": 4 if mp <= 64 else 8}


def combine_attention(layer: LayerBatch, pm: torch.Tensor, pl: torch.Tensor, pacc: torch.Tensor,
                      ncode: int, q_heads: int, n_q: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The attention output float32 ``[B, H_q, n_q, D_v]`` and lse float32 ``[B, H_q, n_q]``
    from the partial softmaxes of :func:`~.split.split_attention` (``pm``, ``pl`` ``[BH, NS,
    QP]``, ``pacc`` ``[BH, NS, QP, W]``, ``NS = ncode + 1``). Raises ValueError on shapes that
    do not fit."""
    vc = layer.v.cal
    b, hkv, dv = layer.batch, layer.kv_heads, vc.dim
    bh, ns, qp = pm.shape
    group = q_heads // hkv
    if bh != b * hkv or ns != ncode + 1 or q_heads % hkv or tuple(pl.shape) != tuple(pm.shape) \
            or pacc.shape[:3] != pm.shape or qp < group * n_q:
        raise InvalidInputError(f"partial softmaxes {tuple(pm.shape)}, {tuple(pacc.shape)} do not fit "
                                f"B={b}, H_kv={hkv}, H_q={q_heads}, n_q={n_q}, {ncode} pieces")
    mpv = vc.slots
    out = empty((b, q_heads, n_q, dv), torch.float32, layer.device)
    lse = empty((b, q_heads, n_q), torch.float32, layer.device)
    _combine_kernel[(bh,)](
        pm, pl, pacc, out, lse,
        vc.synthesis, vc.mean, vc.signs, vc.width, vc.rnorm,
        hkv, group, n_q, dv, ncode, ns, pacc.shape[3],
        QP=qp, MPV=mpv, LOG_MPV=max(mpv - 1, 0).bit_length(), **_settings(mpv),
    )
    return out, lse
