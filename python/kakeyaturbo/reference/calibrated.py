"""A torch reference of the calibrated mode's encode and decode (CPU or CUDA).

It reads a calibration from its canonical bytes (FORMAT.md, "Calibrated containers, version
1"; :func:`calibration_of` takes them from a :class:`kakeyaturbo.CalibratedCodec`), so it needs
nothing of the extension but those bytes and the N(0, 1) Lloyd-Max tables
(:func:`kakeyaturbo.centroids_gaussian`). It produces the parts dict of
:meth:`kakeyaturbo.CalibratedCodec.encode_parts` with the same names, and it is written to be
read: every step follows ``rust/kakeyaturbo/src/calibrated.rs`` in the same f32 arithmetic and
order where the order decides a code (``A' = analysis / spread`` in f32, ``x - mean`` before
the product, the rms in f64 rounded to f32, the shared-exponent fp16, the sign flip and the
butterfly of ``wht.rs``, ``r / g^`` then a multiply, thresholds ``0.5 * (c_i + c_{i+1})``,
"number of thresholds strictly below ``z``", the fp16 outliers, ``g^ * (<z, q> / <q, q>)``).
Sums (the projection and the two dot products of ``inner_product``) run in torch's order, not
faer's or Rust's 8-lane order, so a value within a few ulps of a decision threshold may code
differently; the parity tests (``tests/kernels/``) bound and report those.

Values of the returned dict are torch tensors on the input's device (``codes`` a uint8 tensor,
``scale_exp`` a 0-d int32 tensor: no host synchronisation), plus the plain ints ``n``, ``d``,
``m``, ``row_bytes``; :func:`to_numpy_parts` converts to exactly the extension's types.
This module needs torch (the ``eval`` extra).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from ..codec import centroids_gaussian
from ..errors import CorruptDataError, InvalidInputError, InvalidParameterError
from ._common import (
    as_tensor,
    bits_to_f32,
    check_finite,
    counted,
    exponent,
    fwht,
    gain,
    outliers,
    pow2,
    scaled_f16,
    sign_pattern,
    thresholds,
)

__all__ = [
    "Calibration",
    "band_norm",
    "calibration_of",
    "decode",
    "encode",
    "pack_rows",
    "sub_bands",
    "to_numpy_parts",
    "unpack_rows",
]

METRICS = ("mse", "inner_product", "linf")
MAGIC = b"KKYB"


def _fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One (layer, kv-head, stream) calibration, as its canonical bytes hold it.

    ``mean [D]``, ``analysis``/``synthesis [m, D]``, ``spread [m]``: float32 numpy arrays;
    ``bits [m]``: uint8; ``tables``: the custom Lloyd-Max tables by bit width (float32);
    ``threshold``: the outlier threshold (None: no outliers); ``fingerprint``: FNV-1a of the
    bytes (what every container of this calibration records)."""

    d: int
    m: int
    rotation_seed: int
    metric: str
    norm: bool
    threshold: Optional[float]
    mean: np.ndarray
    analysis: np.ndarray
    synthesis: np.ndarray
    spread: np.ndarray
    bits: np.ndarray
    tables: Dict[int, np.ndarray]
    fingerprint: int

    @classmethod
    def from_bytes(cls, data: bytes) -> "Calibration":
        """Parses canonical calibration bytes. Raises ValueError on anything malformed."""
        data = bytes(data)
        at = 0

        def take(size: int) -> bytes:
            nonlocal at
            if at + size > len(data):
                raise InvalidInputError("calibration bytes end early")
            out = data[at:at + size]
            at += size
            return out

        if take(4) != MAGIC:
            raise InvalidInputError("not calibration bytes (magic)")
        version, d, m, seed, metric, norm, thr = struct.unpack("<HIIQBBf", take(2 + 4 + 4 + 8 + 1 + 1 + 4))
        if version != 1 or not 0 <= metric < len(METRICS) or norm > 1:
            raise InvalidInputError(f"unsupported calibration (version {version}, metric {metric}, norm {norm})")

        def f32(count: int) -> np.ndarray:
            return np.frombuffer(take(4 * count), dtype="<f4").astype(np.float32)

        mean = f32(d)
        analysis = f32(m * d).reshape(m, d)
        synthesis = f32(m * d).reshape(m, d)
        spread = f32(m)
        bits = np.frombuffer(take(m), dtype=np.uint8).copy()
        tables = {}
        for _ in range(take(1)[0]):
            b = take(1)[0]
            tables[int(b)] = f32(1 << b)
        if at != len(data):
            raise InvalidInputError(f"{len(data) - at} bytes left over after the calibration")
        # The values, as CalibratedCodec checks them (InvalidParameterError).
        for name, v in (("mean", mean), ("analysis", analysis), ("synthesis", synthesis), ("spread", spread)):
            bad = np.flatnonzero(~np.isfinite(v))
            if bad.size:
                raise InvalidParameterError(f"{name} holds a non-finite value at index {bad[0]}")
        if (spread <= 0).any():
            i = int(np.flatnonzero(spread <= 0)[0])
            raise InvalidParameterError(f"spread must be > 0; component {i} has {spread[i]}")
        if not (np.isfinite(thr) and thr >= 0):
            raise InvalidParameterError(f"outlier_threshold must be finite and >= 0 (0: none), got {thr}")
        for b, table in tables.items():
            if not np.isfinite(table).all():
                raise InvalidParameterError(f"the centroid table of {b} bits holds a non-finite value")
        return cls(d=d, m=m, rotation_seed=seed, metric=METRICS[metric], norm=bool(norm),
                   threshold=None if thr == 0 else float(thr), mean=mean, analysis=analysis,
                   synthesis=synthesis, spread=spread, bits=bits, tables=tables,
                   fingerprint=_fnv1a(data))

    @property
    def a_scaled(self) -> np.ndarray:
        """``A' = analysis / spread`` (row-wise), f32 division as in Rust."""
        return self.analysis / self.spread[:, None]

    @property
    def s_scaled(self) -> np.ndarray:
        """``S' = synthesis * spread`` (row-wise), f32 product as in Rust."""
        return self.synthesis * self.spread[:, None]

    @property
    def row_bytes(self) -> int:
        return (int(self.bits.astype(np.int64).sum()) + 7) // 8

    def centroids(self, bits: int) -> np.ndarray:
        """The table of ``bits`` bits: the custom one, else the N(0, 1) table (float32)."""
        if bits in self.tables:
            return self.tables[bits]
        return np.asarray(centroids_gaussian(bits), dtype=np.float32)


