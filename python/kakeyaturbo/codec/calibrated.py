"""The calibrated mode: a codec object holding one model-level calibration (see FORMAT.md)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from ..errors import InvalidParameterError
from . import _checks

#: How keys coded before RoPE are synthesised (see :func:`decode_attention`).
SYNTHESES = ("bf16", "f32", "i16")

DEFAULT_ROTATION_SEED = 0xCAFEBABE
METRICS = ("mse", "inner_product", "ip", "linf")


class CalibratedCodec:
    """Codes rows of one stream of one (layer, kv-head) against a model-level calibration.

    ``mean [D]``, ``analysis [m, D]``, ``synthesis [m, D]``, ``spread [m] > 0`` and
    ``bits [m]`` in 1..8 (components allocated 0 bits are left out; they decode as the mean).
    Coefficients are ``u = (analysis / spread) (x - mean)``; each run of equal bits is cut into
    power-of-two sub-bands rotated by a seeded normalised Hadamard transform; ``norm`` stores
    one fp16 scale per row (the rms of ``u``); Lloyd-Max at ``bits[j]`` bits (the N(0, 1)
    table, or ``centroids[b]``); ``|z| > outlier_threshold`` is kept as fp16. Decode:
    ``x = mean + (u * spread) @ synthesis``. Arrays are converted to float32 (``bits`` to
    uint8) once, here. Raises InvalidParameterError for an unusable calibration.
    """

    def __init__(self, mean: Any, analysis: Any, synthesis: Any, spread: Any, bits: Any, *,
                 rotation_seed: int = DEFAULT_ROTATION_SEED, metric: str = "mse", norm: bool = True,
                 outlier_threshold: Optional[float] = None,
                 centroids: Optional[Mapping[int, Any]] = None) -> None:
        b = np.asarray(bits)
        if b.dtype.kind not in "iu":
            raise TypeError(f"bits must be integers, got dtype {b.dtype}")
        b = _checks.vector(b, "bits", np.int64 if b.dtype.kind == "i" else np.uint64)
        if b.size and (b.min() < 1 or b.max() > 8):
            raise InvalidParameterError("bits must be in 1..8 (leave 0-bit components out)")
        mean_ = _checks.vector(mean, "mean", np.float32)
        a_, s_ = _checks.table(analysis, "analysis"), _checks.table(synthesis, "synthesis")
        spread_, bits_ = _checks.vector(spread, "spread", np.float32), b.astype(np.uint8)
        m, d = a_.shape
        for name, got, want in (("mean", mean_.shape, (d,)), ("synthesis", s_.shape, (m, d)),
                                ("spread", spread_.shape, (m,)), ("bits", bits_.shape, (m,))):
            if got != want:
                raise InvalidParameterError(
                    f"{name} must have shape {want} to match analysis [m={m}, D={d}], got {got}")
        seed = _checks.seed(rotation_seed)
        metric = _checks.choice(metric, "metric", METRICS)
        norm = _checks.boolean(norm, "norm")
        threshold = (None if outlier_threshold is None
                     else _checks.real(outlier_threshold, "outlier_threshold", positive=True))
        tables = None
        if centroids is not None:
            tables = [(_checks.integer(k, "a centroids key (bit width)", 1, 8),
                       [float(x) for x in _checks.vector(v, f"centroids[{k}]", np.float64, _checks.MAX_CENTROIDS)])
                      for k, v in _checks.mapping(centroids, "centroids").items()]
        self._c = _core.CalibratedCodec(mean_, a_, s_, spread_, bits_, seed, metric, norm,
                                        threshold, tables)
        self.metric = metric
        self.norm = norm
        self.rotation_seed = seed
        self.outlier_threshold = threshold

    def as_dict(self) -> Dict[str, Any]:
        """Everything this codec was made from, its arrays as the float32 (``bits`` uint8) it
        holds: ``CalibratedCodec(**c.as_dict())`` is the same codec (the same fingerprint and
        bytes), whatever CPU runs it. ``ModelCodec.save`` stores a model's codecs this way."""
        d = self._c.arrays()
        return {**d, "rotation_seed": self.rotation_seed, "metric": self.metric, "norm": self.norm,
                "outlier_threshold": self.outlier_threshold, "centroids": d["centroids"] or None}

    def __reduce__(self) -> Tuple[Any, Tuple[Dict[str, Any]]]:
        """Pickled as what it was made from (:meth:`as_dict`), so that a codec, or a
        :class:`~kakeyaturbo.calibration.ModelCodec` holding codecs, reaches the workers of a
        ``spawn`` or ``forkserver`` process pool; unpickling makes it again, with its checks."""
        return _from_dict, (self.as_dict(),)

    @property
    def d(self) -> int:
        return self._c.d

    @property
    def m(self) -> int:
        """Number of coded components."""
        return self._c.m

    @property
    def fingerprint(self) -> int:
        """64-bit hash of the calibration; every container records it and decode checks it."""
        return self._c.fingerprint

    @property
    def model_bytes(self) -> int:
        """Bytes of the calibration itself (stored once per model, not per token)."""
        return self._c.model_bytes

    @property
    def row_bits(self) -> int:
        """Bits of one row's indices (the sum of ``bits``)."""
        return self._c.row_bits

    @property
    def row_bytes(self) -> int:
        """Bytes a row's indices occupy (rows start on byte boundaries)."""
        return self._c.row_bytes

    @property
    def bands(self) -> "list[Tuple[int, int, int]]":
        """``(offset, width, bits)`` of every rotated sub-band."""
        return self._c.bands

    def key_synthesis(self, synthesis: str = "bf16") -> np.ndarray:
        """``M`` float32 ``[m, D]``: a row of scale ``g`` and centroids ``c`` (outliers' values in
        place) decodes as ``mean + g * c M`` (row ``j``: the synthesis of the unit vector ``e_j``,
        the sub-band rotation folded in), as :func:`kakeyaturbo.decode_attention` multiplies it
        for keys coded before RoPE: ``"bf16"`` each entry rounded to bfloat16 (the default
        synthesis), ``"f32"`` as it is, ``"i16"`` as the fixed-point synthesis's weight times its
        channel's step (it multiplies centroids rounded to steps of 1/256, saturating at
        ±128). For mirrors of that kernel (the Triton one). Raises
        InvalidParameterError for another ``synthesis``."""
        return self._c.key_synthesis(_checks.choice(synthesis, "synthesis", SYNTHESES))

    def canonical_bytes(self) -> bytes:
        """The calibration's canonical bytes (what ``fingerprint`` hashes, ``model_bytes`` long)."""
        return self._c.canonical_bytes()

    def encode(self, array: np.ndarray, *, threads: Optional[int] = None) -> bytes:
        """Encodes float32 ``[n, D]`` rows into a calibrated container (bytes)."""
        return self._c.encode(_checks.matrix(array), _checks.threads(threads))

    def decode(self, data: Any, *, threads: Optional[int] = None) -> np.ndarray:
        """Decodes a container of this calibration into float32 ``[n, D]``. Raises
        CorruptDataError for damaged bytes, InvalidParameterError for another calibration's."""
        return self._c.decode(_checks.buffer(data), _checks.threads(threads))

    def roundtrip(self, array: np.ndarray, *, threads: Optional[int] = None
                  ) -> Tuple[np.ndarray, Dict[str, Any]]:
        """Encode + decode; returns ``(decoded, report)`` (bytes by part, errors, timings)."""
        return self._c.roundtrip(_checks.matrix(array), _checks.threads(threads))

    def encode_parts(self, array: np.ndarray) -> Dict[str, Any]:
        """Every intermediate of an encode by name: ``z [n, m]`` (scaled rotated coordinates),
        ``g [n]`` (the scale divided by), ``indices [n, m] uint8``, ``codes`` (packed rows),
        ``scale``/``scale_exp``/``scale_bits`` (with ``norm``), ``outlier_pos [k] int64`` (flat
        ``row * m + j``), ``outlier_val``/``outlier_bits``."""
        return self._c.encode_parts(_checks.matrix(array))

    def decode_parts(self, parts: Dict[str, Any]) -> np.ndarray:
        """Decodes a parts dict as :meth:`encode_parts` returns it."""
        return self._c.decode_parts(dict(_checks.mapping(parts, "parts")))

    def inspect(self, data: Any) -> Dict[str, Any]:
        """Header fields and byte counts of a container of this calibration."""
        return self._c.inspect(_checks.buffer(data))

    def __repr__(self) -> str:
        return (f"CalibratedCodec(d={self.d}, m={self.m}, row_bits={self.row_bits}, "
                f"fingerprint={self.fingerprint:016x})")


