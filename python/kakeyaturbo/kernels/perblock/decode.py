"""Batched decode of many blocks (and heads) in one launch.

Fully fused per tile of rows, everything in registers from the packed bytes to the output:
unpack, centroid lookup, outlier override, ``y * (scale / f_b)``, the inverse band Hadamard
``s * H(y) / W_b``, ``c = r + t^ centre_seg`` and ``x = mu + U^T c`` (tiled over D). Nothing in
the decode needs a block-wide reduction (the shared exponents are stored), so one launch does
it all. Outliers are found per row through a table of row starts into the sorted outlier list,
built on device with ``torch.searchsorted`` before the launch (only when there are outliers).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
import triton
import triton.language as tl

from ...errors import InvalidInputError
from .._common import (
    RowsLike,
    band_factor,
    band_hadamard,
    band_live,
    band_width,
    ceil_log2,
    check_device,
    check_exponents,
    check_out,
    check_outlier_lists,
    f16_nonfinite,
    empty,
    from_scaled_f16,
    is_interpreter,
    next_pow2,
    on_host,
    placeholder,
    row_starts,
    rows_tensor,
)
from .pack import packed_bytes
from .skeleton import SkeletonBatch


@triton.jit(do_not_specialize=["PB", "N", "bits", "has_out"])
def _decode_kernel(
    packed_ptr, PB, seg_ptr, tbits_ptr, texp_ptr, sbits_ptr, sexp_ptr,
    rstart_ptr, opos_ptr, obits_ptr,
    rows_ptr, d_eff_ptr, k_ptr, signs_ptr, centroids_ptr,
    centers_ptr, sc_b, basis_ptr, sb_b, mean_ptr, sm_b,
    out_ptr, so_b, so_n, so_d,
    N, D, bits, has_out,
    W: tl.constexpr, LOG_W: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_b = tl.minimum(tl.load(rows_ptr + b), N)
    de = tl.load(d_eff_ptr + b)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < n_b
    row_off = b * N + rows
    cols = tl.arange(0, W)
    valid = cols < de
    m2 = rmask[:, None] & valid[None, :]
    # Unpack: index i of the block sits at stream bits [i*b, (i+1)*b), LSB first; it spans at
    # most two bytes (b <= 4).
    bit = (rows[:, None].to(tl.int64) * de + cols[None, :]) * bits
    byte = bit >> 3
    sh = (bit & 7).to(tl.int32)
    base = packed_ptr + b * PB
    lo = tl.load(base + byte, mask=m2, other=0).to(tl.int32)
    hi = tl.load(base + byte + 1, mask=m2 & (sh + bits > 8), other=0).to(tl.int32)
    code = ((lo | (hi << 8)) >> sh) & ((1 << bits) - 1)
    q = tl.load(centroids_ptr + code)
    if has_out != 0:
        start = tl.load(rstart_ptr + b * (N + 1) + rows, mask=rmask, other=0)
        count = tl.load(rstart_ptr + b * (N + 1) + rows + 1, mask=rmask, other=0) - start
        # Row-wise values broadcast to the tile and clamped indices, not masked row loads:
        # Triton 3.6's layout pass fails on the row-vector form of this loop ("mask type
        # matches ptr type"). has_out means index 0 exists.
        zi = tl.zeros((BN, W), tl.int64)
        start2 = start[:, None] + zi
        count2 = count[:, None] + zi
        first = rows[:, None].to(tl.int64) * de + zi
        for j in range(0, tl.max(count, 0)):
            has = j < count2
            at = tl.where(has, start2 + j, 0)
            p = tl.load(opos_ptr + at)
            v = tl.load(obits_ptr + at).to(tl.float16, bitcast=True).to(tl.float32)
            q = tl.where(has & (p - first == cols[None, :]), v, q)
    t_hat = from_scaled_f16(tl.load(tbits_ptr + row_off, mask=rmask, other=0), tl.load(texp_ptr + b))
    scale = from_scaled_f16(tl.load(sbits_ptr + row_off, mask=rmask, other=0), tl.load(sexp_ptr + b))
    live = band_live(de, cols)
    wb = band_width(live, LOG_W)
    f = band_factor(de, wb)
    # y = q * (scale / f_b), then r = s * H(y) / W_b band by band (1/W_b is exact).
    zero = tl.zeros((BN, W), tl.float32)
    y = q * tl.math.div_rn(scale[:, None] + zero, f[None, :] + zero)
    y = tl.where(valid[None, :], y, 0.0)
    y = band_hadamard(y, live[None, :], BN, W, LOG_W)
    sg = tl.load(signs_ptr + cols)
    r = y * sg[None, :] * tl.math.div_rn(tl.full((W,), 1.0, tl.float32), wb.to(tl.float32))[None, :]
    # Clamped to the block's centres: a corrupted index cannot read past them.
    seg = tl.maximum(tl.minimum(tl.load(seg_ptr + row_off, mask=rmask, other=0), tl.load(k_ptr + b) - 1), 0)
    cen = tl.load(centers_ptr + b * sc_b + seg[:, None] * W + cols[None, :])
    c = tl.where(valid[None, :], r + t_hat[:, None] * cen, 0.0)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < D
        u = tl.load(basis_ptr + b * sb_b + cols[:, None] * D + dd[None, :], mask=dmask[None, :], other=0.0)
        mu = tl.load(mean_ptr + b * sm_b + dd, mask=dmask, other=0.0)
        o = tl.dot(c, u, input_precision="ieee") + mu[None, :]
        tl.store(
            out_ptr + b * so_b + rows[:, None].to(tl.int64) * so_n + dd[None, :].to(tl.int64) * so_d,
            o.to(out_ptr.dtype.element_ty),
            mask=rmask[:, None] & dmask[None, :],
        )


def _settings(n: int, w: int, d: int) -> Dict[str, int]:
    if is_interpreter():
        return {"BN": max(16, min(256, next_pow2(n))), "BD": max(16, min(256, next_pow2(d))), "num_warps": 4}
    bn = 64 if w <= 64 else (32 if w <= 128 else 16)
    return {"BN": bn, "BD": 64, "num_warps": 4 if w <= 64 else 8}


def _launch(codes, skel: SkeletonBatch, rows, rstart, out, has_out: bool) -> None:
    b, n, d = out.shape
    w = skel.width
    s = _settings(n, w, d)
    opos, obits = codes["outlier_pos"], codes["outlier_bits"]
    packed = codes["residual_packed"]
    _decode_kernel[(triton.cdiv(n, s["BN"]), b)](
        packed, packed.shape[1], codes["seg_id"], codes["t_bits"], codes["t_exp"],
        codes["norm_bits"], codes["norm_exp"],
        rstart, opos, obits,
        rows, skel.d_eff, skel.k, skel.signs, skel.centroids,
        skel.centers, skel.centers.stride(0), skel.basis, skel.basis.stride(0),
        skel.mean, skel.mean.stride(0),
        out, out.stride(0), out.stride(1), out.stride(2),
        n, d, skel.bit_width, int(has_out),
        W=w, LOG_W=ceil_log2(w), BN=s["BN"], BD=s["BD"],
        num_warps=s["num_warps"], enable_fp_fusion=False,
    )


def decode_blocks(
    codes: Mapping[str, torch.Tensor],
    skel: SkeletonBatch,
    rows: RowsLike = None,
    out_dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decodes ``B`` blocks in one launch on the skeleton's device.

    ``codes``: the dict of :func:`~kakeyaturbo.kernels.encode_blocks` (``seg_id``, ``t_bits``,
    ``norm_bits`` ``[B, N]``; ``t_exp``, ``norm_exp`` ``[B]``; ``residual_packed`` uint8 ``[B, PB]``
    with ``PB >= ceil(N * max_d_eff * b / 8)``; ``outlier_ptr [B + 1]``, ``outlier_pos [M]``,
    ``outlier_bits [M]``; ``residual_codes`` is not read). ``skel``: the batch's skeletons.
    ``rows``: rows per block (host sequence or int32 ``[B]`` tensor, default all N).
    ``out_dtype``: float32 or bfloat16; ``out``: an optional ``[B, N, D]`` tensor of that dtype
    (any strides) to write into. Returns ``[B, N, D]``; rows past a block's count are not
    written. Raises ValueError on bad shapes, dtypes or devices. Codes in host memory (CPU
    tensors) are checked as the Rust decoder checks a block's parts (InvalidInputError for a
    ``seg_id`` past the block's centres, a non-finite fp16 value or an outlier position out of
    range or not ascending; InvalidParameterError for an exponent outside -126..=127;
    CorruptDataError for an ``outlier_ptr`` that does not run from 0 to ``M``); codes on a
    GPU are trusted (checking them would read the device), but an index is clamped, never
    followed out of the buffers.
    """
    skel.validate()
    dev = skel.device
    seg = codes["seg_id"]
    if seg.ndim != 2 or seg.shape[0] != skel.num_blocks:
        raise InvalidInputError(f"seg_id must be [{skel.num_blocks}, N], got {tuple(seg.shape)}")
    b, n = seg.shape
    d = skel.dim
    want = {
        "seg_id": ((b, n), torch.int32),
        "t_bits": ((b, n), torch.int16),
        "norm_bits": ((b, n), torch.int16),
        "t_exp": ((b,), torch.int32),
        "norm_exp": ((b,), torch.int32),
        "outlier_ptr": ((b + 1,), torch.int64),
    }
    for name, (shape, dtype) in want.items():
        t = codes[name]
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise InvalidInputError(f"{name} must be contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        check_device(name, t, dev)
    packed = codes["residual_packed"]
    need = packed_bytes(n, skel.max_d_eff, skel.bit_width)
    if packed.ndim != 2 or packed.shape[0] != b or packed.shape[1] < need or packed.dtype != torch.uint8:
        raise InvalidInputError(
            f"residual_packed must be uint8 [{b}, >= {need}], got {packed.dtype} {tuple(packed.shape)}"
        )
    if not packed.is_contiguous():
        raise InvalidInputError("residual_packed must be contiguous")
    opos, obits = codes["outlier_pos"], codes["outlier_bits"]
    if opos.ndim != 1 or opos.dtype != torch.int64 or obits.shape != opos.shape or obits.dtype != torch.int16:
        raise InvalidInputError("outlier_pos must be int64 [M] and outlier_bits int16 [M]")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise InvalidInputError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if out is None:
        out = empty((b, n, d), out_dtype, dev)
    else:
        check_out(out, (b, n, d), out_dtype, dev)
    rows_t = rows_tensor(rows, b, n, dev)
    if on_host(seg):
        _check_host_codes(codes, skel, rows_t)
    has_out = opos.numel() > 0
    if has_out:
        rstart = row_starts(codes, skel.d_eff, n, skel.width)
    else:
        # Never read without outliers; typed like the real arguments (one compiled kernel).
        rstart = placeholder(torch.int64, dev)
        codes = {**codes, "outlier_pos": rstart, "outlier_bits": placeholder(torch.int16, dev)}
    _launch(codes, skel, rows_t, rstart, out, has_out)
    return out


def _check_host_codes(codes: Mapping[str, torch.Tensor], skel: SkeletonBatch, rows: torch.Tensor) -> None:
    """The values of codes in host memory, in the live rows of each block, as Rust checks a
    block's parts."""
    b, n = codes["seg_id"].shape
    live = torch.arange(n)[None, :] < rows[:, None].to(torch.int64)
    seg = codes["seg_id"]
    bad = live & ((seg < 0) | (seg >= skel.k[:, None]))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise InvalidInputError(f"block {i}: seg_id out of range (k = {int(skel.k[i])})")
    for name in ("t_bits", "norm_bits"):
        bad = live & f16_nonfinite(codes[name])
        if bool(bad.any()):
            raise InvalidInputError(f"block {int(torch.nonzero(bad)[0, 0])}: {name} holds a non-finite fp16 value")
    check_exponents("t_exp", codes["t_exp"])
    check_exponents("norm_exp", codes["norm_exp"])
    cells = (n * skel.d_eff.to(torch.int64)).tolist()  # rows past a count may hold some: unread
    check_outlier_lists(codes, cells, "block", InvalidInputError)