def calibration_of(codec: Any) -> Calibration:
    """The :class:`Calibration` of a :class:`kakeyaturbo.CalibratedCodec` (read from its
    canonical bytes; the fingerprint is checked against the codec's). TypeError for anything
    else (an AttributeError before)."""
    if not callable(getattr(codec, "canonical_bytes", None)):
        raise TypeError(f"a calibration must be a kakeyaturbo.CalibratedCodec or a Calibration, "
                        f"got {type(codec).__name__}")
    cal = Calibration.from_bytes(codec.canonical_bytes())
    if cal.fingerprint != codec.fingerprint:
        raise InvalidInputError("the calibration's fingerprint disagrees with the codec's")
    return cal


def sub_bands(bits: Any) -> List[Tuple[int, int, int]]:
    """``(offset, width, bits)`` of every sub-band: maximal runs of equal bits, each split into
    the powers of two of its length, largest first."""
    b = [int(v) for v in np.asarray(bits).reshape(-1)]
    out, start = [], 0
    while start < len(b):
        end = start
        while end < len(b) and b[end] == b[start]:
            end += 1
        off = start
        for bit in reversed(range((end - start).bit_length())):
            w = 1 << bit
            if (end - start) & w:
                out.append((off, w, b[start]))
                off += w
        start = end
    return out


def band_norm(width: int) -> float:
    """``r = f32(1 / sqrt(W))``: f32 square root then f32 division (correctly rounded)."""
    return float(np.float32(1.0) / np.sqrt(np.float32(width)))


def _bit_offsets(bits: np.ndarray) -> np.ndarray:
    """Bit offset of every component within its row (int64 ``[m]``)."""
    b = np.asarray(bits, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(b)[:-1]]).astype(np.int64)


