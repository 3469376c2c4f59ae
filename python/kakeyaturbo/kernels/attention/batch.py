"""The device layout the attention kernels read: a layer's sealed codes (a
:class:`kakeyaturbo.LayerCodes`), per stream, stacked over (batch row, kv-head) pairs, beside
the calibrations of the kv-heads (:class:`~kakeyaturbo.kernels.CalibrationBatch`, slots
permuted widest sub-band first as the calibrated kernels lay them out).

Per stream and pair ``bh = b * H_kv + h`` (``T_c`` sealed rows, every pair the same):

- ``codes`` uint8 ``[BH, T_c * max_row_bytes]``: row ``t`` at ``t * row_bytes_h`` (the
  containers' code fields back to back);
- ``scale_bits`` int16 ``[BH, T_c]`` (fp16 mantissas) and ``scale_exp`` int32 ``[BH, T_c]``
  (each row's block exponent): 3 bytes a row on the device, as the containers' 2 plus the
  block's one shared byte;
- the outliers as the calibrated kernels batch them (``outlier_ptr`` int64 ``[BH + 1]``,
  ``outlier_pos`` int64 flat ``row * m_h + j`` over the pair's ``T_c`` rows, ``outlier_bits``
  int16) and ``rstart`` int64 ``[BH, T_c + 1]``, each row's first outlier.

The containers are read here with numpy after ``LayerCodes`` has checked them (checksum,
sizes, fingerprint) when they were appended.

Keys coded before RoPE also need, per kv-head, the K synthesis with the band rotation folded
in (:attr:`LayerBatch.key_synthesis`, derived on first use) and the rotary table on the device
(:func:`stack_rope`).
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from ...codec.attention import LayerCodes, RopeTable
from .._common import ceil_log2, device_of, placeholder, row_starts
from ..calibrated.batch import CalibrationBatch, stack_calibrations
from ...errors import InvalidInputError

#: Bytes of a calibrated container's header (FORMAT.md).
HEADER = 40


def container_fields(blob: bytes) -> Dict[str, Any]:
    """The fields of a calibrated container (FORMAT.md) as numpy: ``n``, ``m``, ``row_bytes``,
    ``codes`` uint8 ``[n, row_bytes]``, ``scale_bits`` uint16 ``[n]`` and ``scale_exp`` (with
    ``norm``), ``outlier_pos`` int64, ``outlier_bits`` uint16. Trusts a container that
    :class:`LayerCodes` accepted; raises ValueError on one that does not even parse."""
    b = bytes(blob)
    if len(b) < HEADER + 4 or b[:4] != b"KKYC":
        raise InvalidInputError("not a calibrated container")
    flags, _metric, n, _d, m, rb, _fp, k = struct.unpack_from("<BBQIIIQI", b, 6)
    at = HEADER
    out: Dict[str, Any] = {"n": n, "m": m, "row_bytes": rb}
    if flags & 1:
        out["scale_exp"] = struct.unpack_from("<b", b, at)[0]
        out["scale_bits"] = np.frombuffer(b, np.uint16, n, at + 1).copy()
        at += 1 + 2 * n
    out["codes"] = np.frombuffer(b, np.uint8, n * rb, at).reshape(n, rb).copy()
    at += n * rb
    nb = ceil_log2(n * m)
    packed = (k * nb + 7) // 8
    bits = np.unpackbits(np.frombuffer(b, np.uint8, packed, at), bitorder="little")
    pos = np.zeros(k, np.int64)
    if nb:
        fields = bits[: k * nb].reshape(k, nb).astype(np.int64)
        pos = (fields << np.arange(nb, dtype=np.int64)).sum(axis=1)
    out["outlier_pos"] = pos
    out["outlier_bits"] = np.frombuffer(b, np.uint16, k, at + packed).copy()
    if at + packed + 2 * k + 4 != len(b):
        raise InvalidInputError("the container's fields do not fill it")
    return out


@dataclasses.dataclass(frozen=True)
class StreamCodes:
    """One stream's sealed codes on the device (see the module docstring) and its
    calibrations (``cal``, ``H_kv`` heads)."""

    cal: CalibrationBatch
    codes: torch.Tensor
    scale_bits: torch.Tensor
    scale_exp: torch.Tensor
    outlier_ptr: torch.Tensor
    outlier_pos: torch.Tensor
    outlier_bits: torch.Tensor
    rstart: torch.Tensor
    rows: int

    @property
    def has_outliers(self) -> bool:
        return self.outlier_pos.numel() > 0


@dataclasses.dataclass(frozen=True)
class LayerBatch:
    """A layer's sealed K and V codes on one device, for :func:`decode_attention_triton`."""

    k: StreamCodes
    v: StreamCodes
    batch: int
    kv_heads: int
    #: The K calibrations (:class:`kakeyaturbo.CalibratedCodec`), for the Rust-rounded ``M``.
    k_codecs: Tuple[Any, ...] = ()

    @property
    def device(self) -> torch.device:
        return self.k.codes.device

    @functools.cached_property
    def key_synthesis(self) -> torch.Tensor:
        """:func:`key_synthesis` of the K calibrations, derived on first use (keys coded before
        RoPE) and kept."""
        return key_synthesis(self.k.cal)

    @functools.cached_property
    def key_synthesis_bf16(self) -> torch.Tensor:
        """``M`` as the Rust kernel's default synthesis multiplies it, each entry rounded to
        bfloat16 (``CalibratedCodec.key_synthesis("bf16")``: rounded by Rust, so that a float32
        ``M`` a few ulps apart cannot round the other way), in the slot order and ``[H, MP, D]``
        layout of :attr:`key_synthesis`. Raises ValueError for a batch built without its K
        calibrations (``stack_layer`` keeps them)."""
        return self._synthesis_as("bf16")

    @functools.cached_property
    def key_synthesis_i16(self) -> torch.Tensor:
        """``M`` as the Rust kernel's fixed-point synthesis multiplies it
        (``CalibratedCodec.key_synthesis("i16")``: each weight times its channel's step), laid
        out as :attr:`key_synthesis_bf16`."""
        return self._synthesis_as("i16")

    def _synthesis_as(self, synthesis: str) -> torch.Tensor:
        if len(self.k_codecs) != self.kv_heads:
            raise InvalidInputError("this LayerBatch was built without its K calibrations (use stack_layer)")
        cal = self.k.cal
        h, mp, d = cal.synthesis.shape
        col, bits = cal.col.cpu().numpy(), cal.bits.cpu().numpy()
        out = np.zeros((h, mp, d), np.float32)
        for i, codec in enumerate(self.k_codecs):
            m = np.asarray(codec.key_synthesis(synthesis))
            used = bits[i] > 0
            out[i, used] = m[col[i, used]]
        return torch.from_numpy(out).to(cal.device)


