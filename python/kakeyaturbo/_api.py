"""The public functions: argument checks in one place, then one call into ``_core``."""

from __future__ import annotations

import difflib
import json
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _core
from .errors import InvalidInputError, InvalidParameterError

#: Every codec keyword argument and its default. The one table the names are checked against.
DEFAULTS: Dict[str, Any] = {
    "metric": "mse",
    "block_size": 512,
    "bit_width": 3,
    "variance_ratio": 0.95,
    "k": 16,
    "rotation_seed": 0xCAFEBABE,
    "kmeans_max_iter": 32,
    "pca_method": "exact",
    "rsvd_target_rank": None,
    "rsvd_oversample": 8,
    "rsvd_power_iters": 2,
    "skeleton_dtype": "fp16",
    "rank_cap": None,
    "exact_rank_cap": None,
    "centroids": None,
    "centroids_file": None,
    "outlier_threshold": None,
    "share_basis": False,
}

#: Keyword arguments that are not codec parameters.
_EXTRA = ("weights", "threads")


def _params(fn: str, kwargs: Dict[str, Any], allowed_extra: Tuple[str, ...] = _EXTRA) -> Dict[str, Any]:
    unknown = [k for k in kwargs if k not in DEFAULTS and k not in allowed_extra]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(DEFAULTS) + list(allowed_extra), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}{hint}")
    p = {k: kwargs.get(k, v) for k, v in DEFAULTS.items()}
    rc, erc = p.pop("rank_cap"), p.pop("exact_rank_cap")
    if rc is not None and erc is not None and rc != erc:
        raise InvalidParameterError(
            f"rank_cap={rc} and its alias exact_rank_cap={erc} disagree"
        )
    p["rank_cap"] = rc if rc is not None else erc
    path = p.pop("centroids_file")
    if path is not None:
        if p["centroids"] is not None:
            raise InvalidParameterError("give centroids or centroids_file, not both")
        p["centroids"] = load_centroids(path)
    if p["centroids"] is not None:
        c = np.asarray(p["centroids"], dtype=np.float64)
        if c.ndim != 1:
            raise InvalidParameterError(f"centroids must be 1-D, got shape {c.shape}")
        p["centroids"] = [float(v) for v in c]
    return p


def load_centroids(path: "os.PathLike[str] | str") -> np.ndarray:
    """Reads a centroid table: a ``.npy`` array, or JSON (a list, or an object whose
    ``"centroids"`` entry is a list)."""
    path = os.fspath(path)
    try:
        if path.endswith(".npy"):
            table = np.load(path, allow_pickle=False)
        else:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            if isinstance(data, dict):
                data = data.get("centroids")
            table = np.asarray(data, dtype=np.float64)
    except (OSError, ValueError) as e:
        raise InvalidParameterError(f"cannot read centroids_file {path!r}: {e}") from e
    if table.ndim != 1 or table.size == 0:
        raise InvalidParameterError(f"centroids_file {path!r} does not hold a 1-D table")
    return table.astype(np.float64)


def _matrix(array: Any, name: str = "array") -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {type(array).__name__}")
    if array.dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {array.dtype}")
    if array.ndim != 2:
        raise InvalidInputError(f"{name} must be 2-D [N, D], got shape {array.shape}")
    # Non-contiguous views are copied once here (documented); the core reads one flat slice.
    return np.ascontiguousarray(array)


def _weights(weights: Any, n: int) -> Optional[np.ndarray]:
    if weights is None:
        return None
    w = np.asarray(weights)
    if w.dtype.kind not in "fiu":
        raise TypeError(f"weights must be numeric, got dtype {w.dtype}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 1 or w.shape[0] != n:
        raise InvalidInputError(f"weights must have shape ({n},), got {w.shape}")
    return w


def _threads(threads: Any) -> Optional[int]:
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int, got {type(threads).__name__}")
    if threads < 1:
        raise InvalidParameterError(f"threads must be >= 1, got {threads}")
    return threads


def roundtrip_layer(array: np.ndarray, **kwargs: Any) -> Tuple[np.ndarray, Dict[str, Any]]:
    """Encodes and decodes a layer tensor; returns ``(decoded, report)``.

    ``array``: float32 ``[N, D]``. Returns a float32 ``[N, D]`` array (every row, the tail
    included) and a report dict (see the README's API table).
    Raises TypeError (wrong dtype, unknown keyword), InvalidInputError, InvalidParameterError.
    """
    p = _params("roundtrip_layer", kwargs)
    x = _matrix(array)
    return _core.roundtrip_layer(
        x, p, _weights(kwargs.get("weights"), x.shape[0]), _threads(kwargs.get("threads"))
    )


def encode_layer(array: np.ndarray, **kwargs: Any) -> bytes:
    """Encodes a float32 ``[N, D]`` tensor into a self-describing container (bytes)."""
    p = _params("encode_layer", kwargs)
    x = _matrix(array)
    return _core.encode_layer(
        x, p, _weights(kwargs.get("weights"), x.shape[0]), _threads(kwargs.get("threads"))
    )


def _buffer(data: Any) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"data must be bytes-like, got {type(data).__name__}")


