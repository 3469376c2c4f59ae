"""Argument checks of the public codec functions, written once.

The rule everywhere: a value of the wrong type is a ``TypeError`` naming the argument and what
it got; a value of the right type outside its range is an ``InvalidParameterError`` (or
``InvalidInputError`` for data) naming the argument and the range. The Rust core checks again
(it trusts nothing it is handed); these checks exist so that the message names the Python
argument and no conversion (float to int, huge int to u64) happens silently.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Iterator, Mapping, Optional, Sequence, Tuple

import numpy as np

from .._core import MAX_DIM, MAX_ROWS
from ..errors import InvalidInputError, InvalidParameterError

#: Largest 64-bit seed.
MAX_SEED = 2**64 - 1

#: The most centroids a table holds: one per code of the widest index (8 bits).
MAX_CENTROIDS = 256


def _type(v: Any) -> str:
    return type(v).__name__


@contextlib.contextmanager
def held(name: str) -> Iterator[None]:
    """Around numpy's copies and whole-array tests of caller arrays: a MemoryError (a broadcast
    view describes more values than memory holds; the allocation is refused, nothing is taken)
    as InvalidInputError naming the argument."""
    try:
        yield
    except MemoryError:
        raise InvalidInputError(f"{name} describes more values than this machine can hold") from None


def matrix(array: Any, name: str = "array", cols: int = MAX_DIM) -> np.ndarray:
    """A C-contiguous float32 ``[N, D]`` view of ``array`` (copied once if not contiguous), ``N``
    at most ``MAX_ROWS`` and ``D`` at most ``cols`` (the codecs' ``MAX_DIM``; 0: any, for the
    rotations of any power-of-two width), both checked before the copy."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {_type(array)}")
    if array.dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {array.dtype}")
    if array.ndim != 2:
        raise InvalidInputError(f"{name} must be 2-D [N, D], got shape {array.shape}")
    if array.shape[0] > MAX_ROWS:
        raise InvalidInputError(f"{name}: N = {array.shape[0]} rows exceeds the supported maximum {MAX_ROWS}")
    if cols and array.shape[1] > cols:
        raise InvalidInputError(f"{name}: D = {array.shape[1]} exceeds the supported maximum {cols}")
    with held(name):
        return np.ascontiguousarray(array)


def row_sets(array: Any, block_rows: Any) -> Tuple[np.ndarray, int]:
    """A C-contiguous float32 ``[G, T, D]`` view of ``array`` (copied once if not contiguous)
    and ``block_rows`` checked (an integer >= 1): for the calls that code ``G`` row sets in blocks
    of ``block_rows`` rows. TypeError for another type or dtype, InvalidInputError for another
    rank, InvalidParameterError for ``block_rows`` outside ``1 .. MAX_ROWS``."""
    if not isinstance(array, np.ndarray) or array.dtype != np.float32:
        raise TypeError(f"array must be a numpy.ndarray of float32, got {_type(array)}")
    if array.ndim != 3:
        raise InvalidInputError(f"array must be 3-D [G, T, D], got shape {array.shape}")
    block_rows = rows(block_rows, "block_rows", 1)
    with held("array"):
        return np.ascontiguousarray(array), block_rows


def out_rows(out: Any) -> np.ndarray:
    """``out`` for a decode written in place: a writeable C-contiguous float32 ``[G, rows, D]``
    array, else InvalidInputError."""
    if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.ndim == 3
            and out.flags.c_contiguous and out.flags.writeable):
        raise InvalidInputError("out must be a writeable C-contiguous float32 [G, rows, D] array, got "
                                f"{_type(out)} {getattr(out, 'dtype', '')} {getattr(out, 'shape', '')}")
    return out


