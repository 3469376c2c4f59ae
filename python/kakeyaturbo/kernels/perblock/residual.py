"""Encode launch 2 of 4: stage 3b, ``t`` stored and the residual's norm.

Fused: the block's shared exponent of ``t`` (each program reduces ``max |t|`` of its block
from launch 1's per-row values), the fp16 rounding of ``t``, ``r = c - t^ centre_seg`` with
the *rounded* ``t^`` (SPEC section 1), and ``|r|``. The launch ends here because the norm is
rounded with a block-wide exponent too. ``r`` is not written: launch 3 forms it again from
``c`` (the same arithmetic, so the same bits), which saves a write and a read of the scratch.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import triton
import triton.language as tl

from .._common import (
    block_absmax,
    empty,
    from_scaled_f16,
    is_interpreter,
    next_pow2,
    residual_tile,
    shared_exponent,
    to_scaled_f16,
)
from .skeleton import SkeletonBatch
from ...errors import InvalidInputError


@triton.jit(do_not_specialize=["N"])
def _residual_kernel(
    c_ptr, seg_ptr, traw_ptr,
    centers_ptr, sc_b, k_ptr, rows_ptr,
    tbits_ptr, texp_ptr, norm_ptr,
    N,
    W: tl.constexpr, BN: tl.constexpr, RB: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_b = tl.minimum(tl.load(rows_ptr + b), N)
    e = shared_exponent(block_absmax(traw_ptr + b * N, n_b, RB))
    tl.store(texp_ptr + b, e, mask=tile == 0)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < n_b
    row_off = b * N + rows
    cols = tl.arange(0, W)
    h = to_scaled_f16(tl.load(traw_ptr + row_off, mask=rmask, other=0.0), e)
    tl.store(tbits_ptr + row_off, h, mask=rmask)
    seg = tl.load(seg_ptr + row_off, mask=rmask, other=0)
    t_hat = from_scaled_f16(h, e)
    r = residual_tile(c_ptr, centers_ptr + b * sc_b, seg, tl.load(k_ptr + b), t_hat, row_off, rmask, cols, W)
    tl.store(norm_ptr + row_off, tl.math.sqrt_rn(tl.sum(r * r, 1)), mask=rmask)


def _settings(n: int, w: int) -> Dict[str, int]:
    if is_interpreter():
        return {"BN": max(16, min(256, next_pow2(n))), "RB": max(16, min(1024, next_pow2(n))), "num_warps": 4}
    return {"BN": max(16, 4096 // w), "RB": 512, "num_warps": 4}


def _launch(c, seg, traw, skel: SkeletonBatch, rows, tbits, texp, norm) -> None:
    b, n, w = c.shape
    s = _settings(n, w)
    _residual_kernel[(triton.cdiv(n, s["BN"]), b)](
        c, seg, traw,
        skel.centers, skel.centers.stride(0), skel.k, rows,
        tbits, texp, norm,
        n,
        W=w, BN=s["BN"], RB=s["RB"],
        num_warps=s["num_warps"], enable_fp_fusion=False,
    )


def residuals(
    c: torch.Tensor, seg: torch.Tensor, traw: torch.Tensor, skel: SkeletonBatch, rows: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 3b for a batch: rounds ``t`` and measures ``r = c - t^ centre_seg``.

    ``c``: float32 ``[B, N, W]``; ``seg``: int32 ``[B, N]``; ``traw``: float32 ``[B, N]`` (from
    :func:`~kakeyaturbo.kernels.perblock.project.project_assign`); ``rows``: int32 ``[B]``.
    Returns ``t_bits`` int16 ``[B, N]`` (fp16 bit patterns), ``t_exp`` int32 ``[B]`` and the
    unrounded ``|r|`` float32 ``[B, N]``. Raises ValueError on bad shapes."""
    b, n, w = c.shape
    want = {
        "c": (c, (b, n, w), torch.float32),
        "seg": (seg, (b, n), torch.int32),
        "traw": (traw, (b, n), torch.float32),
        "rows": (rows, (b,), torch.int32),
    }
    for name, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous() or t.device != c.device:
            raise InvalidInputError(f"{name} must be contiguous {dtype} {shape} on {c.device}")
    if b != skel.num_blocks or w != skel.width:
        raise InvalidInputError(
            f"c [{b}, {n}, {w}] does not fit the skeleton ({skel.num_blocks} blocks, W={skel.width})"
        )
    tbits = empty((b, n), torch.int16, c.device)
    texp = empty((b,), torch.int32, c.device)
    norm = empty((b, n), torch.float32, c.device)
    _launch(c, seg, traw, skel, rows, tbits, texp, norm)
    return tbits, texp, norm
