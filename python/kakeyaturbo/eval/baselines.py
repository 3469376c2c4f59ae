"""The baselines of EVAL.md, as plain numpy quantisers of one head's ``[T, D]`` float32 tensor.

Each returns ``(decoded, bits)``: the float32 reconstruction and the all-in bits it costs
(payload plus every scale, zero point and full-precision token). They are the methods people
use today, re-implemented from their published formulas so that the codec is measured against
them in the same harness (``kakeyaturbo.eval.peers`` runs real libraries instead).

A name with the suffix ``+sink`` (``fp8_e4m3+sink``) is the same quantiser with the first
token kept raw (counted at 16 bits), as the codec's recipes keep it: the pair of rows
separates what the attention sink buys from what the quantiser does.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import numpy as np

from ..codec import primitives

Quantised = Tuple[np.ndarray, int]

FP8_E4M3_MAX = 448.0


def _f16(v: np.ndarray) -> np.ndarray:
    """Round to fp16 and back: the stored precision of scales and norms."""
    return np.asarray(v, dtype=np.float16).astype(np.float32)


def round_e4m3(v: np.ndarray) -> np.ndarray:
    """Round to the nearest FP8 E4M3 value (ties to even), saturating at +-448. E4M3: 3
    mantissa bits, exponent bias 7, smallest normal 2^-6, subnormal step 2^-9."""
    a = np.minimum(np.abs(v.astype(np.float64)), FP8_E4M3_MAX)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = np.exp2(np.maximum(e, -6) - 3)
    q = np.minimum(np.round(a / step) * step, FP8_E4M3_MAX)
    return (np.sign(v) * q).astype(np.float32)


def round_bf16(v: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and back."""
    u = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def fp8_e4m3(x: np.ndarray) -> Quantised:
    """FP8 E4M3 with one fp16 scale per token (per token-head): absmax maps to 448."""
    scale = _f16(np.abs(x).max(axis=1, keepdims=True) / FP8_E4M3_MAX)
    safe = np.where(scale > 0, scale, 1.0)
    y = round_e4m3(x / safe) * scale
    return y.astype(np.float32), x.size * 8 + x.shape[0] * 16


def int4_absmax(x: np.ndarray) -> Quantised:
    """Symmetric int4 (levels -7..7) with one fp16 absmax scale per token-head."""
    scale = _f16(np.abs(x).max(axis=1, keepdims=True) / 7.0)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.round(x / safe), -7, 7)
    return (q * scale).astype(np.float32), x.size * 4 + x.shape[0] * 16


def _asym(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Asymmetric min/max quantisation along `axis` with fp16 scale and zero point."""
    lo = _f16(x.min(axis=axis, keepdims=True))
    hi = _f16(x.max(axis=axis, keepdims=True))
    levels = 2**bits - 1
    scale = _f16((hi - lo) / levels)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.round((x - lo) / safe), 0, levels)
    return (q * scale + lo).astype(np.float32)


def kivi(x: np.ndarray, stream: str, bits: int = 2, group: int = 32, recent: int = 128) -> Quantised:
    """KIVI: keys per channel (groups of `group` tokens), values per token (groups of `group`
    channels), `bits`-bit asymmetric with fp16 scale and zero point; the newest `recent`
    tokens, and any tokens short of a full key group, stay in fp16."""
    t, d = x.shape
    n_q = max(0, t - recent) // group * group
    y = x.astype(np.float32).copy()
    cost = (t - n_q) * d * 16
    if n_q:
        head = x[:n_q]
        if stream == "k":
            g = head.reshape(n_q // group, group, d)
            y[:n_q] = _asym(g, bits, axis=1).reshape(n_q, d)
            cost += n_q * d * bits + (n_q // group) * d * 32
        elif stream == "v":
            if d % group:
                raise ValueError(f"KIVI value groups of {group} need D divisible by {group}")
            g = head.reshape(n_q, d // group, group)
            y[:n_q] = _asym(g, bits, axis=2).reshape(n_q, d)
            cost += n_q * d * bits + n_q * (d // group) * 32
        else:
            raise ValueError(f"stream must be 'k' or 'v', got {stream!r}")
    y[n_q:] = _f16(x[n_q:])
    return y, cost


def turboquant(x: np.ndarray, bits: int, seed: int = 0x7B) -> Quantised:
    """TurboQuant-style: random-sign Hadamard rotation (the codec's primitive), the unit vector
    scaled by sqrt(D) quantised with the N(0,1) Lloyd-Max table, and an fp16 norm per vector.
    D must be a power of two."""
    norm = np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    safe = np.where(norm > 0, norm, 1.0)
    # rotate_rows is unnormalised: |H s u| = sqrt(D) |u|, so unit rows land at coordinate RMS 1.
    y = primitives.rotate_rows(np.ascontiguousarray(x / safe, dtype=np.float32), seed)
    table = primitives.centroids_gaussian(bits)
    idx = np.searchsorted((table[1:] + table[:-1]) / 2, y, side="left")
    u = primitives.inverse_rotate_rows(np.ascontiguousarray(table[idx]), seed)
    return (u * _f16(norm)).astype(np.float32), x.size * bits + x.shape[0] * 16


#: name -> quantiser of one stream ("k" or "v") of one head.
BASELINES: Dict[str, Callable[[np.ndarray, str], Quantised]] = {
    "identity": lambda x, s: (x.astype(np.float32), x.size * 16),
    "bf16": lambda x, s: (round_bf16(x), x.size * 16),
    "fp8_e4m3": lambda x, s: fp8_e4m3(x),
    "int4": lambda x, s: int4_absmax(x),
    "kivi2": lambda x, s: kivi(x, s),
    "turboquant3": lambda x, s: turboquant(x, 3),
    "turboquant4": lambda x, s: turboquant(x, 4),
}

#: The suffix of a baseline run with the first token kept raw (``n_sink = 1``).
SINK_SUFFIX = "+sink"


def parse(name: str) -> Tuple[str, int]:
    """``(base name, n_sink)`` of a baseline name: ``"int4+sink"`` -> ``("int4", 1)``."""
    if name.endswith(SINK_SUFFIX):
        return name[: -len(SINK_SUFFIX)], 1
    return name, 0


def known(name: str) -> bool:
    """Whether ``name`` is a baseline (with or without ``+sink``)."""
    return parse(name)[0] in BASELINES
