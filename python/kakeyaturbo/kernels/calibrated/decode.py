"""Calibrated decode of many heads in one launch.

Fully fused per tile of rows, in registers from the packed bytes to the output: unpack (each
slot's index from its byte and shift, at most two bytes since widths are <= 8), centroid
lookup at the slot's width, outlier override, ``q * (g^ r)``, the band-limited butterfly of
every sub-band, the signs, and ``x = mean + u S'`` (tiled over D). Nothing in the decode needs
a head-wide reduction (the exponents are stored), so one launch does it all. Outliers are
found per row through a table of row starts into the sorted lists, built on device with
``torch.searchsorted`` (``_common.row_starts``) before the launch, only when there are some.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

import torch
import triton
import triton.language as tl

from ...codec import _checks
from ...errors import CorruptDataError, InvalidInputError
from .._common import (
    RowsLike,
    band_hadamard,
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
from .batch import TABLE_LEN, TABLE_ROWS, CalibrationBatch

#: The per-head table layout as compile-time constants (row b of TABLE_LEN entries).
_TLEN = tl.constexpr(TABLE_LEN)
_TSIZE = tl.constexpr(TABLE_ROWS * _TLEN)


@triton.jit
def row_centroids(codes_ptr, rstart_ptr, opos_ptr, obits_ptr, m_ptr, rb_ptr, col_ptr, bits_ptr,
                  byte_ptr, shift_ptr, cent_ptr, h, rows, rmask, has_out, MP: tl.constexpr):
    """The centroids ``[BN, MP]`` of rows ``rows`` of one head's packed codes (``codes_ptr``
    at their first row, ``rstart_ptr`` at their outlier row starts; kv-head ``h`` gives the
    calibration): slot order, outliers applied, 0 in padding slots and past the rows. Each
    slot's index sits at row bits ``[8 byte + shift, + b)``, LSB first, in at most two bytes."""
    slots = tl.arange(0, MP)
    hs = h * MP + slots
    b = tl.load(bits_ptr + hs)
    valid = b > 0
    m2 = rmask[:, None] & valid[None, :]
    by = tl.load(byte_ptr + hs)
    sh = tl.load(shift_ptr + hs)
    rb = tl.load(rb_ptr + h)
    base = codes_ptr + rows[:, None].to(tl.int64) * rb + by[None, :]
    lo = tl.load(base, mask=m2, other=0).to(tl.int32)
    hi = tl.load(base + 1, mask=m2 & (sh + b > 8)[None, :], other=0).to(tl.int32)
    code = ((lo | (hi << 8)) >> sh[None, :]) & ((1 << b) - 1)[None, :]
    q = tl.load(cent_ptr + h * _TSIZE + b[None, :] * _TLEN + code)
    q = tl.where(m2, q, 0.0)
    if has_out != 0:
        m_h = tl.load(m_ptr + h)
        col = tl.load(col_ptr + hs)
        start = tl.load(rstart_ptr + rows, mask=rmask, other=0)
        count = tl.load(rstart_ptr + rows + 1, mask=rmask, other=0) - start
        # Row-wise values broadcast to the tile and clamped indices, not masked row loads:
        # Triton 3.6's layout pass fails on the row-vector form of this loop ("mask type
        # matches ptr type"). has_out means index 0 exists.
        zi = tl.zeros_like(lo).to(tl.int64)
        start2 = start[:, None] + zi
        count2 = count[:, None] + zi
        first = rows[:, None].to(tl.int64) * m_h + zi
        want = tl.where(valid, col, -1)[None, :]
        for j in range(0, tl.max(count, 0)):
            has = j < count2
            at = tl.where(has, start2 + j, 0)
            p = tl.load(opos_ptr + at)
            v = tl.load(obits_ptr + at).to(tl.float16, bitcast=True).to(tl.float32)
            q = tl.where(has & (p - first == want), v, q)
    return q


