"""Calibrated encode, launch 3 of 3 (only for ``inner_product``): the stored gain.

The least-squares gain ``g^ <z, q> / <q, q>`` of every row (launch 2) is stored as fp16 with an
exponent shared by the whole head: each program reduces launch 2's per-tile maxima of
``|gain|`` and rounds its rows. A separate launch because the exponent needs every row of
the head; it reads and writes 6 bytes per row.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import triton
import triton.language as tl

from .._common import block_absmax, empty, is_interpreter, next_pow2, shared_exponent, to_scaled_f16
from ...errors import InvalidInputError


@triton.jit(do_not_specialize=["N", "T"])
def _gain_kernel(gain_ptr, gmax_ptr, rows_ptr, sbits_ptr, sexp_ptr, N, T,
                 BN: tl.constexpr, RB: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    n_h = tl.minimum(tl.load(rows_ptr + h), N)
    e = shared_exponent(block_absmax(gmax_ptr + h * T, T, RB))
    tl.store(sexp_ptr + h, e, mask=tile == 0)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < n_h
    g = tl.load(gain_ptr + h * N + rows, mask=rmask, other=0.0)
    tl.store(sbits_ptr + h * N + rows, to_scaled_f16(g, e), mask=rmask)


def _settings(n: int) -> Dict[str, int]:
    if is_interpreter():
        return {"BN": max(16, min(4096, next_pow2(n))), "RB": 1024, "num_warps": 4}
    return {"BN": 1024, "RB": 256, "num_warps": 4}


def round_gains(gain: torch.Tensor, gain_max: torch.Tensor,
                rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stores the gains: ``gain`` float32 ``[H, N]``, ``gain_max`` float32 ``[H, T]`` (maxima of
    ``|gain|`` over row tiles, every tile written), ``rows`` int32 ``[H]``. Returns
    ``scale_bits`` int16 ``[H, N]`` (fp16 bit patterns) and ``scale_exp`` int32 ``[H]``.
    Raises ValueError on bad shapes."""
    h, n = gain.shape
    if (gain.dtype != torch.float32 or gain_max.dtype != torch.float32 or gain_max.shape[0] != h
            or not gain.is_contiguous() or not gain_max.is_contiguous() or rows.shape != (h,)):
        raise InvalidInputError("gain [H, N], gain_max [H, T] (float32, contiguous) and rows int32 [H] expected")
    s = _settings(n)
    sbits = empty((h, n), torch.int16, gain.device)
    sexp = empty((h,), torch.int32, gain.device)
    _gain_kernel[(triton.cdiv(n, s["BN"]), h)](
        gain, gain_max, rows, sbits, sexp, n, gain_max.shape[1],
        BN=s["BN"], RB=s["RB"], num_warps=s["num_warps"], enable_fp_fusion=False,
    )
    return sbits, sexp