def encode_blocks(codecs: Sequence[CalibratedCodec], array: np.ndarray, block_rows: int, *,
                  threads: Optional[int] = None) -> List[List[bytes]]:
    """Row set ``g`` of float32 ``array [G, T, D]`` in blocks of ``block_rows`` rows, each block
    coded against ``codecs[g]``: the containers ``[block][g]``, each the bytes of
    ``codecs[g].encode`` of that block, every encode of the call spread over ``threads``
    threads (the host's OpenMP team where it has one, torch's): one call for every block of
    every kv-head that a cache seals. ``T`` must be a multiple of ``block_rows``
    (InvalidInputError); TypeError for another dtype or a codec that is not a
    :class:`CalibratedCodec`."""
    cs = _codecs(codecs)
    x, block_rows = _checks.row_sets(array, block_rows)
    return _core.encode_calibrated_blocks([c._c for c in cs], x, block_rows, _checks.threads(threads))


def decode_blocks(codecs: Sequence[CalibratedCodec], blobs: Sequence[Sequence[bytes]], block_rows: int, *,
                  threads: Optional[int] = None) -> np.ndarray:
    """The containers ``blobs[block][g]`` (each of ``block_rows`` rows) decoded, container
    ``[j][g]`` against ``codecs[g]``: float32 ``[G, blocks * block_rows, D]``, the blocks of
    row set ``g`` in order, each as ``codecs[g].decode`` gives it; every decode of the call
    spread over ``threads`` threads as :func:`encode_blocks` spreads its encodes. Raises
    CorruptDataError for damaged bytes, InvalidParameterError for another calibration's,
    InvalidInputError for a container of another row count or a block of another count of
    containers."""
    cs = _codecs(codecs)
    rows = [[_checks.buffer(b) for b in row] for row in blobs]
    block_rows = _checks.rows(block_rows, "block_rows", 1)
    return _core.decode_calibrated_blocks([c._c for c in cs], rows, block_rows, _checks.threads(threads))