@triton.jit(do_not_specialize=["PB", "N", "norm", "has_out"])
def _decode_kernel(
    codes_ptr, PB, sbits_ptr, sexp_ptr, rstart_ptr, opos_ptr, obits_ptr,
    rows_ptr, m_ptr, rb_ptr, col_ptr, bits_ptr, width_ptr, rnorm_ptr, signs_ptr, byte_ptr, shift_ptr,
    cent_ptr, s_ptr, mean_ptr,
    out_ptr, so_h, so_n, so_d,
    N, D, norm, has_out,
    MP: tl.constexpr, LOG_MP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    n_h = tl.minimum(tl.load(rows_ptr + h), N)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < n_h
    row_off = h * N + rows
    slots = tl.arange(0, MP)
    hs = h * MP + slots
    valid = tl.load(bits_ptr + hs) > 0
    q = row_centroids(codes_ptr + h * PB, rstart_ptr + h * (N + 1), opos_ptr, obits_ptr, m_ptr, rb_ptr,
                      col_ptr, bits_ptr, byte_ptr, shift_ptr, cent_ptr, h, rows, rmask, has_out, MP)
    g = tl.full((BN,), 1.0, tl.float32)
    if norm != 0:
        g = from_scaled_f16(tl.load(sbits_ptr + row_off, mask=rmask, other=0), tl.load(sexp_ptr + h))
    # u^ = s * H(q * (g^ r)) per sub-band: the factor in f32 first, as Rust.
    f = g[:, None] * tl.load(rnorm_ptr + hs)[None, :]
    y = tl.where(valid[None, :], q * f, 0.0)
    y = band_hadamard(y, tl.load(width_ptr + hs)[None, :], BN, MP, LOG_MP)
    u = y * tl.load(signs_ptr + hs)[None, :]
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < D
        st = tl.load(s_ptr + h * MP * D + slots[:, None] * D + dd[None, :], mask=dmask[None, :], other=0.0)
        mu = tl.load(mean_ptr + h * D + dd, mask=dmask, other=0.0)
        o = tl.dot(u, st, input_precision="ieee") + mu[None, :]
        tl.store(out_ptr + h * so_h + rows[:, None].to(tl.int64) * so_n + dd[None, :].to(tl.int64) * so_d,
                 o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def _settings(n: int, mp: int, d: int) -> Dict[str, int]:
    if is_interpreter():
        return {"BN": max(16, min(256, next_pow2(n))), "BD": max(16, min(256, next_pow2(d))), "num_warps": 4}
    bn = 64 if mp <= 64 else (32 if mp <= 128 else 16)
    return {"BN": bn, "BD": 64 if mp <= 128 else 32, "num_warps": 4 if mp <= 64 else 8}


def decode_calibrated(
    codes: Mapping[str, torch.Tensor],
    batch: CalibrationBatch,
    rows: RowsLike = None,
    out_dtype: torch.dtype = torch.float32,
    out: Optional[torch.Tensor] = None,
    n: Optional[int] = None,
) -> torch.Tensor:
    """Decodes ``H`` heads in one launch on the batch's device.

    ``codes``: the dict of :func:`~kakeyaturbo.kernels.encode_calibrated` (or
    :func:`~kakeyaturbo.kernels.stack_calibrated_parts`): ``codes`` uint8 ``[H, PB]`` with
    ``PB >= N * max_row_bytes`` (head ``i``'s rows of ``row_bytes_i`` bytes from its start), with
    ``norm`` ``scale_bits`` int16 ``[H, N]`` and ``scale_exp`` int32 ``[H]``, and
    ``outlier_ptr`` int64 ``[H + 1]``, ``outlier_pos`` int64 ``[M]`` (flat ``row * m_i + j``,
    ascending within each head), ``outlier_bits`` int16 ``[M]``; other entries are not read.
    ``batch``: the heads' calibrations. ``rows``: rows per head (host sequence or int32 ``[H]``
    tensor, default all N). ``n``: N, an int >= 1 (default: from ``scale_bits``, else from
    ``out``, else ``PB / max_row_bytes``, which must then divide evenly). ``out_dtype``: float32
    or bfloat16; ``out``: an optional ``[H, N, D]`` tensor of that dtype (any strides, e.g. a
    view into a KV cache, no element repeated) to write into.
    Returns ``[H, N, D]``; rows past a head's count are not written. Raises ValueError on bad
    shapes, dtypes or devices. Codes in host memory (CPU tensors) are checked as
    :meth:`kakeyaturbo.CalibratedCodec.decode_parts` checks them (InvalidParameterError for a
    ``scale_exp`` outside -126..=127, CorruptDataError for a non-finite fp16 value, an
    ``outlier_ptr`` that does not run from 0 to ``M``, or outlier positions out of range or not
    ascending); codes on a GPU are trusted (checking them would read the device)."""
    batch.validate()
    dev, h, d = batch.device, batch.num_heads, batch.dim
    need = ("codes", "outlier_ptr", "outlier_pos", "outlier_bits") + (("scale_bits", "scale_exp") if batch.norm else ())
    if not isinstance(codes, Mapping) or any(not isinstance(codes.get(k), torch.Tensor) for k in need):
        raise TypeError(f"codes must be a dict of tensors {', '.join(need)} (as encode_calibrated returns it), "
                        f"got {type(codes).__name__}")
    packed = codes["codes"]
    if packed.ndim != 2 or packed.shape[0] != h or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise InvalidInputError(f"codes must be contiguous uint8 [{h}, PB], got {packed.dtype} "
                                f"{tuple(packed.shape)}")
    check_device("codes", packed, dev)
    if n is None:
        if batch.norm:
            n = int(codes["scale_bits"].shape[1])
        elif out is not None:
            n = int(out.shape[1])
        else:
            n, extra = divmod(packed.shape[1], batch.max_row_bytes)
            if extra:
                raise InvalidInputError(f"codes hold {packed.shape[1]} bytes per head, not whole rows of "
                                        f"{batch.max_row_bytes} bytes: pass n")
    n = _checks.integer(n, "n", 1)
    if packed.shape[1] < n * batch.max_row_bytes:
        raise InvalidInputError(f"codes must hold >= {n} x {batch.max_row_bytes} bytes per head, "
                                f"got {packed.shape[1]}")
    want: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {"outlier_ptr": ((h + 1,), torch.int64)}
    if batch.norm:
        want.update(scale_bits=((h, n), torch.int16), scale_exp=((h,), torch.int32))
    for name, (shape, dtype) in want.items():
        t = codes[name]
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise InvalidInputError(f"{name} must be contiguous {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
        check_device(name, t, dev)
    opos, obits = codes["outlier_pos"], codes["outlier_bits"]
    if opos.ndim != 1 or opos.dtype != torch.int64 or obits.shape != opos.shape or obits.dtype != torch.int16:
        raise InvalidInputError("outlier_pos must be int64 [M] and outlier_bits int16 [M]")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise InvalidInputError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    if out is None:
        out = empty((h, n, d), out_dtype, dev)
    else:
        check_out(out, (h, n, d), out_dtype, dev)
    rows_t = rows_tensor(rows, h, n, dev)
    if on_host(packed):
        _check_host_codes(codes, batch, rows_t, n)
    has_out = opos.numel() > 0
    if has_out:
        rstart = row_starts(codes, batch.m, n, batch.max_m)
    else:
        # Never read without outliers; typed like the real arguments (one compiled kernel).
        rstart = placeholder(torch.int64, dev)
        opos, obits = rstart, placeholder(torch.int16, dev)
    i16, i32 = placeholder(torch.int16, dev), placeholder(torch.int32, dev)
    mp = batch.slots
    s = _settings(n, mp, d)
    _decode_kernel[(triton.cdiv(n, s["BN"]), h)](
        packed, packed.shape[1], codes.get("scale_bits", i16), codes.get("scale_exp", i32),
        rstart, opos, obits,
        rows_t, batch.m, batch.row_bytes, batch.col, batch.bits, batch.width, batch.rnorm, batch.signs,
        batch.byte, batch.shift, batch.centroids, batch.synthesis, batch.mean,
        out, out.stride(0), out.stride(1), out.stride(2),
        n, d, int(batch.norm), int(has_out),
        MP=mp, LOG_MP=ceil_log2(mp), BN=s["BN"], BD=s["BD"],
        num_warps=s["num_warps"], enable_fp_fusion=False,
    )
    return out


def _check_host_codes(codes: Mapping[str, torch.Tensor], batch: CalibrationBatch, rows: torch.Tensor,
                      n: int) -> None:
    """The values of codes in host memory, in the live rows of each head, as Rust checks a
    head's parts."""
    if batch.norm:
        live = torch.arange(n)[None, :] < rows[:, None].to(torch.int64)
        bad = live & f16_nonfinite(codes["scale_bits"])
        if bool(bad.any()):
            raise CorruptDataError(f"head {int(torch.nonzero(bad)[0, 0])}: scale_bits holds a non-finite fp16 value")
        check_exponents("scale_exp", codes["scale_exp"], "head")
    cells = (n * batch.m.to(torch.int64)).tolist()  # rows past a count may hold some: unread
    check_outlier_lists(codes, cells, "head")
