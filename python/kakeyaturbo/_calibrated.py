"""The calibrated mode: a codec object holding one model-level calibration (see FORMAT.md)."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from . import _core
from ._api import _buffer, _matrix, _threads
from .errors import InvalidParameterError

DEFAULT_ROTATION_SEED = 0xCAFEBABE


def _vector(v: Any, name: str, dtype: Any) -> np.ndarray:
    a = np.asarray(v)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be numeric, got dtype {a.dtype}")
    if a.ndim != 1:
        raise InvalidParameterError(f"{name} must be 1-D, got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=dtype)


def _table(v: Any, name: str) -> np.ndarray:
    a = np.asarray(v)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be numeric, got dtype {a.dtype}")
    if a.ndim != 2:
        raise InvalidParameterError(f"{name} must be 2-D [m, D], got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


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
        if b.size and (b.min() < 1 or b.max() > 8):
            raise InvalidParameterError("bits must be in 1..8 (leave 0-bit components out)")
        tables = None
        if centroids is not None:
            tables = [(int(k), [float(x) for x in _vector(v, f"centroids[{k}]", np.float64)])
                      for k, v in centroids.items()]
        if not isinstance(norm, bool):
            raise TypeError(f"norm must be a bool, got {type(norm).__name__}")
        self._c = _core.CalibratedCodec(
            _vector(mean, "mean", np.float32), _table(analysis, "analysis"),
            _table(synthesis, "synthesis"), _vector(spread, "spread", np.float32),
            _vector(b, "bits", np.uint8), int(rotation_seed), str(metric), norm,
            None if outlier_threshold is None else float(outlier_threshold), tables)
        self.metric = str(metric)
        self.norm = norm
        self.rotation_seed = int(rotation_seed)
        self.outlier_threshold = outlier_threshold

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

    def canonical_bytes(self) -> bytes:
        """The calibration's canonical bytes (what ``fingerprint`` hashes, ``model_bytes`` long)."""
        return self._c.canonical_bytes()

    def encode(self, array: np.ndarray, *, threads: Optional[int] = None) -> bytes:
        """Encodes float32 ``[n, D]`` rows into a calibrated container (bytes)."""
        return self._c.encode(_matrix(array), _threads(threads))

    def decode(self, data: Any, *, threads: Optional[int] = None) -> np.ndarray:
        """Decodes a container of this calibration into float32 ``[n, D]``. Raises
        CorruptDataError for damaged bytes, InvalidParameterError for another calibration's."""
        return self._c.decode(_buffer(data), _threads(threads))

    def roundtrip(self, array: np.ndarray, *, threads: Optional[int] = None
                  ) -> Tuple[np.ndarray, Dict[str, Any]]:
        """Encode + decode; returns ``(decoded, report)`` (bytes by part, errors, timings)."""
        return self._c.roundtrip(_matrix(array), _threads(threads))

    def encode_parts(self, array: np.ndarray) -> Dict[str, Any]:
        """Every intermediate of an encode by name: ``z [n, m]`` (scaled rotated coordinates),
        ``g [n]`` (the scale divided by), ``indices [n, m] uint8``, ``codes`` (packed rows),
        ``scale``/``scale_exp``/``scale_bits`` (with ``norm``), ``outlier_pos [k] int64`` (flat
        ``row * m + j``), ``outlier_val``/``outlier_bits``."""
        return self._c.encode_parts(_matrix(array))

    def decode_parts(self, parts: Dict[str, Any]) -> np.ndarray:
        """Decodes a parts dict as :meth:`encode_parts` returns it."""
        if not isinstance(parts, dict):
            raise TypeError(f"parts must be a dict, got {type(parts).__name__}")
        return self._c.decode_parts(parts)

    def inspect(self, data: Any) -> Dict[str, Any]:
        """Header fields and byte counts of a container of this calibration."""
        return self._c.inspect(_buffer(data))

    def __repr__(self) -> str:
        return (f"CalibratedCodec(d={self.d}, m={self.m}, row_bits={self.row_bits}, "
                f"fingerprint={self.fingerprint:016x})")
