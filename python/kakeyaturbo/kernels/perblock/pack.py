"""Encode launch 4 of 4: stage 5c, bit packing, and the stored ``inner_product`` gain.

Packing: index ``i`` of a block occupies stream bits ``[i*b, (i+1)*b)``, LSB first, row-major
over ``n x d_eff``. Each program owns ``QB`` whole bytes of one block's stream and builds each
byte by gathering the (at most 8) indices that touch it from the index buffer: no atomics, and
the tile depends on the bit width only (one compiled kernel per width, whatever ``d_eff``).
The gain of ``inner_product`` is rounded here with its block-wide exponent because this is the
first launch after the gain's block-wide reduction: the same programs also cover ``BN`` rows
each, which saves a launch (for ``mse``/``linf`` the stored scale is the norm of launch 3).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._common import (
    block_absmax,
    empty,
    is_interpreter,
    next_pow2,
    placeholder,
    shared_exponent,
    to_scaled_f16,
)
from ...errors import InvalidInputError

#: Indices that can touch one byte, rounded up to a power of two, per bit width.
_PER_BYTE = {1: 8, 2: 4, 3: 4, 4: 2}


@triton.jit(do_not_specialize=["PB", "N", "W", "ip"])
def _pack_kernel(
    codes_ptr, rows_ptr, d_eff_ptr, packed_ptr, PB,
    gain_ptr, sbits_ptr, sexp_ptr,
    N, W, ip,
    BN: tl.constexpr, BITS: tl.constexpr, QB: tl.constexpr, EP: tl.constexpr, RB: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_b = tl.minimum(tl.load(rows_ptr + b), N)
    de = tl.load(d_eff_ptr + b).to(tl.int64)
    if ip != 0:
        e = shared_exponent(block_absmax(gain_ptr + b * N, n_b, RB))
        tl.store(sexp_ptr + b, e, mask=tile == 0)
        rows = tile * BN + tl.arange(0, BN)
        rmask = rows < n_b
        g = tl.load(gain_ptr + b * N + rows, mask=rmask, other=0.0)
        tl.store(sbits_ptr + b * N + rows, to_scaled_f16(g, e), mask=rmask)
    count = n_b * de
    q = tile.to(tl.int64) * QB + tl.arange(0, QB)
    qmask = q < (count * BITS + 7) // 8
    # The indices touching byte q start at floor(8q / b); index el sits at bit el*b - 8q.
    el = ((q * 8) // BITS)[:, None] + tl.arange(0, EP)[None, :]
    shift = el * BITS - q[:, None] * 8
    emask = qmask[:, None] & (el < count) & (shift < 8)
    row = el // de
    v = tl.load(codes_ptr + (b * N + row) * W + (el - row * de), mask=emask, other=0).to(tl.int32)
    v = v & ((1 << BITS) - 1)
    left = v << tl.maximum(shift, 0).to(tl.int32)
    part = tl.where(shift >= 0, left, v >> tl.maximum(-shift, 0).to(tl.int32))
    byte = tl.sum(tl.where(emask, part & 0xFF, 0), 1)
    tl.store(packed_ptr + b * PB + q, byte.to(tl.uint8), mask=qmask)


def _settings(n: int, bits: int) -> Dict[str, int]:
    if is_interpreter():
        return {"QB": 8192, "BN": max(16, min(1024, next_pow2(n))), "RB": max(16, min(1024, next_pow2(n))),
                "num_warps": 4}
    return {"QB": 512, "BN": 128, "RB": 512, "num_warps": 4}


def packed_bytes(rows: int, d_eff: int, bits: int) -> int:
    """Bytes of ``rows * d_eff`` packed indices of ``bits`` bits."""
    return (rows * d_eff * bits + 7) // 8


def _launch(codes, rows, skel_d_eff, packed, gain, sbits, sexp, bits: int, ip: bool) -> None:
    b, n, w = codes.shape
    s = _settings(n, bits)
    tiles = max(triton.cdiv(packed.shape[1], s["QB"]), triton.cdiv(n, s["BN"]) if ip else 1)
    _pack_kernel[(tiles, b)](
        codes, rows, skel_d_eff, packed, packed.shape[1],
        gain, sbits, sexp,
        n, w, int(ip),
        BN=s["BN"], BITS=bits, QB=s["QB"], EP=_PER_BYTE[bits], RB=s["RB"],
        num_warps=s["num_warps"], enable_fp_fusion=False,
    )


def pack(
    codes: torch.Tensor,
    d_eff: torch.Tensor,
    rows: torch.Tensor,
    bits: int,
    max_d_eff: int,
    gain: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Packs each block's ``rows x d_eff`` indices LSB-first and, given the unrounded
    ``inner_product`` gains, rounds them to the stored scale.

    ``codes``: uint8 ``[B, N, W]`` (indices ``< 2**bits``, columns past ``d_eff`` ignored);
    ``d_eff``, ``rows``: int32 ``[B]``; ``max_d_eff``: host int >= every ``d_eff``; ``gain``:
    float32 ``[B, N]`` or None. Returns ``packed`` uint8 ``[B, ceil(N max_d_eff bits / 8)]`` (block
    ``i`` uses its first ``ceil(rows_i d_eff_i bits / 8)`` bytes, the tail bits zero), and
    ``norm_bits`` int16 ``[B, N]``, ``norm_exp`` int32 ``[B]`` of the gain (None without it).
    Raises ValueError on bad shapes or bit widths."""
    if not 1 <= bits <= 4:
        raise InvalidInputError(f"bits must be in 1..4, got {bits}")
    if codes.ndim != 3 or codes.dtype != torch.uint8 or not codes.is_contiguous():
        raise InvalidInputError(f"codes must be contiguous uint8 [B, N, W], got {codes.dtype} {tuple(codes.shape)}")
    b, n, w = codes.shape
    if not 1 <= max_d_eff <= w:
        raise InvalidInputError(f"max_d_eff={max_d_eff} out of range for W={w}")
    for name, t in (("d_eff", d_eff), ("rows", rows)):
        if t.shape != (b,) or t.dtype != torch.int32 or t.device != codes.device:
            raise InvalidInputError(f"{name} must be int32 [{b}] on {codes.device}")
    if gain is not None and (gain.shape != (b, n) or gain.dtype != torch.float32 or not gain.is_contiguous()):
        raise InvalidInputError(f"gain must be contiguous float32 [{b}, {n}]")
    dev = codes.device
    packed = empty((b, packed_bytes(n, max_d_eff, bits)), torch.uint8, dev)
    sbits = empty((b, n), torch.int16, dev) if gain is not None else None
    sexp = empty((b,), torch.int32, dev) if gain is not None else None
    # Without a gain the ip branch is skipped and these pointers are never read.
    _launch(codes, rows, d_eff, packed,
            placeholder(torch.float32, dev) if gain is None else gain,
            placeholder(torch.int16, dev) if sbits is None else sbits,
            placeholder(torch.int32, dev) if sexp is None else sexp, bits, gain is not None)
    return packed, sbits, sexp
