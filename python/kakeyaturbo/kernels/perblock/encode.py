"""Batched encode: stages 2-5 of many blocks (and heads) in four launches.

1. ``project.py``: project, assign, the unrounded ``t``.
2. ``residual.py``: ``t`` exponent and fp16, the residual with the rounded ``t``, its norm.
3. ``quantize.py``: the residual again, norm exponent and fp16, signs and band Hadamard,
   scale, Lloyd-Max indices, outlier flags and values, the ``inner_product`` gain.
4. ``pack.py``: bit packing, the gain's exponent and fp16.

The cuts sit exactly at the block-wide reductions the format needs (the shared fp16 exponents
of ``t``, the norm and the gain): a launch boundary is the one grid-wide barrier that needs no
cooperative launch, and each later launch re-reduces its block's per-row maxima on device. No
value goes to the host between launches. With an outlier threshold, the sparse outlier list
(ascending flat positions per block) is compacted at the end with ``torch.nonzero``, the one
step whose output size depends on the data (it synchronises).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .._common import RowsLike, check_finite_rows, rows_tensor
from .pack import pack
from .project import check_input, project_assign
from .quantize import quantize
from .residual import residuals
from .skeleton import SkeletonBatch


def encode_blocks(x: torch.Tensor, skel: SkeletonBatch, rows: RowsLike = None) -> Dict[str, torch.Tensor]:
    """Stages 2-5 of ``B`` blocks against their skeletons, on the skeleton's device.

    ``x``: float32 or bfloat16 ``[B, N, D]``, any strides (e.g. a layer's K ``[H, T, D]`` viewed
    as ``[H * T / N, N, D]``); bfloat16 is widened to f32 on load. ``skel``: a
    :class:`SkeletonBatch` of ``B`` blocks with padded width ``W``. ``rows``: rows of each block
    (1..N), a host sequence or an int32 ``[B]`` tensor; default all ``N``.

    Returns a dict (names as in the extension's parts, batched):

    - ``seg_id`` int32 ``[B, N]``
    - ``t_bits`` int16 ``[B, N]`` (fp16 bit patterns), ``t_exp`` int32 ``[B]``
    - ``norm_bits`` int16 ``[B, N]``, ``norm_exp`` int32 ``[B]`` (the stored scale: the norm,
      or the least-squares gain for ``inner_product``)
    - ``residual_codes`` uint8 ``[B, N, W]`` (0 beyond ``d_eff``)
    - ``residual_packed`` uint8 ``[B, ceil(N * max_d_eff * b / 8)]``; block ``i`` uses its
      first ``ceil(rows_i * d_eff_i * b / 8)`` bytes
    - ``outlier_ptr`` int64 ``[B + 1]``, ``outlier_pos`` int64 ``[M]`` (flat ``row * d_eff +
      col``, ascending within each block), ``outlier_bits`` int16 ``[M]``: block ``i`` owns
      entries ``outlier_ptr[i]:outlier_ptr[i+1]`` (all empty without a threshold)

    Entries of rows past a block's count are unspecified. Raises ValueError on bad shapes,
    dtypes, devices or row counts, InvalidInputError (a ValueError) on a non-finite value in a
    block's rows (one reduction over ``x``, before any launch).
    """
    b, n, _ = check_input(x, skel)
    rows_t = rows_tensor(rows, b, n, x.device)
    check_finite_rows("x", x, rows_t, "block")
    c, seg, traw = project_assign(x, skel, rows_t)
    tbits, texp, norm = residuals(c, seg, traw, skel, rows_t)
    nbits, nexp, codes, oflag, oval, gain = quantize(c, seg, tbits, texp, norm, skel, rows_t)
    packed, sbits, sexp = pack(codes, skel.d_eff, rows_t, skel.bit_width, skel.max_d_eff, gain)
    if sbits is not None and sexp is not None:
        nbits, nexp = sbits, sexp
    out = {
        "seg_id": seg,
        "t_bits": tbits,
        "t_exp": texp,
        "norm_bits": nbits,
        "norm_exp": nexp,
        "residual_codes": codes,
        "residual_packed": packed,
    }
    out.update(compact_outliers(oflag, oval, skel.d_eff, rows_t))
    return out


def compact_outliers(
    oflag: Optional[torch.Tensor], oval: Optional[torch.Tensor], d_eff: torch.Tensor, rows: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """The sparse outlier lists from dense flags: ``oflag`` uint8 ``[B, N, W]``, ``oval`` int16
    ``[B, N, W]`` (None: no outliers), ``d_eff``/``rows`` int32 ``[B]``. Returns
    ``outlier_ptr`` int64 ``[B + 1]``, ``outlier_pos`` int64 ``[M]``, ``outlier_bits`` int16
    ``[M]``, in ascending flat position within each block."""
    b = d_eff.shape[0]
    dev = d_eff.device
    if oflag is None or oval is None:
        return {
            "outlier_ptr": torch.zeros(b + 1, dtype=torch.int64, device=dev),
            "outlier_pos": torch.zeros(0, dtype=torch.int64, device=dev),
            "outlier_bits": torch.zeros(0, dtype=torch.int16, device=dev),
        }
    _, n, w = oflag.shape
    live = (torch.arange(n, device=dev)[None, :, None] < rows[:, None, None]) & (
        torch.arange(w, device=dev)[None, None, :] < d_eff[:, None, None]
    )
    # nonzero lists indices in row-major order: by block, then row, then column.
    idx = torch.nonzero((oflag == 1) & live)
    blk, row, col = idx[:, 0], idx[:, 1], idx[:, 2]
    ptr = torch.zeros(b + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(torch.bincount(blk, minlength=b), 0)
    return {
        "outlier_ptr": ptr,
        "outlier_pos": row * d_eff[blk].to(torch.int64) + col,
        "outlier_bits": oval[blk, row, col],
    }