def decode_layer(data: Any, *, threads: Optional[int] = None) -> np.ndarray:
    """Decodes a container into float32 ``[N, D]``. Raises CorruptDataError (truncated or
    corrupted bytes) or UnsupportedVersionError (a newer format)."""
    return _core.decode_layer(_buffer(data), _threads(threads))


def inspect_layer(data: Any) -> Dict[str, Any]:
    """Parameters, shape and byte breakdown of a container, without decoding it."""
    return _core.inspect_layer(_buffer(data))


def encode_block_codes(array: np.ndarray, **kwargs: Any) -> Dict[str, Any]:
    """Encodes ``array`` (float32 ``[n, D]``) as ONE block and returns its named parts.

    Skeleton: ``mean [D]``, ``basis [d_eff, D]``, ``centers [k, d_eff]`` (the stored, rounded
    values), ``d_eff``, ``k``, ``bands``, ``wht_len``. Codes: ``seg_id [n] int32``, ``t``/``norm``
    ``[n] float32`` (stored values) with their fp16 ``*_bits`` and shared ``*_exp``,
    ``residual_packed`` (bytes), ``residual_codes [n, d_eff] uint8``, ``outlier_pos [m] int64``
    (flat ``row * d_eff + col``), ``outlier_val [m] float32``, ``outlier_bits [m] uint16``.
    ``block_size`` and ``share_basis`` do not apply to a single block and are ignored.
    """
    p = _params("encode_block_codes", kwargs, allowed_extra=("weights",))
    x = _matrix(array)
    return _core.encode_block_codes(x, p, _weights(kwargs.get("weights"), x.shape[0]))


def decode_block_from_parts(parts: Dict[str, Any]) -> np.ndarray:
    """Decodes the parts dict of :func:`encode_block_codes` into float32 ``[n, D]``."""
    if not isinstance(parts, dict):
        raise TypeError(f"parts must be a dict, got {type(parts).__name__}")
    return _core.decode_block_from_parts(parts)


def wht_sign_pattern(seed: int, n: int) -> np.ndarray:
    """The +-1 float32 pattern of length ``n`` for ``seed`` (SplitMix64, sign of the top bit)."""
    return _core.wht_sign_pattern(seed, n)


def wht_rows(x: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform of each row of float32 ``[n, W]``, W a power of 2."""
    return _core.wht_rows(_matrix(x, "x"))


def rotate_rows(x: np.ndarray, seed: int) -> np.ndarray:
    """``H (s * x)`` for each row of float32 ``[n, W]``, ``s = wht_sign_pattern(seed, W)``."""
    return _core.rotate_rows(_matrix(x, "x"), seed)


def inverse_rotate_rows(y: np.ndarray, seed: int) -> np.ndarray:
    """``s * (H y) / W`` for each row: the inverse of :func:`rotate_rows`."""
    return _core.inverse_rotate_rows(_matrix(y, "y"), seed)


def pack_bits(values: Any, bits: int) -> bytes:
    """Packs integers ``< 2**bits`` (bits in 1..8) LSB-first into bytes."""
    v = np.asarray(values)
    if v.dtype.kind not in "iu":
        raise TypeError(f"values must be integers, got dtype {v.dtype}")
    if v.size and (v.min() < 0 or v.max() > 255):
        raise InvalidParameterError(f"values must fit in {bits} bits")
    return _core.pack_bits(np.ascontiguousarray(v.ravel(), dtype=np.uint8), bits)


def unpack_bits(data: Any, bits: int, count: int) -> np.ndarray:
    """Unpacks ``count`` values of ``bits`` bits (LSB-first) into a uint8 array."""
    return _core.unpack_bits(_buffer(data), bits, count)


def centroids_gaussian(bits: int) -> np.ndarray:
    """The exact N(0, 1) Lloyd-Max table with ``2**bits`` ascending float32 centroids."""
    return _core.centroids_gaussian(bits)
