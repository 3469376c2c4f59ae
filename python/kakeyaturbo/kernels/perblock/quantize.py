"""Encode launch 3 of 4: stages 4 and 5a-b, rotate, scale, quantise, flag outliers.

Fused, per tile of rows, all in registers: the residual ``r = c - t^ centre_seg`` formed again
from ``c`` (as launch 2 did), the block's shared exponent of the norm (each program reduces
``max |r|`` of its block), the stored norm ``s^``, the sign flip and band Hadamard butterfly,
``z = y * (f_b / s^)``, the Lloyd-Max index (number of thresholds strictly below ``z``), the
outlier flags and fp16 values, and for ``inner_product`` the least-squares gain
``s^ <z, q> / <q, q>``. Neither ``r`` nor ``z`` is written out. The launch ends here because
the gain is rounded with a block-wide exponent (launch 4).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._common import (
    band_factor,
    band_hadamard,
    band_live,
    band_width,
    block_absmax,
    ceil_log2,
    empty,
    from_scaled_f16,
    is_interpreter,
    next_pow2,
    placeholder,
    residual_tile,
    shared_exponent,
    to_scaled_f16,
)
from .skeleton import SkeletonBatch
from ...errors import InvalidInputError

Opt = Optional[torch.Tensor]


# The codec parameters (threshold count, outlier flag, metric) and N are runtime values, not
# specialisations: one compiled kernel per tile shape serves every setting.
@triton.jit(do_not_specialize=["N", "nthr", "has_t", "ip"])
def _quantize_kernel(
    c_ptr, seg_ptr, tbits_ptr, texp_ptr, centers_ptr, sc_b,
    norm_ptr, k_ptr, rows_ptr, d_eff_ptr,
    signs_ptr, centroids_ptr, thr_ptr,
    nbits_ptr, nexp_ptr, codes_ptr, oflag_ptr, oval_ptr, gain_ptr,
    N, T, nthr, has_t, ip,
    W: tl.constexpr, LOG_W: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_b = tl.minimum(tl.load(rows_ptr + b), N)
    de = tl.load(d_eff_ptr + b)
    e = shared_exponent(block_absmax(norm_ptr + b * N, n_b, RB))
    tl.store(nexp_ptr + b, e, mask=tile == 0)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < n_b
    row_off = b * N + rows
    cols = tl.arange(0, W)
    h = to_scaled_f16(tl.load(norm_ptr + row_off, mask=rmask, other=0.0), e)
    tl.store(nbits_ptr + row_off, h, mask=rmask)
    s_hat = from_scaled_f16(h, e)
    # Stage 4: y = H(s * r) per band; z = y * (f_b / s^), 0 for a zero residual.
    live = band_live(de, cols)
    valid = cols < de
    seg = tl.load(seg_ptr + row_off, mask=rmask, other=0)
    t_hat = from_scaled_f16(tl.load(tbits_ptr + row_off, mask=rmask, other=0), tl.load(texp_ptr + b))
    r = residual_tile(c_ptr, centers_ptr + b * sc_b, seg, tl.load(k_ptr + b), t_hat, row_off, rmask, cols, W)
    sg = tl.load(signs_ptr + cols)
    y = band_hadamard(tl.where(valid[None, :], r * sg[None, :], 0.0), live[None, :], BN, W, LOG_W)
    f = band_factor(de, band_width(live, LOG_W))
    pos = s_hat > 0
    inv = tl.where(pos[:, None], tl.math.div_rn(f[None, :] + tl.zeros((BN, W), tl.float32),
                                                tl.where(pos, s_hat, 1.0)[:, None]), 0.0)
    z = y * inv
    # Stage 5b: index = number of thresholds strictly below z (a tie goes to the lower index).
    code = tl.zeros((BN, W), tl.int32)
    for i in range(nthr):
        code += (z > tl.load(thr_ptr + i)).to(tl.int32)
    code = tl.where(valid[None, :], code, 0)
    m2 = rmask[:, None]
    cell = row_off[:, None] * W + cols[None, :]
    tl.store(codes_ptr + cell, code.to(tl.uint8), mask=m2)
    q = tl.load(centroids_ptr + code)
    if has_t != 0:
        # Stage 5a: |z| > T is stored as fp16 of z (clamped to the finite range) and
        # replaces the centroid in the gain and at decode.
        flag = (tl.abs(z) > T) & valid[None, :]
        hz = tl.minimum(tl.maximum(z, -65504.0), 65504.0).to(tl.float16)
        tl.store(oflag_ptr + cell, flag.to(tl.uint8), mask=m2)
        tl.store(oval_ptr + cell, hz.to(tl.int16, bitcast=True), mask=m2 & flag)
        q = tl.where(flag, hz.to(tl.float32), q)
    if ip != 0:
        q = tl.where(valid[None, :], q, 0.0)
        qq = tl.sum(q * q, 1)
        zq = tl.sum(z * q, 1)
        gain = tl.where(qq > 0, s_hat * tl.math.div_rn(zq, tl.where(qq > 0, qq, 1.0)), s_hat)
        tl.store(gain_ptr + row_off, gain, mask=rmask)


def _settings(n: int, w: int) -> Dict[str, int]:
    if is_interpreter():
        return {"BN": max(16, min(256, next_pow2(n))), "RB": max(16, min(1024, next_pow2(n))), "num_warps": 4}
    return {"BN": max(16, 2048 // w), "RB": 512, "num_warps": 4 if w <= 64 else 8}


def _launch(c, seg, tbits, texp, norm, skel: SkeletonBatch, rows, nbits, nexp, codes, oflag, oval,
            gain) -> None:
    b, n, w = c.shape
    s = _settings(n, w)
    t = skel.outlier_threshold
    _quantize_kernel[(triton.cdiv(n, s["BN"]), b)](
        c, seg, tbits, texp, skel.centers, skel.centers.stride(0),
        norm, skel.k, rows, skel.d_eff,
        skel.signs, skel.centroids, skel.thresholds,
        nbits, nexp, codes, oflag, oval, gain,
        n, 0.0 if t is None else float(t),
        (1 << skel.bit_width) - 1, int(t is not None), int(skel.metric == "inner_product"),
        W=w, LOG_W=ceil_log2(w), BN=s["BN"], RB=s["RB"],
        num_warps=s["num_warps"], enable_fp_fusion=False,
    )


def quantize(
    c: torch.Tensor,
    seg: torch.Tensor,
    tbits: torch.Tensor,
    texp: torch.Tensor,
    norm: torch.Tensor,
    skel: SkeletonBatch,
    rows: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Opt, Opt, Opt]:
    """Stages 4-5b for a batch.

    ``c``: float32 ``[B, N, W]`` projections (zero beyond ``d_eff``); ``seg``: int32 ``[B, N]``;
    ``tbits``: int16 ``[B, N]`` and ``texp``: int32 ``[B]``, the stored ``t``; ``norm``: float32
    ``[B, N]`` unrounded ``|r|``; ``rows``: int32 ``[B]`` (from
    :func:`~kakeyaturbo.kernels.perblock.residual.residuals`). Returns ``norm_bits`` int16
    ``[B, N]`` and ``norm_exp`` int32 ``[B]`` (the stored norm), ``codes`` uint8 ``[B, N, W]``
    (0 beyond ``d_eff``), and -- only when the skeleton has an outlier threshold -- ``oflag`` uint8
    ``[B, N, W]`` (1 = outlier) and ``oval`` int16 ``[B, N, W]`` (fp16 bits of ``z``, written
    where flagged), and -- only for ``inner_product`` -- the unrounded gain float32 ``[B, N]``
    (else None each). Raises ValueError on bad shapes."""
    b, n, w = c.shape
    want = {
        "c": (c, (b, n, w), torch.float32),
        "seg": (seg, (b, n), torch.int32),
        "tbits": (tbits, (b, n), torch.int16),
        "texp": (texp, (b,), torch.int32),
        "norm": (norm, (b, n), torch.float32),
        "rows": (rows, (b,), torch.int32),
    }
    for name, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != c.device:
            raise InvalidInputError(f"{name} must be contiguous {dtype} {shape} on {c.device}")
    if b != skel.num_blocks or w != skel.width:
        raise InvalidInputError(
            f"c [{b}, {n}, {w}] does not fit the skeleton ({skel.num_blocks} blocks, W={skel.width})"
        )
    dev = c.device
    nbits = empty((b, n), torch.int16, dev)
    nexp = empty((b,), torch.int32, dev)
    codes = empty((b, n, w), torch.uint8, dev)
    has_t = skel.outlier_threshold is not None
    oflag = empty((b, n, w), torch.uint8, dev) if has_t else None
    oval = empty((b, n, w), torch.int16, dev) if has_t else None
    gain = empty((b, n), torch.float32, dev) if skel.metric == "inner_product" else None
    # Pointers of a disabled branch are never dereferenced.
    _launch(c, seg, tbits, texp, norm, skel, rows, nbits, nexp, codes,
            codes if oflag is None else oflag,
            placeholder(torch.int16, dev) if oval is None else oval,
            norm if gain is None else gain)
    return nbits, nexp, codes, oflag, oval, gain