def key_synthesis(cal: CalibrationBatch) -> torch.Tensor:
    """``M`` float32 ``[H, MP, D]`` on the calibrations' device, rows in slot order: a row of
    scale ``g`` and centroids ``c`` (slot order, outliers' values in place) decodes as ``mean +
    g * c M``. Row ``j`` is the synthesis of the unit vector ``e_j`` without the mean (the
    Rust ``StreamTables::key_synthesis``): ``u = s * H(r * e_j)`` within ``j``'s sub-band (``r``
    = ``rnorm``, ``H`` the unnormalised Hadamard butterfly of ``_common.band_hadamard``, ``s`` =
    ``signs``), then ``u S'``. The entries of ``u`` are ``+-r`` exactly; ``u S'`` is summed in
    float64 and rounded once (the Rust ``fma`` chain is within a few ulps of it). Padding slots
    give zero rows."""
    h, mp, d = cal.synthesis.shape
    width = cal.width.cpu()
    y = torch.diag_embed(cal.rnorm.cpu().to(torch.float64))  # [H, j, slot]: r_j e_j
    step = 1
    while step < mp:
        v = y.reshape(h, mp, mp // (2 * step), 2, step)
        a, b = v[..., 0, :], v[..., 1, :]
        bf = torch.stack((a + b, a - b), dim=-2).reshape(h, mp, mp)
        y = torch.where((width >= 2 * step)[:, None, :], bf, y)
        step *= 2
    u = y * cal.signs.cpu().to(torch.float64)[:, None, :]
    m = u @ cal.synthesis.cpu().to(torch.float64)
    return m.to(torch.float32).contiguous().to(cal.device)


@dataclasses.dataclass(frozen=True)
class RopeBatch:
    """A :class:`kakeyaturbo.RopeTable` on one device: ``cos`` and ``sin`` float32 ``[rot/2,
    n_pos]`` (frequency-major, as the table holds them) and the pairing ``style``."""

    cos: torch.Tensor
    sin: torch.Tensor
    style: str

    @property
    def rot_dim(self) -> int:
        return 2 * int(self.cos.shape[0])

    @property
    def n_positions(self) -> int:
        return int(self.cos.shape[1])

    @property
    def interleaved(self) -> bool:
        return self.style == "interleaved"

    @property
    def device(self) -> torch.device:
        return self.cos.device


def stack_rope(table: RopeTable, device: Any = "cpu") -> RopeBatch:
    """``table``'s cos and sin on ``device`` (staged once, then passed to every call of
    :func:`decode_attention_triton` instead of the table, which would be copied each call).
    Raises ValueError when ``table`` is not a :class:`kakeyaturbo.RopeTable`."""
    if not isinstance(table, RopeTable):
        raise InvalidInputError(f"rope must be a kakeyaturbo.RopeTable, got {type(table).__name__}")
    dev = device_of(device)
    return RopeBatch(cos=torch.from_numpy(np.ascontiguousarray(table._cos_t)).to(dev),
                     sin=torch.from_numpy(np.ascontiguousarray(table._sin_t)).to(dev),
                     style=table.style)


@dataclasses.dataclass
class _Host:
    """One stream's sealed rows of blocks ``first ..`` of every pair, parsed on the host."""

    packed: np.ndarray  # uint8 [BH, max(rows, 1) * max_row_bytes]
    sbits: np.ndarray  # uint16 [BH, max(rows, 1)]
    sexp: np.ndarray  # int32 [BH, max(rows, 1)]
    pos: List[np.ndarray]  # per pair, int64, row * m_h + j over these rows
    obits: List[np.ndarray]  # per pair, uint16
    rows: int


def _parse(codes: LayerCodes, stream: str, cal: CalibrationBatch, first: int, rows: int) -> _Host:
    """Blocks ``first ..`` of every pair, ``rows`` rows in all per pair."""
    b, hkv = codes.batch, codes.kv_heads
    rb_max = cal.max_row_bytes
    m = [len(x) for x in cal.bits_host]
    bh = b * hkv
    packed = np.zeros((bh, max(rows, 1) * rb_max), np.uint8)
    sbits = np.zeros((bh, max(rows, 1)), np.uint16)
    sexp = np.zeros((bh, max(rows, 1)), np.int32)
    pos: List[np.ndarray] = []
    obits: List[np.ndarray] = []
    for i in range(bh):
        bi, h = divmod(i, hkv)
        at = 0
        rb = (sum(cal.bits_host[h]) + 7) // 8
        pos_i, bits_i = [], []
        for blk in range(first, codes.num_blocks(bi, h)):
            f = container_fields(codes.blob(bi, h, stream, blk))
            n = f["n"]
            packed[i, at * rb:(at + n) * rb] = f["codes"].reshape(-1)
            if "scale_bits" in f:
                sbits[i, at:at + n] = f["scale_bits"]
                sexp[i, at:at + n] = f["scale_exp"]
            pos_i.append(f["outlier_pos"] + at * m[h])
            bits_i.append(f["outlier_bits"])
            at += n
        pos.append(np.concatenate(pos_i) if pos_i else np.zeros(0, np.int64))
        obits.append(np.concatenate(bits_i) if bits_i else np.zeros(0, np.uint16))
    return _Host(packed, sbits, sexp, pos, obits, rows)


def _stream_codes(cal: CalibrationBatch, hkv: int, codes: torch.Tensor, sbits: torch.Tensor,
                  sexp: torch.Tensor, pos: List[torch.Tensor], bits: List[torch.Tensor],
                  rows: int) -> StreamCodes:
    """A :class:`StreamCodes` from its device tensors and per-pair outlier lists, each row's
    first outlier found on the device."""
    dev = cal.device
    m = [len(x) for x in cal.bits_host]
    ptr = torch.zeros(len(pos) + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(torch.tensor([p.numel() for p in pos], dtype=torch.int64), 0)
    out = dict(outlier_ptr=ptr.to(dev), outlier_pos=torch.cat(pos), outlier_bits=torch.cat(bits))
    if out["outlier_pos"].numel():
        m_bh = torch.tensor([m[i % hkv] for i in range(len(pos))], dtype=torch.int32, device=dev)
        rstart = row_starts(out, m_bh, rows, max(m))
    else:
        rstart = placeholder(torch.int64, dev)
    return StreamCodes(cal=cal, codes=codes, scale_bits=sbits, scale_exp=sexp, rstart=rstart, rows=rows, **out)


def _on(a: np.ndarray, dev: Any) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dev)


def _stream(codes: LayerCodes, stream: str, cal: CalibrationBatch) -> StreamCodes:
    host = _parse(codes, stream, cal, 0, codes.rows())
    dev = cal.device
    return _stream_codes(cal, codes.kv_heads, _on(host.packed, dev), _on(host.sbits.view(np.int16), dev),
                         _on(host.sexp, dev), [_on(p, dev) for p in host.pos],
                         [_on(b.view(np.int16), dev) for b in host.obits], host.rows)


def _extend(old: StreamCodes, codes: LayerCodes, stream: str, first: int) -> StreamCodes:
    """``old`` (blocks ``0 .. first`` of every pair) followed by blocks ``first ..`` of
    ``codes``: only the new blocks are parsed; the old rows are copied on the device."""
    cal, hkv, dev = old.cal, codes.kv_heads, old.cal.device
    o = old.rows
    n = codes.rows() - o
    new = _parse(codes, stream, cal, first, n)
    bh = len(new.pos)
    packed = torch.zeros((bh, max(o + n, 1) * cal.max_row_bytes), dtype=torch.uint8, device=dev)
    new_packed = _on(new.packed, dev)
    ptr = old.outlier_ptr.cpu().tolist()
    m = [len(x) for x in cal.bits_host]
    pos, bits = [], []
    for i in range(bh):
        rb = (sum(cal.bits_host[i % hkv]) + 7) // 8
        packed[i, :o * rb] = old.codes[i, :o * rb]
        packed[i, o * rb:(o + n) * rb] = new_packed[i, :n * rb]
        pos.append(torch.cat([old.outlier_pos[ptr[i]:ptr[i + 1]], _on(new.pos[i] + o * m[i % hkv], dev)]))
        bits.append(torch.cat([old.outlier_bits[ptr[i]:ptr[i + 1]], _on(new.obits[i].view(np.int16), dev)]))

    def cat(a: torch.Tensor, b: np.ndarray) -> torch.Tensor:
        return torch.cat([a[:, :o], _on(b[:, :n], dev)], dim=1) if o + n else a[:, :1]

    return _stream_codes(cal, hkv, packed, cat(old.scale_bits, new.sbits.view(np.int16)),
                         cat(old.scale_exp, new.sexp), pos, bits, o + n)


def stack_layer(codes: LayerCodes, device: Any = "cpu") -> LayerBatch:
    """A layer's sealed codes and calibrations on ``device`` (see the module docstring).
    Raises InvalidInputError (from ``codes.rows()``) when the pairs hold different row counts,
    ValueError when the kv-heads' calibrations differ in metric, ``norm`` or outlier
    threshold (one batch per stream)."""
    kc = stack_calibrations(codes.k_codecs, device)
    vc = stack_calibrations(codes.v_codecs, device)
    return LayerBatch(k=_stream(codes, "k", kc), v=_stream(codes, "v", vc), batch=codes.batch,
                      kv_heads=codes.kv_heads, k_codecs=tuple(codes.k_codecs))


def extend_layer(old: LayerBatch, codes: LayerCodes, first_block: int) -> LayerBatch:
    """:func:`stack_layer` of ``codes`` from ``old``, the stacking of its blocks ``0 ..
    first_block`` of every pair (the same calibrations, batch and kv-heads): only the blocks from
    ``first_block`` on are parsed (the cache's step after a block is sealed). The same tensors as
    ``stack_layer(codes, old.device)`` (tested)."""
    if (old.batch, old.kv_heads) != (codes.batch, codes.kv_heads):
        raise InvalidInputError("extend_layer: the codes have another batch or kv-head count than the stacking")
    return LayerBatch(k=_extend(old.k, codes, "k", first_block), v=_extend(old.v, codes, "v", first_block),
                      batch=codes.batch, kv_heads=codes.kv_heads, k_codecs=old.k_codecs)


def raw_rows(sink: Any, tail: Any, batch: int, kv_heads: int, d: int, device: Any
             ) -> Tuple[torch.Tensor, int]:
    """The sink rows then the tail rows of every pair as float32 ``[BH, S + R, d]`` on
    ``device``, and ``S``."""
    parts = []
    rows = []
    for x in (sink, tail):
        if x is None:
            rows.append(0)
            continue
        a = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))
        if a.ndim != 4 or tuple(a.shape[:2]) != (batch, kv_heads) or a.shape[3] != d:
            raise InvalidInputError(f"raw rows must be [B={batch}, H_kv={kv_heads}, rows, {d}], "
                                    f"got {tuple(a.shape)}")
        parts.append(a.to(device=device, dtype=torch.float32).reshape(batch * kv_heads, -1, d))
        rows.append(a.shape[2])
    return torch.cat(parts, dim=1).contiguous(), rows[0]
