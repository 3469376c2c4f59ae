"""Encode launch 1 of 4: stages 2 and 3a, projection and assignment.

Fused: ``c = U (x - mu)``, ``g = c C^T``, ``seg = argmax |g|`` and ``t = g[seg]`` in one pass
over each tile of rows, so ``x`` is read once and ``g`` never leaves registers. The launch ends
here because ``t`` is rounded with an exponent shared by the whole block (a block-wide max),
which the next launch reads. ``c`` goes to a float32 scratch that launch 2 overwrites with
the residual.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from ...errors import InvalidInputError
from .._common import check_device, empty, is_interpreter, next_pow2
from .skeleton import SkeletonBatch


@triton.jit(do_not_specialize=["N"])
def _project_assign_kernel(
    x_ptr, sx_b, sx_n, sx_d,
    mean_ptr, sm_b,
    basis_ptr, sb_b,
    centers_ptr, sc_b,
    d_eff_ptr, k_ptr, rows_ptr,
    c_ptr, seg_ptr, traw_ptr,
    N, D,
    W: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    n_b = tl.minimum(tl.load(rows_ptr + b), N)
    k_b = tl.load(k_ptr + b)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < n_b
    cols = tl.arange(0, W)
    # Stage 2: xc = x - mu in f32 first (block::project), then the product, in IEEE f32.
    acc = tl.zeros((BN, W), tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < D
        xt = tl.load(
            x_ptr + b * sx_b + rows[:, None].to(tl.int64) * sx_n + dd[None, :].to(tl.int64) * sx_d,
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        mu = tl.load(mean_ptr + b * sm_b + dd, mask=dmask, other=0.0)
        xc = tl.where(dmask[None, :], xt - mu[None, :], 0.0)
        ut = tl.load(basis_ptr + b * sb_b + cols[None, :] * D + dd[:, None], mask=dmask[:, None], other=0.0)
        acc = tl.dot(xc, ut, acc, input_precision="ieee")
    # Stage 3a: the first centre of largest |<c, centre>| and its projection t (unrounded).
    kc = tl.arange(0, KP)
    ct = tl.load(centers_ptr + b * sc_b + kc[None, :] * W + cols[:, None])
    g = tl.dot(acc, ct, input_precision="ieee")
    ag = tl.where(kc[None, :] < k_b, tl.abs(g), -1.0)
    best = tl.max(ag, 1)
    seg = tl.min(tl.where(ag == best[:, None], kc[None, :], KP), 1)
    seg = tl.minimum(seg, k_b - 1)
    t = tl.sum(tl.where(kc[None, :] == seg[:, None], g, 0.0), 1)
    row_off = b * N + rows
    tl.store(c_ptr + row_off[:, None] * W + cols[None, :], acc, mask=rmask[:, None])
    tl.store(seg_ptr + row_off, seg, mask=rmask)
    tl.store(traw_ptr + row_off, t, mask=rmask)


def _settings(n: int, w: int, d: int) -> Dict[str, int]:
    """Tile sizes: rows per program ``BN`` and the reduction chunk ``BD`` over D."""
    if is_interpreter():
        # Every op is a numpy call per program: few large programs are fastest.
        return {"BN": max(16, min(256, next_pow2(n))), "BD": max(16, min(256, next_pow2(d))), "num_warps": 4}
    bn = 64 if w <= 64 else (32 if w <= 128 else 16)
    return {"BN": bn, "BD": 64 if w <= 128 else 32, "num_warps": 4 if w <= 64 else 8}


def _launch(x: torch.Tensor, skel: SkeletonBatch, rows: torch.Tensor, c, seg, traw) -> None:
    b, n, d = x.shape
    w, kp = skel.width, int(skel.centers.shape[1])
    s = _settings(n, w, d)
    grid = (triton.cdiv(n, s["BN"]), b)
    _project_assign_kernel[grid](
        x, x.stride(0), x.stride(1), x.stride(2),
        skel.mean, skel.mean.stride(0),
        skel.basis, skel.basis.stride(0),
        skel.centers, skel.centers.stride(0),
        skel.d_eff, skel.k, rows,
        c, seg, traw,
        n, d,
        W=w, KP=kp, BN=s["BN"], BD=s["BD"],
        num_warps=s["num_warps"], enable_fp_fusion=False,
    )


def project_assign(
    x: torch.Tensor, skel: SkeletonBatch, rows: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 2-3a for a batch of blocks.

    ``x``: float32 or bfloat16 ``[B, N, D]`` (any strides) on the skeleton's device;
    ``skel``: a :class:`SkeletonBatch` of ``B`` blocks, ``W`` its padded width;
    ``rows``: int32 ``[B]``, rows of each block (``1..N``; default ``N``; not range-checked on
    the device). Returns ``c`` float32 ``[B, N, W]`` (zero beyond ``d_eff``), ``seg`` int32
    ``[B, N]`` and the unrounded ``t`` float32 ``[B, N]``; rows past a block's count are not
    written. Raises ValueError on bad shapes, dtypes or devices.
    """
    b, n, d = check_input(x, skel)
    if rows is None:
        rows = torch.full((b,), n, dtype=torch.int32, device=x.device)
    elif rows.shape != (b,) or rows.dtype != torch.int32:
        raise InvalidInputError(f"rows must be int32 [{b}], got {rows.dtype} {tuple(rows.shape)}")
    check_device("rows", rows, x.device)
    c = empty((b, n, skel.width), torch.float32, x.device)
    seg = empty((b, n), torch.int32, x.device)
    traw = empty((b, n), torch.float32, x.device)
    _launch(x, skel, rows, c, seg, traw)
    return c, seg, traw


def check_input(x: torch.Tensor, skel: SkeletonBatch) -> Tuple[int, int, int]:
    """Checks ``x`` against the skeleton; returns ``(B, N, D)``. Raises ValueError."""
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        raise InvalidInputError(f"x must be a [B, N, D] tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise InvalidInputError(f"x must be float32 or bfloat16, got {x.dtype}")
    b, n, d = x.shape
    if n < 1:
        raise InvalidInputError(f"x [{b}, {n}, {d}] needs at least one row per block")
    if b != skel.num_blocks or d != skel.dim:
        raise InvalidInputError(
            f"x [{b}, {n}, {d}] does not fit a skeleton of {skel.num_blocks} blocks, D={skel.dim}"
        )
    check_device("x", x, skel.device)
    skel.validate()
    return b, n, d
