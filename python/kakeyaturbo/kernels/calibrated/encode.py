"""Batched calibrated encode: many heads (e.g. every kv-head of a layer) in up to three launches.

1. ``rms.py`` (only with ``norm``): projection, the f64 rms of every row, per-tile maxima.
2. ``quantize.py``: projection again, the stored scale, signs and the butterfly of every
   sub-band, ``z``, Lloyd-Max indices at per-slot widths, outliers, the ``inner_product``
   gain, and the byte packing of the rows.
3. ``gain.py`` (only for ``inner_product``): the gain rounded with its head-wide exponent.

The cuts sit exactly at the head-wide reductions the format needs (the shared fp16 exponent
of the rms scale, then of the gain): a launch boundary is the one grid-wide barrier that needs
no cooperative launch, and each later launch reduces the previous launch's per-tile maxima on
device. No value goes to the host between launches. With an outlier threshold, the outlier
lists (unordered appends of launch 2) are sorted by position at the end; their total size
depends on the data, so reading the per-head counts is the one synchronisation (as in the
per-block encode). If a head has more outliers than the buffer reserved for it
(``outlier_capacity``), launch 2 runs once more with room for all of them.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ...codec import _checks
from ...errors import InvalidInputError
from .._common import RowsLike, check_device, check_finite_rows, rows_tensor
from .batch import CalibrationBatch
from .gain import round_gains
from .quantize import quantize
from .rms import rms_scales


def outlier_capacity(n: int, max_m: int) -> int:
    """Outlier entries reserved per head before the counts are known: 1/16 of the values
    (``|z| > T`` has probability 1.2 % at T = 2.5 for N(0, 1) values), at least 1024."""
    return max(1024, n * max_m // 16)


def encode_calibrated(
    x: torch.Tensor,
    batch: CalibrationBatch,
    rows: RowsLike = None,
    intermediates: bool = False,
    capacity: Optional[int] = None,
) -> Dict[str, torch.Tensor]:
    """Encodes the rows of ``H`` heads against their calibrations, on the batch's device.

    ``x``: float32 or bfloat16 ``[H, N, D]``, any strides (e.g. a layer's K cache ``[H, T, D]``
    as it is); bfloat16 is widened to f32 on load. ``batch``: a :class:`CalibrationBatch` of
    ``H`` heads. ``rows``: rows of each head (1..N), a host sequence or an int32 ``[H]`` tensor;
    default all ``N``. ``intermediates``: also return ``z``, ``indices`` and ``g`` (for tests;
    costs ``5 max_m + 4`` bytes per row). ``capacity``: outlier entries reserved per head, an
    int >= 1 (default :func:`outlier_capacity`).

    Returns a dict (names as in the extension's parts, batched):

    - ``codes`` uint8 ``[H, N * max_row_bytes]``: head ``i``'s rows of ``row_bytes_i`` bytes from
      its start (its first ``rows_i * row_bytes_i`` bytes are its container's codes)
    - with ``norm``: ``scale_bits`` int16 ``[H, N]`` (fp16 bit patterns), ``scale_exp`` int32
      ``[H]`` (the stored scale: the rms, or the gain for ``inner_product``)
    - ``outlier_ptr`` int64 ``[H + 1]``, ``outlier_pos`` int64 ``[M]`` (flat ``row * m_i + j``,
      ascending within each head), ``outlier_bits`` int16 ``[M]``: head ``i`` owns entries
      ``outlier_ptr[i]:outlier_ptr[i+1]`` (all empty without a threshold)
    - with ``intermediates``: ``z`` float32 and ``indices`` uint8 ``[H, N, max_m]`` (original
      component order), ``g`` float32 ``[H, N]`` (the scale divided by)

    Entries of rows past a head's count are unspecified. Raises ValueError on bad shapes,
    dtypes, devices or row counts, InvalidInputError (a ValueError) on a non-finite value in a
    head's rows (one reduction over ``x``, before any launch), InvalidParameterError for a
    capacity under 1 (TypeError for one that is not an int).
    """
    batch.validate()
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        raise InvalidInputError(f"x must be a [H, N, D] tensor, got {getattr(x, 'shape', type(x))}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise InvalidInputError(f"x must be float32 or bfloat16, got {x.dtype}")
    h, n, d = x.shape
    if n < 1:
        raise InvalidInputError(f"x [{h}, {n}, {d}] needs at least one row per head")
    if h != batch.num_heads or d != batch.dim:
        raise InvalidInputError(f"x [{h}, {n}, {d}] does not fit a batch of {batch.num_heads} heads, D={batch.dim}")
    check_device("x", x, batch.device)
    cap = outlier_capacity(n, batch.max_m) if capacity is None else _checks.integer(capacity, "capacity", 1)
    rows_t = rows_tensor(rows, h, n, x.device)
    check_finite_rows("x", x, rows_t, "head")
    g_raw = tile_max = None
    if batch.norm:
        g_raw, tile_max = rms_scales(x, batch, rows_t)
    while True:
        res = quantize(x, batch, rows_t, g_raw, tile_max, cap, intermediates)
        if batch.outlier_threshold is None:
            counts = None
            break
        counts = res["count"].to(torch.int64).cpu()  # the one synchronisation
        if int(counts.max()) <= cap:
            break
        cap = int(counts.max())
    out = {"codes": res["codes"]}
    if batch.metric == "inner_product":
        out["scale_bits"], out["scale_exp"] = round_gains(res["gain"], res["gain_max"], rows_t)
    elif batch.norm:
        out.update(scale_bits=res["scale_bits"], scale_exp=res["scale_exp"])
    for key in ("z", "indices", "g"):
        if key in res:
            out[key] = res[key]
    out.update(_sorted_outliers(res, counts, h, n * batch.max_m + 1, x.device))
    return out


def _sorted_outliers(res: Dict[str, torch.Tensor], counts: Optional[torch.Tensor], h: int, stride: int,
                     dev: torch.device) -> Dict[str, torch.Tensor]:
    """The outlier lists of launch 2 (``pos``/``bits`` ``[H, C]``, valid up to ``counts``) in
    ascending position per head, concatenated, with ``outlier_ptr``."""
    ptr = torch.zeros(h + 1, dtype=torch.int64)
    if counts is None or int(counts.sum()) == 0:
        return {"outlier_ptr": ptr.to(dev), "outlier_pos": torch.zeros(0, dtype=torch.int64, device=dev),
                "outlier_bits": torch.zeros(0, dtype=torch.int16, device=dev)}
    ptr[1:] = torch.cumsum(counts, 0)
    pos, bits = res["pos"], res["bits"]
    cap = pos.shape[1]
    live = torch.arange(cap, device=dev)[None, :] < counts.to(dev)[:, None]
    head = torch.arange(h, device=dev, dtype=torch.int64)[:, None]
    # One sort over all heads: key = head * stride + position, dead entries last.
    key = torch.where(live, head * stride + pos, h * stride)
    order = torch.sort(key.reshape(-1)).indices[: int(ptr[-1])]
    return {"outlier_ptr": ptr.to(dev), "outlier_pos": pos.reshape(-1)[order],
            "outlier_bits": bits.reshape(-1)[order]}
