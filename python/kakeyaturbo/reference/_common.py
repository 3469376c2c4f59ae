"""What the per-block and the calibrated references share: the format's sign pattern, the
butterfly of ``wht.rs``, the shared-exponent fp16 of ``f16.rs``, the decision thresholds, the
fp16 outliers and the ``inner_product`` gain, and the conversion of parts-dict values to
tensors. Each follows the Rust arithmetic in f32 where the order decides a code."""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import numpy as np
import torch

from ..errors import InvalidInputError, InvalidParameterError

_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=256)
def _signs(seed: int, n: int) -> Tuple[float, ...]:
    state = seed & _MASK64
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        out.append(-1.0 if z >> 63 else 1.0)
    return tuple(out)


def sign_pattern(seed: int, n: int, device: Any = None) -> torch.Tensor:
    """The +-1 float32 pattern of length ``n`` (FORMAT.md: SplitMix64, -1 where bit 63 is set).

    Computed with Python integers, independently of the extension."""
    return torch.tensor(_signs(int(seed), int(n)), dtype=torch.float32, device=device)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Sylvester-Hadamard transform over the last axis (a power of two), by the
    radix-2 butterfly ``h = 1, 2, 4, ...: (a, b) -> (a + b, a - b)`` of ``wht.rs``."""
    w = x.shape[-1]
    if w & (w - 1):
        raise InvalidInputError(f"fwht needs a power-of-two length, got {w}")
    lead = x.shape[:-1]
    h = 1
    while h < w:
        v = x.reshape(*lead, w // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, w)
        h *= 2
    return x


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as float32 for integer ``e`` in [-126, 127], exact (built from the bits)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def shared_exponent(values: torch.Tensor) -> torch.Tensor:
    """The smallest ``e`` in [-126, 127] with ``max|v| * 2**-e <= 32768`` (0 when all values are
    zero or the maximum is not finite), as a 0-d int32 tensor (``f16.rs``)."""
    m = values.abs().max() if values.numel() else torch.zeros((), device=values.device)
    mant, ex = torch.frexp(m)
    # m = mant * 2**ex with mant in [0.5, 1): ceil(log2 m) is ex, or ex - 1 for a power of two.
    e = ex - 15 - (mant == 0.5).to(torch.int32)
    e = e.clamp(-126, 127)
    ok = (m > 0) & torch.isfinite(m)
    return torch.where(ok, e, torch.zeros_like(e)).to(torch.int32)


def scaled_f16(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stores ``values`` (float32) as fp16 mantissas with one shared exponent.

    Returns ``(exp, bits, stored)``: 0-d int32, uint16 bits like ``values``, and the stored
    float32 values ``f32(h) * 2**exp``."""
    e = shared_exponent(values)
    # 2**-e is a normal f32 for every exponent a finite f32 maximum produces, so the product is
    # exact and the fp16 conversion (round to nearest even) is the only rounding.
    h = (values * pow2(-e)).to(torch.float16)
    return e, h.view(torch.uint16), h.to(torch.float32) * pow2(e)


def thresholds(centroids: torch.Tensor) -> torch.Tensor:
    """Decision thresholds ``0.5 * (c_i + c_{i+1})`` in f32 (part of the format)."""
    return 0.5 * (centroids[:-1] + centroids[1:])


def outliers(
    z: torch.Tensor, q: torch.Tensor, threshold: Optional[float]
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fp16 outliers of ``z`` (float32 ``[n, m]``): values with ``|z| > threshold`` are
    stored as fp16 (saturated at +-65504) and override the centroids ``q`` (``[n, m]``).

    Returns ``(q, pos, bits)``: ``q`` with the overrides, the flat positions ``row * m + j``
    (int64 ``[k]``, ascending) and the fp16 bit patterns (int16 ``[k]``); no outliers when
    ``threshold`` is None."""
    if threshold is None:
        empty_pos = torch.zeros(0, dtype=torch.int64, device=z.device)
        return q, empty_pos, torch.zeros(0, dtype=torch.int16, device=z.device)
    flag = z.abs() > torch.tensor(threshold, dtype=torch.float32, device=z.device)
    h = z.clamp(-65504.0, 65504.0).to(torch.float16)
    q = torch.where(flag, h.to(torch.float32), q)
    pos = torch.nonzero(flag.reshape(-1))[:, 0]
    return q, pos.to(torch.int64), h.reshape(-1)[pos].view(torch.int16)


def gain(z: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The ``inner_product`` least-squares gain ``scale * (<z, q> / <q, q>)`` of every row
    (float32 ``[n]``; ``scale`` itself where ``q`` is zero), before its fp16 rounding."""
    qq = (q * q).sum(dim=1)
    zq = (z * q).sum(dim=1)
    return torch.where(qq > 0, scale * (zq / torch.where(qq > 0, qq, torch.ones_like(qq))), scale)


def as_tensor(v: Any, device: Any, dtype: torch.dtype) -> torch.Tensor:
    """A parts-dict value (a tensor, bytes, or anything numpy reads; uint16 bit patterns
    widened first, as torch has no general uint16) as a ``dtype`` tensor on ``device``."""
    if isinstance(v, torch.Tensor):
        return v.to(device=device, dtype=dtype)
    if isinstance(v, (bytes, bytearray)):
        return torch.frombuffer(bytearray(v), dtype=torch.uint8).to(device=device, dtype=dtype)
    a = np.asarray(v)
    if a.dtype == np.uint16:
        a = a.astype(np.int32)
    return torch.as_tensor(a).to(device=device, dtype=dtype)


def check_finite(name: str, x: torch.Tensor) -> None:
    """InvalidInputError naming the first non-finite value of ``x [n, D]`` (as Rust does)."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        r, c = (int(v) for v in torch.nonzero(bad)[0])
        v = float(x[r, c])
        shown = "NaN" if v != v else ("inf" if v > 0 else "-inf")
        raise InvalidInputError(f"{name}: non-finite value {shown} at row {r}, column {c}")


def exponent(parts: Any, key: str) -> int:
    """``parts[key]``, a shared fp16 exponent: InvalidParameterError outside -126..=127."""
    e = int(parts[key])
    if not -126 <= e <= 127:
        raise InvalidParameterError(f'parts["{key}"] must be in -126..=127, got {e}')
    return e


def counted(v: torch.Tensor, key: str, n: int, what: str) -> torch.Tensor:
    """``v`` flattened, or InvalidInputError unless it holds ``n`` values."""
    v = v.reshape(-1)
    if v.numel() != n:
        raise InvalidInputError(f'parts["{key}"] has {v.numel()} values, expected {what} = {n}')
    return v


def bits_to_f32(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of fp16 bit patterns (any integer dtype holding the 16 bits)."""
    return bits.to(torch.int32).to(torch.int16).view(torch.float16).to(torch.float32)