def decode_blocks_into(codecs: Sequence[CalibratedCodec], blobs: Sequence[Sequence[bytes]], block_rows: int,
                       out: np.ndarray, at: int, *, threads: Optional[int] = None) -> None:
    """:func:`decode_blocks` into rows ``at ..`` of each row set of ``out``, a C-contiguous
    writeable float32 ``[G, rows, D]`` array (the rest of it left as it is): the same values,
    without an array of their own. Refused as :func:`decode_blocks` refuses, and
    InvalidInputError for an ``out`` of another shape, dtype or layout or one the blocks do not
    fit, before anything is written."""
    cs = _codecs(codecs)
    rows = [[_checks.buffer(b) for b in row] for row in blobs]
    block_rows = _checks.rows(block_rows, "block_rows", 1)
    at = _checks.rows(at, "at")
    _core.decode_calibrated_blocks_into([c._c for c in cs], rows, block_rows, _checks.out_rows(out), at,
                                        _checks.threads(threads))


def _codecs(codecs: Sequence[CalibratedCodec]) -> List[CalibratedCodec]:
    cs = list(codecs)
    for c in cs:
        if not isinstance(c, CalibratedCodec):
            raise TypeError(f"codecs must hold CalibratedCodec objects, got {_checks._type(c)}")
    return cs


def _from_dict(d: Dict[str, Any]) -> CalibratedCodec:
    """:meth:`CalibratedCodec.__reduce__`'s inverse."""
    return CalibratedCodec(**d)
