"""Calibrated encode, launch 1 of 3 (only with ``norm``): the per-row rms scale.

Fused: ``u = A' (x - mean)`` for a tile of rows (``x`` read once, ``u`` kept in registers),
``g = sqrt(sum u^2 / m)`` with the sum of squares in f64 and the result rounded to f32 as in
Rust, and the tile's ``max g``. The launch ends here because ``g`` is stored as fp16 with an
exponent shared by the whole head (all its rows): launch 2 reduces the per-tile maxima written
here (a few hundred values per head, no atomics, deterministic). ``u`` is *not* written out:
launch 2 projects again from ``x``, which reads ``2 D`` (bf16) or ``4 D`` (f32) bytes per row
instead of writing and reading ``4 m`` bytes of ``u`` twice.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import triton
import triton.language as tl

from .._common import empty, is_interpreter, next_pow2
from .batch import CalibrationBatch
from ...errors import InvalidInputError


@triton.jit
def project_tile(x_ptr, sx_n, sx_d, mean_ptr, a_ptr, rows, rmask, slots, D,
                 MP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """``u = (x - mean) A'^T`` for a tile of rows, ``[BN, MP]`` float32 in slot order.

    ``x_ptr``/``mean_ptr``/``a_ptr`` point at the head's rows ``[*, D]`` (strides ``sx_n``,
    ``sx_d``; bf16 is widened on load), mean ``[D]`` and ``A'`` ``[MP, D]``. The difference is
    formed in f32 first (as Rust does), then an IEEE f32 product tiled over ``D``. Padding
    slots have zero rows in ``A'``, so their ``u`` is 0."""
    acc = tl.zeros((BN, MP), tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < D
        xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx_n + dd[None, :].to(tl.int64) * sx_d,
                     mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        mu = tl.load(mean_ptr + dd, mask=dmask, other=0.0)
        xc = tl.where(dmask[None, :], xt - mu[None, :], 0.0)
        at = tl.load(a_ptr + slots[None, :] * D + dd[:, None], mask=dmask[:, None], other=0.0)
        acc = tl.dot(xc, at, acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["N", "T"])
def _rms_kernel(
    x_ptr, sx_h, sx_n, sx_d, mean_ptr, a_ptr, m_ptr, rows_ptr,
    g_ptr, tmax_ptr,
    N, D, T,
    MP: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    n_h = tl.minimum(tl.load(rows_ptr + h), N)
    m_h = tl.load(m_ptr + h)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < n_h
    slots = tl.arange(0, MP)
    u = project_tile(x_ptr + h * sx_h, sx_n, sx_d, mean_ptr + h * D, a_ptr + h * MP * D,
                     rows, rmask, slots, D, MP, BN, BD)
    # Squares of f32 values are exact in f64; the sum and the division by m in f64, as Rust.
    ud = u.to(tl.float64)
    ms = tl.sum(ud * ud, 1) / m_h.to(tl.float64)
    g = tl.where(rmask, tl.sqrt(ms).to(tl.float32), 0.0)
    tl.store(g_ptr + h * N + rows, g, mask=rmask)
    tl.store(tmax_ptr + h * T + tile, tl.max(g, 0))


def settings(n: int, mp: int, d: int) -> Dict[str, int]:
    """Tile sizes of the projection, shared by launches 1 and 2 (the same tiles give the same
    ``u``): rows per program ``BN``, the reduction chunk ``BD`` over D."""
    if is_interpreter():
        # Every op is a numpy call per program: few large programs are fastest.
        return {"BN": max(16, min(256, next_pow2(n))), "BD": max(16, min(256, next_pow2(d))), "num_warps": 4}
    bn = 64 if mp <= 64 else (32 if mp <= 128 else 16)
    return {"BN": bn, "BD": 64 if mp <= 128 else 32, "num_warps": 4 if mp <= 64 else 8}


def rms_scales(x: torch.Tensor, batch: CalibrationBatch,
               rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch 1: the unrounded rms scale of every row and the per-tile maxima.

    ``x``: float32 or bfloat16 ``[H, N, D]`` (any strides, checked by the caller); ``batch``: the
    heads' calibrations; ``rows``: int32 ``[H]`` (1..N each). Returns ``g`` float32 ``[H, N]``
    (rows past a head's count not written) and ``tile_max`` float32 ``[H, T]``,
    ``T = ceil(N / BN)`` with :func:`settings`' ``BN``. Raises ValueError on bad shapes."""
    h, n, d = x.shape
    if h != batch.num_heads or d != batch.dim or rows.shape != (h,) or rows.dtype != torch.int32:
        raise InvalidInputError(f"x [{h}, {n}, {d}] / rows do not fit a batch of {batch.num_heads} heads, "
                                f"D={batch.dim}")
    s = settings(n, batch.slots, d)
    tiles = triton.cdiv(n, s["BN"])
    g = empty((h, n), torch.float32, x.device)
    tmax = empty((h, tiles), torch.float32, x.device)
    _rms_kernel[(tiles, h)](
        x, x.stride(0), x.stride(1), x.stride(2), batch.mean, batch.analysis, batch.m, rows,
        g, tmax,
        n, d, tiles,
        MP=batch.slots, BN=s["BN"], BD=s["BD"],
        num_warps=s["num_warps"], enable_fp_fusion=False,
    )
    return g, tmax