def out_heads(out: Any, b: int, h: int) -> np.ndarray:
    """``out``, a C-contiguous ``[b, h, rows, D]`` array, as the ``[b * h, rows, D]`` view a
    decode in place writes (a reshape of any other would write into a copy), else
    InvalidInputError."""
    if not (isinstance(out, np.ndarray) and out.ndim == 4 and out.shape[:2] == (b, h)
            and out.flags.c_contiguous):
        raise InvalidInputError(f"out must be a C-contiguous [{b}, {h}, rows, D] array, got "
                                f"{getattr(out, 'shape', _type(out))}")
    return out.reshape(b * h, *out.shape[2:])


def weights(w: Any, n: int) -> Optional[np.ndarray]:
    """Per-row weights as contiguous float32 ``[n]``, or None."""
    if w is None:
        return None
    a = np.asarray(w)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"weights must be numeric, got dtype {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim != 1 or a.shape[0] != n:
        raise InvalidInputError(f"weights must have shape ({n},), got {a.shape}")
    return a


def integer(v: Any, name: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """A Python or numpy integer (not a bool, not a float) within ``[lo, hi]``."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_type(v)} {v!r}")
    i = int(v)
    if (lo is not None and i < lo) or (hi is not None and i > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}" if lo is not None else f"<= {hi}"
        raise InvalidParameterError(f"{name} must be {rng}, got {i}")
    return i


def rows(v: Any, name: str, lo: int = 0) -> int:
    """A count or index of rows: an integer in ``lo .. MAX_ROWS`` (InvalidParameterError past
    it, not an OverflowError where the core takes it)."""
    return integer(v, name, lo, MAX_ROWS)


def seed(v: Any, name: str = "rotation_seed") -> int:
    """A 64-bit unsigned seed."""
    return integer(v, name, 0, MAX_SEED)


def threads(t: Any) -> Optional[int]:
    """None (all cores) or a thread count >= 1."""
    return None if t is None else integer(t, "threads", 1)


def real(v: Any, name: str, *, positive: bool = False) -> float:
    """A finite real number (int or float, not a bool or a string); ``> 0`` if ``positive``."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_type(v)} {v!r}")
    try:
        f = float(v)
    except OverflowError:  # an int past float64's range
        raise InvalidParameterError(f"{name} must be finite, got an integer of {int(v).bit_length()} bits") from None
    if not np.isfinite(f) or (positive and f <= 0):
        raise InvalidParameterError(f"{name} must be finite{' and > 0' if positive else ''}, got {f}")
    return f


def boolean(v: Any, name: str) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {_type(v)} {v!r}")
    return bool(v)


def choice(v: Any, name: str, options: Sequence[str]) -> str:
    """One of ``options`` (a str)."""
    if not isinstance(v, str):
        raise TypeError(f"{name} must be a str, one of {list(options)}, got {_type(v)} {v!r}")
    if v not in options:
        raise InvalidParameterError(f"{name} must be one of {list(options)}, got {v!r}")
    return v


def mapping(v: Any, name: str) -> Mapping[Any, Any]:
    if not isinstance(v, Mapping):
        raise TypeError(f"{name} must be a dict, got {_type(v)}")
    return v


def buffer(data: Any) -> bytes:
    """Bytes of a bytes-like argument."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"data must be bytes-like, got {_type(data)}")


def vector(v: Any, name: str, dtype: Any, most: int = MAX_DIM) -> np.ndarray:
    """A numeric 1-D array of at most ``most`` values (a calibration's: one per channel or
    component), converted to ``dtype`` once, after its length is checked."""
    a = np.asarray(v)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be numeric, got dtype {a.dtype}")
    if a.ndim != 1 or a.shape[0] > most:
        raise InvalidParameterError(f"{name} must be 1-D with at most {most} values, got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=dtype)


def table(v: Any, name: str) -> np.ndarray:
    """A numeric 2-D ``[m, D]`` array (both at most ``MAX_DIM``) as contiguous float32."""
    a = np.asarray(v)
    if a.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be numeric, got dtype {a.dtype}")
    if a.ndim != 2 or max(a.shape) > MAX_DIM:
        raise InvalidParameterError(f"{name} must be 2-D [m, D], both at most {MAX_DIM}, got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)
