"""The stages' primitives, exposed as the oracle the GPU kernels and other implementations are
checked against: the seeded sign pattern and Walsh-Hadamard rotation (stage 4), bit packing
(stage 5c) and the N(0, 1) Lloyd-Max tables (stage 5b)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _core
from ..errors import InvalidInputError, InvalidParameterError
from . import _checks


def wht_sign_pattern(seed: int, n: int) -> np.ndarray:
    """The +-1 float32 pattern of length ``n`` for ``seed`` (SplitMix64, sign of the top bit)."""
    return _core.wht_sign_pattern(_checks.seed(seed, "seed"), _checks.integer(n, "n", 0))


def _finite_in(x: Any, name: str) -> np.ndarray:
    a = _checks.matrix(x, name, cols=0)
    if not np.isfinite(a).all():
        raise InvalidInputError(f"{name} must be finite (it holds NaN or inf)")
    return a


def _finite_out(y: np.ndarray, name: str) -> np.ndarray:
    if not np.isfinite(y).all():
        raise InvalidInputError(f"the transform of {name} overflows float32: its values are too "
                                f"large (up to {float(np.abs(y[np.isfinite(y)]).max(initial=0)):.3g} "
                                "where finite)")
    return y


def wht_rows(x: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform of each row of float32 ``[n, W]``, W a power of 2.

    InvalidInputError for a non-finite ``x`` or one whose transform overflows float32."""
    return _finite_out(_core.wht_rows(_finite_in(x, "x")), "x")


def rotate_rows(x: np.ndarray, seed: int) -> np.ndarray:
    """``H (s * x)`` for each row of float32 ``[n, W]``, ``s = wht_sign_pattern(seed, W)``.

    InvalidInputError for a non-finite ``x`` or one whose transform overflows float32."""
    return _finite_out(_core.rotate_rows(_finite_in(x, "x"), _checks.seed(seed, "seed")), "x")


def inverse_rotate_rows(y: np.ndarray, seed: int) -> np.ndarray:
    """``s * (H y) / W`` for each row: the inverse of :func:`rotate_rows` (checked as it is)."""
    return _finite_out(_core.inverse_rotate_rows(_finite_in(y, "y"), _checks.seed(seed, "seed")),
                       "y")


def pack_bits(values: Any, bits: int) -> bytes:
    """Packs integers ``< 2**bits`` (bits in 1..8) LSB-first into bytes."""
    bits = _checks.integer(bits, "bits", 1, 8)
    v = np.asarray(values)
    if v.dtype.kind not in "iu":
        raise TypeError(f"values must be integers, got dtype {v.dtype}")
    if v.size and (v.min() < 0 or v.max() >= 2**bits):
        raise InvalidParameterError(
            f"values must be in 0..{2**bits - 1} to fit in {bits} bits, got {v.min()}..{v.max()}")
    return _core.pack_bits(np.ascontiguousarray(v.ravel(), dtype=np.uint8), bits)


def unpack_bits(data: Any, bits: int, count: int) -> np.ndarray:
    """Unpacks ``count`` values of ``bits`` bits (LSB-first) into a uint8 array."""
    return _core.unpack_bits(_checks.buffer(data), _checks.integer(bits, "bits", 1, 8),
                             _checks.integer(count, "count", 0))


def centroids_gaussian(bits: int) -> np.ndarray:
    """The exact N(0, 1) Lloyd-Max table with ``2**bits`` ascending float32 centroids."""
    return _core.centroids_gaussian(_checks.integer(bits, "bits", 1, 8))
