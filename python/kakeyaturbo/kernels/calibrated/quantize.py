"""Calibrated encode, launch 2 of 3: everything from the rows to the packed codes.

Fused per tile of rows, all in registers: the projection ``u = A' (x - mean)`` again (launch 1
did not write it), the head's shared exponent of the rms scale (each program reduces launch
1's per-tile maxima) and the stored ``g^``, the sign flip and the band-limited butterfly of
every sub-band at once (slots are permuted so that sub-bands are aligned, ``batch.py``),
``z = y * (r / g^)``, the Lloyd-Max index of each slot at its own bit width (a branch-free
binary search, ``max_bits`` steps, in the head's threshold table padded with ``+inf``), the
centroid, the outlier flags and fp16 values, the ``inner_product`` gain, and the packing of
the row: the indices are scattered into their bytes by two small matrix products with 0/1
matrices built in registers (byte ``k`` of a row = sum over slots whose index starts in
byte ``k`` of ``(idx << shift) & 255``, plus those starting in byte ``k - 1`` of ``(idx <<
shift) >> 8``; the bit fields are disjoint, so the sum is the OR, exact in fp16 x fp16 -> f32).
Neither ``u``, ``z`` nor the indices go to memory (unless the caller asks for the
intermediates). The launch ends here only for ``inner_product``, whose gain is rounded with a
head-wide exponent (launch 3).

Outliers are appended, not compacted in place: each program counts its flagged values,
reserves a range of the head's outlier buffer with one atomic add, and writes its positions and
fp16 values there in row order. The order of the programs' ranges is not deterministic; the
caller sorts the lists by position afterwards, which makes the result deterministic.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import triton
import triton.language as tl

from .._common import (
    band_hadamard,
    block_absmax,
    ceil_log2,
    empty,
    from_scaled_f16,
    is_interpreter,
    next_pow2,
    placeholder,
    shared_exponent,
    to_scaled_f16,
)
from .batch import TABLE_LEN, TABLE_ROWS, CalibrationBatch

#: The per-head table layout as compile-time constants (row b of TABLE_LEN entries).
_TLEN = tl.constexpr(TABLE_LEN)
_TSIZE = tl.constexpr(TABLE_ROWS * _TLEN)
from .rms import project_tile, settings as project_settings
from ...errors import InvalidInputError


# The codec settings (norm, metric, outliers, intermediates) and the sizes are runtime
# values, not specialisations: one compiled kernel per tile shape serves every setting.
@triton.jit(do_not_specialize=["N", "T1", "PB", "C", "MM", "nsteps", "T2", "thr_out", "has_t", "ip", "norm",
                                "keep"])
def _quantize_kernel(
    x_ptr, sx_h, sx_n, sx_d, mean_ptr, a_ptr,
    col_ptr, bits_ptr, width_ptr, rnorm_ptr, signs_ptr, byte_ptr, shift_ptr,
    thr_ptr, cent_ptr, m_ptr, rb_ptr, rows_ptr,
    graw_ptr, tmax_ptr, T1,
    codes_ptr, PB, sbits_ptr, sexp_ptr,
    gain_ptr, gmax_ptr,
    cnt_ptr, opos_ptr, obits_ptr, C,
    idx_ptr, z_ptr, gout_ptr, MM,
    N, D, nsteps, T2, thr_out, has_t, ip, norm, keep,
    MP: tl.constexpr, LOG_MP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    RBC: tl.constexpr, RB: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    n_h = tl.minimum(tl.load(rows_ptr + h), N)
    m_h = tl.load(m_ptr + h)
    rb_h = tl.load(rb_ptr + h)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < n_h
    row_off = h * N + rows
    slots = tl.arange(0, MP)
    hs = h * MP + slots
    b = tl.load(bits_ptr + hs)
    valid = b > 0
    u = project_tile(x_ptr + h * sx_h, sx_n, sx_d, mean_ptr + h * D, a_ptr + h * MP * D,
                     rows, rmask, slots, D, MP, BN, BD)
    # The stored scale g^ (1 without norm); for mse/linf it is also the stored scale.
    g = tl.full((BN,), 1.0, tl.float32)
    if norm != 0:
        e = shared_exponent(block_absmax(tmax_ptr + h * T1, T1, RB))
        hb = to_scaled_f16(tl.load(graw_ptr + row_off, mask=rmask, other=0.0), e)
        g = from_scaled_f16(hb, e)
        if ip == 0:
            tl.store(sexp_ptr + h, e, mask=tile == 0)
            tl.store(sbits_ptr + row_off, hb, mask=rmask)
    # Rotation: y = H(s * u) per sub-band; z = y * (r / g^), 0 for a zero scale.
    sg = tl.load(signs_ptr + hs)
    y = band_hadamard(tl.where(valid[None, :], u * sg[None, :], 0.0),
                      tl.load(width_ptr + hs)[None, :], BN, MP, LOG_MP)
    r = tl.load(rnorm_ptr + hs)
    pos = g > 0
    f = tl.where(pos[:, None], tl.math.div_rn(r[None, :] + tl.zeros((BN, MP), tl.float32),
                                              tl.where(pos, g, 1.0)[:, None]), 0.0)
    z = y * f
    # Index = number of thresholds strictly below z: binary search over 2**nsteps - 1 entries
    # (the table of b bits, then +inf), so a tie goes to the lower index.
    tbase = thr_ptr + h * _TSIZE + b * _TLEN
    code = tl.zeros((BN, MP), tl.int32)
    for i in range(nsteps):
        step = 1 << (nsteps - 1 - i)
        t = tl.load(tbase[None, :] + code + (step - 1))
        code += tl.where(z > t, step, 0)
    q = tl.load(cent_ptr + h * _TSIZE + b[None, :] * _TLEN + code)
    col = tl.load(col_ptr + hs)
    if has_t != 0:
        # |z| > T is stored as fp16 of z (clamped to the finite range) and replaces the centroid.
        flag = (tl.abs(z) > thr_out) & valid[None, :] & rmask[:, None]
        hz = tl.minimum(tl.maximum(z, -65504.0), 65504.0).to(tl.float16)
        q = tl.where(flag, hz.to(tl.float32), q)
        fi = flag.to(tl.int32)
        rank = tl.cumsum(fi, 1) - fi
        per_row = tl.sum(fi, 1)
        before = tl.cumsum(per_row, 0) - per_row
        start = tl.atomic_add(cnt_ptr + h, tl.sum(per_row, 0))
        slot = start + before[:, None] + rank
        ok = flag & (slot < C)
        dst = h * C + slot.to(tl.int64)
        tl.store(opos_ptr + dst, rows[:, None].to(tl.int64) * m_h + col[None, :], mask=ok)
        tl.store(obits_ptr + dst, hz.to(tl.int16, bitcast=True), mask=ok)
    if ip != 0:
        qv = tl.where(valid[None, :], q, 0.0)
        qq = tl.sum(qv * qv, 1)
        zq = tl.sum(z * qv, 1)
        gain = tl.where(qq > 0, g * tl.math.div_rn(zq, tl.where(qq > 0, qq, 1.0)), g)
        tl.store(gain_ptr + row_off, gain, mask=rmask)
        tl.store(gmax_ptr + h * T2 + tile, tl.max(tl.where(rmask, tl.abs(gain), 0.0), 0))
    if keep != 0:
        cell = row_off[:, None] * MM + col[None, :]
        m2 = rmask[:, None] & valid[None, :]
        tl.store(idx_ptr + cell, code.to(tl.uint8), mask=m2)
        tl.store(z_ptr + cell, z, mask=m2)
        tl.store(gout_ptr + row_off, g, mask=rmask)
    # Packing: the two halves of (idx << shift) scattered into bytes by 0/1 matrices.
    v = tl.where(valid[None, :], code, 0) << tl.load(shift_ptr + hs)[None, :]
    lo = (v & 255).to(tl.float16)
    hi = (v >> 8).to(tl.float16)
    by = tl.load(byte_ptr + hs)
    out_row = codes_ptr + h * PB + rows[:, None].to(tl.int64) * rb_h
    for k0 in range(0, rb_h, RBC):
        kk = k0 + tl.arange(0, RBC)
        sel_lo = ((by[:, None] == kk[None, :]) & valid[:, None]).to(tl.float16)
        sel_hi = ((by[:, None] + 1 == kk[None, :]) & valid[:, None]).to(tl.float16)
        acc = tl.dot(lo, sel_lo)
        acc = tl.dot(hi, sel_hi, acc)
        tl.store(out_row + kk[None, :], acc.to(tl.int32).to(tl.uint8),
                 mask=rmask[:, None] & (kk < rb_h)[None, :])


def _settings(n: int, mp: int, d: int, rb: int) -> Dict[str, int]:
    s = dict(project_settings(n, mp, d))
    s["RBC"] = max(16, min(64, next_pow2(rb)))
    s["RB"] = 1024 if is_interpreter() else 256
    return s


def quantize(
    x: torch.Tensor,
    batch: CalibrationBatch,
    rows: torch.Tensor,
    g_raw: Optional[torch.Tensor],
    tile_max: Optional[torch.Tensor],
    capacity: int,
    intermediates: bool = False,
) -> Dict[str, torch.Tensor]:
    """Launch 2 for a batch.

    ``x``: float32 or bfloat16 ``[H, N, D]`` (any strides, checked by the caller); ``rows``:
    int32 ``[H]``; ``g_raw`` float32 ``[H, N]`` and ``tile_max`` float32 ``[H, T1]``: launch 1's
    output (None without ``norm``); ``capacity``: outlier entries reserved per head.

    Returns a dict: ``codes`` uint8 ``[H, N * max_row_bytes]`` (head ``i`` uses its first
    ``rows_i * row_bytes_i`` bytes); with ``norm`` and not ``inner_product``, ``scale_bits`` int16
    ``[H, N]`` and ``scale_exp`` int32 ``[H]``; for ``inner_product``, ``gain`` float32 ``[H, N]``
    (unrounded) and ``gain_max`` float32 ``[H, T]``; with an outlier threshold, ``count`` int32
    ``[H]`` (outliers per head, possibly above ``capacity``: then the lists are incomplete),
    ``pos`` int64 ``[H, capacity]`` and ``bits`` int16 ``[H, capacity]`` (unsorted, valid up to
    ``count``); with ``intermediates``, ``indices`` uint8 and ``z`` float32 ``[H, N, max_m]``
    and ``g`` float32 ``[H, N]``. Raises ValueError on bad shapes."""
    h, n, d = x.shape
    if h != batch.num_heads or d != batch.dim or rows.shape != (h,) or rows.dtype != torch.int32:
        raise InvalidInputError(f"x [{h}, {n}, {d}] / rows do not fit a batch of {batch.num_heads} heads, "
                                f"D={batch.dim}")
    if batch.norm and (g_raw is None or tile_max is None or g_raw.shape != (h, n)):
        raise InvalidInputError("norm needs launch 1's g [H, N] and tile maxima")
    dev, mp = x.device, batch.slots
    capacity = max(int(capacity), 1)  # the kernel is told C: the buffers must hold C entries
    s = _settings(n, mp, d, batch.max_row_bytes)
    tiles = triton.cdiv(n, s["BN"])
    ip = batch.metric == "inner_product"
    has_t = batch.outlier_threshold is not None
    out: Dict[str, torch.Tensor] = {"codes": empty((h, n * batch.max_row_bytes), torch.uint8, dev)}
    if batch.norm and not ip:
        out.update(scale_bits=empty((h, n), torch.int16, dev), scale_exp=empty((h,), torch.int32, dev))
    if ip:
        out.update(gain=empty((h, n), torch.float32, dev), gain_max=empty((h, tiles), torch.float32, dev))
    if has_t:
        out.update(count=torch.zeros(h, dtype=torch.int32, device=dev),
                   pos=empty((h, capacity), torch.int64, dev), bits=empty((h, capacity), torch.int16, dev))
    if intermediates:
        out.update(indices=empty((h, n, batch.max_m), torch.uint8, dev),
                   z=empty((h, n, batch.max_m), torch.float32, dev), g=empty((h, n), torch.float32, dev))
    f32, i16, i32 = (placeholder(t, dev) for t in (torch.float32, torch.int16, torch.int32))
    # Pointers of a disabled branch are typed placeholders, never dereferenced.
    _quantize_kernel[(tiles, h)](
        x, x.stride(0), x.stride(1), x.stride(2), batch.mean, batch.analysis,
        batch.col, batch.bits, batch.width, batch.rnorm, batch.signs, batch.byte, batch.shift,
        batch.thresholds, batch.centroids, batch.m, batch.row_bytes, rows,
        f32 if g_raw is None else g_raw, f32 if tile_max is None else tile_max,
        1 if tile_max is None else tile_max.shape[1],
        out["codes"], out["codes"].shape[1], out.get("scale_bits", i16), out.get("scale_exp", i32),
        out.get("gain", f32), out.get("gain_max", f32),
        out.get("count", i32), out.get("pos", placeholder(torch.int64, dev)), out.get("bits", i16),
        max(capacity, 1),
        out.get("indices", placeholder(torch.uint8, dev)), out.get("z", f32), out.get("g", f32),
        batch.max_m,
        n, d, batch.max_bits, tiles,
        0.0 if batch.outlier_threshold is None else float(batch.outlier_threshold),
        int(has_t), int(ip), int(batch.norm), int(intermediates),
        MP=mp, LOG_MP=ceil_log2(mp), BN=s["BN"], BD=s["BD"], RBC=s["RBC"], RB=s["RB"],
        num_warps=s["num_warps"], enable_fp_fusion=False,
    )
    return out
