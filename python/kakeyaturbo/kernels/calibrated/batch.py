"""The batched layout the calibrated-mode kernels read: the calibrations of many heads, padded
and permuted to one shape, and the conversions between a batch's codes and the parts dicts of
:meth:`kakeyaturbo.CalibratedCodec.encode_parts`.

Heads of one batch share ``D``, the metric, ``norm`` and the outlier threshold (one launch
set codes them all, e.g. every kv-head of a layer's K stream); each head has its own mean,
matrices, bits layout (so its own ``m`` and row bytes), rotation seed and tables.

**Pad and permute, not group.** Every head is padded to ``MP = max(16, next_pow2(max m))``
*slots*, and within a head the components are placed in slots by sub-band, widest sub-band
first: the sub-bands of a calibrated layout are runs of equal bits cut into powers of two,
so they sit at arbitrary offsets (``[4, 4, 4, 3, ...]`` has a 4-wide band at offset 3), but
placed widest first each starts at a multiple of its own width. Then every sub-band is an
aligned block of slots and the band-limited butterfly of the per-block kernels
(``_common.band_hadamard``, level ``h`` kept where the band is wider than ``h``) is exactly each
sub-band's own transform, whatever the layout. The permutation costs nothing at run time: the
rows of ``A'`` and ``S'`` are stored in slot order, so the projection produces ``u`` in slot
order and the decode's product consumes it; only the packing (byte and shift of each slot's
component), the outlier positions and the ``indices``/``z`` intermediates use the original
column (``col``). Grouping heads by identical layout instead would need one launch set per
distinct layout (water-filling gives nearly every head its own) and still the unaligned bands.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from ...errors import CorruptDataError, InvalidInputError, InvalidParameterError
from ...reference import calibrated as rc
from .._common import (check_exponents, device_of, f16_nonfinite, f16_values, next_pow2, on_host, outlier_parts,
                       stack_outliers)

#: Codec parameters that must agree across the heads of one batch.
SHARED_PARAMS = ("d", "metric", "norm", "threshold")

#: Rows of the per-head table tensors: one per bit width 0..8 (row 0 is the padding slots').
TABLE_ROWS = 9
TABLE_LEN = 256


@dataclasses.dataclass(frozen=True)
class CalibrationBatch:
    """Calibrations of ``H`` heads on one device, in ``MP`` slots per head (padding is zero).

    - ``mean [H, D]``; ``analysis [H, MP, D]`` (``A' = analysis / spread``) and ``synthesis
      [H, MP, D]`` (``S' = synthesis * spread``), rows in slot order: float32.
    - per slot, ``[H, MP]``: ``col`` int32 (the component in it), ``bits`` int32 (0: padding),
      ``width`` int32 (its sub-band's width, 0: padding), ``rnorm`` float32 (``f32(1 /
      sqrt(width))``), ``signs`` float32 (the sign of its component), ``byte``/``shift`` int32
      (where its index starts in the packed row).
    - ``thresholds [H, 9, 256]`` float32 (row ``b``: the ``2**b - 1`` thresholds of the ``b``-bit
      table, then ``+inf``; row 0 all ``+inf``), ``centroids [H, 9, 256]`` float32 (0-padded).
    - ``m [H]``, ``row_bytes [H]``: int32.
    - host values: ``metric``, ``norm``, ``outlier_threshold``, ``max_m``, ``max_row_bytes``,
      ``max_bits``, and per head ``bits_host`` (the layout) and ``fingerprints``.
    """

    mean: torch.Tensor
    analysis: torch.Tensor
    synthesis: torch.Tensor
    col: torch.Tensor
    bits: torch.Tensor
    width: torch.Tensor
    rnorm: torch.Tensor
    signs: torch.Tensor
    byte: torch.Tensor
    shift: torch.Tensor
    thresholds: torch.Tensor
    centroids: torch.Tensor
    m: torch.Tensor
    row_bytes: torch.Tensor
    metric: str
    norm: bool
    outlier_threshold: Optional[float]
    max_m: int
    max_row_bytes: int
    max_bits: int
    bits_host: Tuple[Tuple[int, ...], ...]
    fingerprints: Tuple[int, ...]

    @property
    def num_heads(self) -> int:
        return int(self.mean.shape[0])

    @property
    def dim(self) -> int:
        return int(self.mean.shape[1])

    @property
    def slots(self) -> int:
        return int(self.analysis.shape[1])

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def validate(self) -> None:
        """Raises ValueError when shapes, dtypes, devices or parameters do not fit together."""
        h, d = self.mean.shape
        mp = max(16, next_pow2(self.max_m))
        f32, i32 = torch.float32, torch.int32
        want = {
            "mean": (self.mean, (h, d), f32),
            "analysis": (self.analysis, (h, mp, d), f32),
            "synthesis": (self.synthesis, (h, mp, d), f32),
            "col": (self.col, (h, mp), i32),
            "bits": (self.bits, (h, mp), i32),
            "width": (self.width, (h, mp), i32),
            "rnorm": (self.rnorm, (h, mp), f32),
            "signs": (self.signs, (h, mp), f32),
            "byte": (self.byte, (h, mp), i32),
            "shift": (self.shift, (h, mp), i32),
            "thresholds": (self.thresholds, (h, TABLE_ROWS, TABLE_LEN), f32),
            "centroids": (self.centroids, (h, TABLE_ROWS, TABLE_LEN), f32),
            "m": (self.m, (h,), i32),
            "row_bytes": (self.row_bytes, (h,), i32),
        }
        for name, (t, shape, dtype) in want.items():
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise InvalidInputError(f"{name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
            if t.device != self.mean.device:
                raise InvalidInputError(f"{name} is on {t.device}, mean on {self.mean.device}")
            if not t.is_contiguous():
                raise InvalidInputError(f"{name} must be contiguous")
        if self.metric not in rc.METRICS:
            raise InvalidInputError(f"metric must be one of {rc.METRICS}, got {self.metric!r}")
        if self.metric == "inner_product" and not self.norm:
            raise InvalidInputError("metric inner_product needs norm")
        if self.outlier_threshold is not None and not self.outlier_threshold > 0:
            raise InvalidInputError(f"outlier_threshold must be > 0, got {self.outlier_threshold}")
        if not 1 <= self.max_bits <= 8 or len(self.bits_host) != h or len(self.fingerprints) != h:
            raise InvalidInputError("max_bits / bits_host / fingerprints do not fit the batch")
        if not 1 <= self.max_m <= mp or self.max_row_bytes < 1:
            raise InvalidInputError(f"max_m={self.max_m}, max_row_bytes={self.max_row_bytes} out of range")
        if on_host(self.bits) and h:
            self._check_host_values()

    def _check_host_values(self) -> None:
        """The per-head and per-slot values in host memory (on a GPU they are trusted:
        checking would read the device), which the kernels index tables and rows with."""
        m, rb, bits = self.m[:, None], self.row_bytes[:, None], self.bits
        live = bits > 0
        ok = (1 <= int(self.m.min()) and int(self.m.max()) <= self.max_m
              and 1 <= int(self.row_bytes.min()) and int(self.row_bytes.max()) <= self.max_row_bytes
              and 0 <= int(bits.min()) and int(bits.max()) <= self.max_bits
              and bool((~live | ((self.col >= 0) & (self.col < m))).all())
              and bool((~live | ((self.shift >= 0) & (self.shift < 8) & (self.byte >= 0)
                                 & (8 * self.byte + self.shift + bits <= 8 * rb))).all()))
        if not ok:
            raise InvalidParameterError("the batch's m, row_bytes, bits, col, byte or shift are out of range")


def slot_order(bits: Any) -> List[Tuple[int, int, int, int]]:
    """``(slot, offset, width, bits)`` of every sub-band: sub-bands sorted by width, widest first
    (ties in layout order), placed consecutively, so each starts at a multiple of its width."""
    bands = sorted(rc.sub_bands(bits), key=lambda band: -band[1])
    out, at = [], 0
    for off, w, b in bands:
        out.append((at, off, w, b))
        at += w
    return out


def _tables(cal: rc.Calibration) -> Tuple[np.ndarray, np.ndarray]:
    thr = np.full((TABLE_ROWS, TABLE_LEN), np.inf, np.float32)
    cen = np.zeros((TABLE_ROWS, TABLE_LEN), np.float32)
    for b in sorted(set(int(v) for v in cal.bits)):
        c = cal.centroids(b)
        cen[b, : len(c)] = c
        # Midpoints in f32 exactly as the format writes them: 0.5 * (c_i + c_{i+1}).
        thr[b, : len(c) - 1] = np.float32(0.5) * (c[:-1] + c[1:])
    return thr, cen


def stack_calibrations(calibrations: Sequence[Any], device: Any = "cpu") -> CalibrationBatch:
    """Pads, permutes and stacks calibrations (:class:`kakeyaturbo.CalibratedCodec` objects or
    :class:`kakeyaturbo.reference.calibrated.Calibration`) into a :class:`CalibrationBatch` on
    ``device``. They must share ``D``, metric, ``norm`` and outlier threshold; raises ValueError
    otherwise."""
    if not calibrations:
        raise InvalidInputError("need at least one calibration")
    cals = [c if isinstance(c, rc.Calibration) else rc.calibration_of(c) for c in calibrations]
    first = cals[0]
    for i, c in enumerate(cals):
        for key in SHARED_PARAMS:
            if getattr(c, key) != getattr(first, key):
                raise InvalidInputError(f"head {i}: {key}={getattr(c, key)!r} differs from head 0 "
                                        f"({getattr(first, key)!r})")
    h, d = len(cals), first.d
    max_m = max(c.m for c in cals)
    mp = max(16, next_pow2(max_m))
    mean = np.zeros((h, d), np.float32)
    ana = np.zeros((h, mp, d), np.float32)
    syn = np.zeros((h, mp, d), np.float32)
    per_slot = {k: np.zeros((h, mp), np.int32) for k in ("col", "bits", "width", "byte", "shift")}
    rnorm = np.zeros((h, mp), np.float32)
    signs = np.zeros((h, mp), np.float32)
    thr = np.zeros((h, TABLE_ROWS, TABLE_LEN), np.float32)
    cen = np.zeros((h, TABLE_ROWS, TABLE_LEN), np.float32)
    for i, c in enumerate(cals):
        mean[i] = c.mean
        a, s = c.a_scaled, c.s_scaled
        sg = rc.sign_pattern(c.rotation_seed, c.m).numpy()
        off_bits = np.concatenate([[0], np.cumsum(c.bits.astype(np.int64))[:-1]])
        for slot, off, w, b in slot_order(c.bits):
            sl, cl = slice(slot, slot + w), np.arange(off, off + w)
            ana[i, sl], syn[i, sl] = a[cl], s[cl]
            per_slot["col"][i, sl] = cl
            per_slot["bits"][i, sl] = b
            per_slot["width"][i, sl] = w
            per_slot["byte"][i, sl] = off_bits[cl] // 8
            per_slot["shift"][i, sl] = off_bits[cl] % 8
            rnorm[i, sl] = rc.band_norm(w)
            signs[i, sl] = sg[cl]
        thr[i], cen[i] = _tables(c)
    dev = device_of(device)

    def t(v: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(v)).to(dev)

    batch = CalibrationBatch(
        mean=t(mean), analysis=t(ana), synthesis=t(syn),
        col=t(per_slot["col"]), bits=t(per_slot["bits"]), width=t(per_slot["width"]),
        rnorm=t(rnorm), signs=t(signs), byte=t(per_slot["byte"]), shift=t(per_slot["shift"]),
        thresholds=t(thr), centroids=t(cen),
        m=t(np.array([c.m for c in cals], np.int32)),
        row_bytes=t(np.array([c.row_bytes for c in cals], np.int32)),
        metric=first.metric, norm=first.norm, outlier_threshold=first.threshold,
        max_m=max_m, max_row_bytes=max(c.row_bytes for c in cals),
        max_bits=max(int(c.bits.max()) for c in cals),
        bits_host=tuple(tuple(int(v) for v in c.bits) for c in cals),
        fingerprints=tuple(c.fingerprint for c in cals),
    )
    batch.validate()
    return batch


def head_parts(codes: Mapping[str, torch.Tensor], batch: CalibrationBatch, rows: Sequence[int],
               i: int) -> Dict[str, Any]:
    """Head ``i`` of a batch as a parts dict of the extension's types (numpy arrays, Python
    ints, bytes), decodable by :meth:`kakeyaturbo.CalibratedCodec.decode_parts` of that head's
    codec. ``codes``: the dict of :func:`kakeyaturbo.kernels.encode_calibrated`; ``rows``: the
    row count of every head (host ints). ``z``, ``g`` and ``indices`` are included when the
    encode kept them."""
    n, m = int(rows[i]), len(batch.bits_host[i])
    rb = (sum(batch.bits_host[i]) + 7) // 8
    out: Dict[str, Any] = {
        "n": n, "d": batch.dim, "m": m, "row_bytes": rb,
        "codes": codes["codes"][i, : n * rb].cpu().numpy().tobytes(),
        **outlier_parts(codes, i),
    }
    if batch.norm:
        sb = codes["scale_bits"][i, :n].cpu().numpy().view(np.uint16)
        e = int(codes["scale_exp"][i])
        out.update(scale=f16_values(sb) * np.float32(2.0**e), scale_exp=e, scale_bits=sb)
    for key in ("z", "indices"):
        if key in codes:
            out[key] = np.ascontiguousarray(codes[key][i, :n, :m].cpu().numpy())
    if "g" in codes:
        out["g"] = codes["g"][i, :n].cpu().numpy()
    return out


def stack_calibrated_parts(parts_list: Sequence[Mapping[str, Any]],
                           batch: CalibrationBatch) -> Dict[str, torch.Tensor]:
    """The batched codes dict of :func:`kakeyaturbo.kernels.encode_calibrated` built from parts
    dicts (e.g. what the Rust codec encoded), on the batch's device, for
    :func:`kakeyaturbo.kernels.decode_calibrated`. ``N`` is the largest head's row count.
    Raises ValueError when the parts do not fit the batch; the codes are checked as
    :meth:`kakeyaturbo.CalibratedCodec.decode_parts` checks them (InvalidInputError for a
    length that does not fit, InvalidParameterError for ``scale_exp`` outside -126..=127,
    CorruptDataError for code bytes that are not ``n`` rows, a non-finite fp16 value, or
    outlier positions out of range or not ascending)."""
    h = batch.num_heads
    if len(parts_list) != h:
        raise InvalidInputError(f"{len(parts_list)} parts for a batch of {h} heads")
    ns = [int(p["n"]) for p in parts_list]
    if min(ns) < 0:
        raise InvalidInputError(f"row counts must be >= 0, got n = {ns}")
    n = max(ns)
    codes = np.zeros((h, n * batch.max_row_bytes), np.uint8)
    sbits = np.zeros((h, n), np.uint16)
    sexp = [0] * h
    for i, p in enumerate(parts_list):
        m = len(batch.bits_host[i])
        rb = (sum(batch.bits_host[i]) + 7) // 8
        if int(p["m"]) != m:
            raise InvalidInputError(f"head {i}: m = {p['m']} does not fit the batch (m = {m})")
        raw = np.frombuffer(bytes(p["codes"]), np.uint8)
        if raw.size != ns[i] * rb:
            raise CorruptDataError(f"head {i}: {raw.size} code bytes for {ns[i]} rows of {rb} bytes")
        codes[i, : raw.size] = raw
        if batch.norm:
            sb = np.asarray(p["scale_bits"]).reshape(-1).view(np.uint16)
            if sb.size != ns[i]:
                raise InvalidInputError(f'head {i}: parts["scale_bits"] has {sb.size} values, expected n = {ns[i]}')
            if f16_nonfinite(sb).any():
                raise CorruptDataError(f"head {i}: scale_bits holds a non-finite fp16 value")
            sbits[i, : ns[i]] = sb
            sexp[i] = int(p["scale_exp"])
        pos = np.asarray(p["outlier_pos"]).reshape(-1).astype(np.int64)
        bits = np.asarray(p["outlier_bits"]).reshape(-1).view(np.uint16)
        if bits.size != pos.size:
            raise InvalidInputError(f'head {i}: parts["outlier_bits"] has {bits.size} values, expected '
                                    f"len(outlier_pos) = {pos.size}")
        if pos.size and batch.outlier_threshold is None:
            raise CorruptDataError(f"head {i}: outliers in the codes of a calibration without them")
        if pos.size and (pos[0] < 0 or pos[-1] >= ns[i] * m or (pos[1:] <= pos[:-1]).any()):
            raise CorruptDataError(f"head {i}: outlier positions out of range or not ascending")
        if f16_nonfinite(bits).any():
            raise CorruptDataError(f"head {i}: an outlier value is not finite")
    check_exponents("scale_exp", sexp, "head")
    dev = batch.device

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    out = {
        "codes": t(codes),
        **stack_outliers(parts_list, dev),
    }
    if batch.norm:
        out.update(scale_bits=t(sbits.view(np.int16)), scale_exp=t(np.array(sexp, np.int32)))
    return out