def pack_rows(indices: torch.Tensor, bits: Any) -> torch.Tensor:
    """Packs ``[n, m]`` indices into ``[n, row_bytes]`` uint8: component ``j`` at row bits
    ``[sum_{i<j} b_i, + b_j)``, LSB first; rows start on byte boundaries."""
    b = np.asarray(bits, dtype=np.int64)
    n, m = indices.shape
    rb = (int(b.sum()) + 7) // 8
    off = torch.from_numpy(_bit_offsets(b)).to(indices.device)
    v = indices.to(torch.int64) << (off % 8)[None, :]
    out = torch.zeros(n, rb + 1, dtype=torch.int64, device=indices.device)
    # The bit fields are disjoint: adding them is OR-ing them.
    out.scatter_add_(1, (off // 8)[None, :].expand(n, m), v & 0xFF)
    out.scatter_add_(1, (off // 8 + 1)[None, :].expand(n, m), v >> 8)
    return out[:, :rb].to(torch.uint8)


def unpack_rows(codes: torch.Tensor, bits: Any) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: ``[n, row_bytes]`` uint8 to ``[n, m]`` uint8 indices."""
    b = np.asarray(bits, dtype=np.int64)
    n = codes.shape[0]
    off = torch.from_numpy(_bit_offsets(b)).to(codes.device)
    wide = torch.cat((codes.to(torch.int64), codes.new_zeros(n, 1, dtype=torch.int64)), dim=1)
    byte = (off // 8)[None, :].expand(n, len(b))
    word = wide.gather(1, byte) | (wide.gather(1, byte + 1) << 8)
    mask = torch.from_numpy((1 << b) - 1).to(codes.device)
    return ((word >> (off % 8)[None, :]) & mask[None, :]).to(torch.uint8)


def encode(x: torch.Tensor, cal: Calibration) -> Dict[str, Any]:
    """Encodes rows against a calibration.

    ``x``: float32 or bfloat16 ``[n, D]`` (bfloat16 is widened to f32 first, as a caller of the
    Rust path would). Returns the parts dict of ``encode_parts``: ``n``, ``d``, ``m``,
    ``row_bytes`` (ints), ``z [n, m]`` float32, ``g [n]`` float32 (the scale divided by),
    ``indices [n, m]`` uint8, ``codes [n * row_bytes]`` uint8, with ``norm`` ``scale [n]``
    float32, ``scale_exp`` (0-d int32), ``scale_bits [n]`` uint16, and ``outlier_pos [k]``
    int64 (flat ``row * m + j``, ascending), ``outlier_bits [k]`` uint16, ``outlier_val [k]``
    float32. Raises ValueError on a shape or dtype mismatch, InvalidInputError (a ValueError)
    on a non-finite value."""
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise InvalidInputError(f"x must be float32 or bfloat16 [n, D], got {x.dtype} {tuple(x.shape)}")
    check_finite("x", x)
    n, d = x.shape
    if d != cal.d or n == 0:
        raise InvalidInputError(f"x [{n}, {d}] does not fit a calibration of D = {cal.d}")
    dev = x.device
    m = cal.m
    mean = torch.from_numpy(cal.mean).to(dev)
    a_scaled = torch.from_numpy(cal.a_scaled).to(dev)
    signs = sign_pattern(cal.rotation_seed, m, dev)
    # Stage 2: u = A' (x - mean), the subtraction in f32 first.
    u = (x.to(torch.float32) - mean) @ a_scaled.T
    # The per-row scale: rms of u, the sum of squares in f64, rounded to f32, stored as fp16.
    if cal.norm:
        rms = torch.sqrt((u.double() ** 2).sum(dim=1) / m).to(torch.float32)
        scale_exp, scale_bits, g = scaled_f16(rms)
    else:
        g = torch.ones(n, dtype=torch.float32, device=dev)
    z = torch.empty_like(u)
    idx = torch.empty(n, m, dtype=torch.uint8, device=dev)
    q = torch.empty_like(u)
    for off, w, b in sub_bands(cal.bits):
        sl = slice(off, off + w)
        y = fwht(u[:, sl] * signs[sl])
        # z = y * (r / g^): the factor in f32 first, 0 for a zero scale.
        r = torch.tensor(band_norm(w), dtype=torch.float32, device=dev)
        f = torch.where(g > 0, r / torch.where(g > 0, g, torch.ones_like(g)), torch.zeros_like(g))
        z[:, sl] = y * f[:, None]
        table = torch.from_numpy(cal.centroids(b)).to(dev)
        # Number of thresholds strictly below z (searchsorted, left: the first >= z).
        code = torch.searchsorted(thresholds(table), z[:, sl].contiguous())
        idx[:, sl] = code.to(torch.uint8)
        q[:, sl] = table[code]
    q, opos, obits = outliers(z, q, cal.threshold)
    out: Dict[str, Any] = {"n": n, "d": d, "m": m, "row_bytes": cal.row_bytes, "z": z, "g": g,
                           "indices": idx, "codes": pack_rows(idx, cal.bits).reshape(-1)}
    if cal.metric == "inner_product":
        scale_exp, scale_bits, stored = scaled_f16(gain(z, q, g))
        out.update(scale=stored, scale_exp=scale_exp, scale_bits=scale_bits.view(torch.int16))
    elif cal.norm:
        out.update(scale=g, scale_exp=scale_exp, scale_bits=scale_bits.view(torch.int16))
    out.update(outlier_pos=opos, outlier_bits=obits, outlier_val=bits_to_f32(obits))
    return out


def decode(parts: Mapping[str, Any], cal: Calibration, device: Any = "cpu") -> torch.Tensor:
    """Decodes a parts dict (numpy from the extension or torch from :func:`encode`; ``n``,
    ``codes``, ``scale_exp``/``scale_bits`` with ``norm``, ``outlier_pos``/``outlier_bits``)
    into float32 ``[n, D]`` on ``device``: unpack, centroid lookup, outlier override,
    ``q * (g^ r)``, the butterfly, the signs, ``x = mean + u S'``. Raises ValueError on parts
    that do not fit the calibration, as :meth:`kakeyaturbo.CalibratedCodec.decode_parts` does:
    InvalidInputError for a length that does not fit, InvalidParameterError for ``scale_exp``
    outside -126..=127, CorruptDataError for outlier positions out of range or not ascending."""
    n, m = int(parts["n"]), cal.m
    codes = as_tensor(parts["codes"], device, torch.uint8).reshape(-1)
    if codes.numel() != n * cal.row_bytes:
        raise CorruptDataError(f"codes hold {codes.numel()} bytes, expected {n} x {cal.row_bytes}")
    idx = unpack_rows(codes.reshape(n, cal.row_bytes), cal.bits).long()
    if cal.norm:
        e = torch.tensor(exponent(parts, "scale_exp"), dtype=torch.int32, device=device)
        g = bits_to_f32(counted(as_tensor(parts["scale_bits"], device, torch.int32), "scale_bits", n, "n")) * pow2(e)
    else:
        g = torch.ones(n, dtype=torch.float32, device=device)
    q = torch.empty(n, m, dtype=torch.float32, device=device)
    for off, w, b in sub_bands(cal.bits):
        table = torch.from_numpy(cal.centroids(b)).to(device)
        q[:, off:off + w] = table[idx[:, off:off + w]]
    opos = as_tensor(parts["outlier_pos"], device, torch.int64).reshape(-1)
    obits = counted(as_tensor(parts["outlier_bits"], device, torch.int32), "outlier_bits", opos.numel(),
                    "len(outlier_pos)")
    if opos.numel():
        if int(opos[0]) < 0 or int(opos[-1]) >= n * m or bool((opos[1:] <= opos[:-1]).any()):
            raise CorruptDataError("outlier positions out of range or not ascending")
        q.view(-1)[opos] = bits_to_f32(obits)
    signs = sign_pattern(cal.rotation_seed, m, device)
    u = torch.empty_like(q)
    for off, w, _ in sub_bands(cal.bits):
        sl = slice(off, off + w)
        f = g * torch.tensor(band_norm(w), dtype=torch.float32, device=device)
        u[:, sl] = fwht(q[:, sl] * f[:, None]) * signs[sl]
    mean = torch.from_numpy(cal.mean).to(device)
    return mean + u @ torch.from_numpy(cal.s_scaled).to(device)


def to_numpy_parts(parts: Mapping[str, Any]) -> Dict[str, Any]:
    """The parts dict with the extension's types (numpy arrays, ``codes`` as bytes,
    ``scale_exp`` an int, fp16 bit patterns as uint16): accepted by
    :meth:`kakeyaturbo.CalibratedCodec.decode_parts`."""
    out: Dict[str, Any] = {}
    for key, v in parts.items():
        if key == "codes":
            out[key] = bytes(v.cpu().numpy().tobytes()) if isinstance(v, torch.Tensor) else bytes(v)
        elif key == "scale_exp":
            out[key] = int(v)
        elif isinstance(v, torch.Tensor):
            a = v.detach().cpu().numpy()
            out[key] = a.view(np.uint16) if key in ("scale_bits", "outlier_bits") else a
        else:
            out[key] = v
    return out
