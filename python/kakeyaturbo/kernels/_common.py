"""Helpers shared by the kernel files of both modes: interpreter detection, output allocation
(with NaN poisoning for the parity tests), sizes, row counts, the batched outlier lists (their
row table, and their conversion from and to parts dicts), and the @triton.jit building blocks
every kernel that touches the format uses (fp16 with a shared exponent, the band-limited
Hadamard butterfly)."""

from __future__ import annotations

import contextlib
import functools
import numbers
from typing import Any, Dict, Iterator, Mapping, Sequence, Union

import numpy as np
import torch
import triton
import triton.language as tl

from ..errors import CorruptDataError, InvalidInputError, InvalidParameterError

_POISON = False

#: The range of the shared fp16 exponents (``f16.rs``).
MIN_EXP, MAX_EXP = -126, 127
#: The exponent bits of an fp16 value: all set for an infinity or a NaN.
F16_EXP_BITS = 0x7C00


def f16_nonfinite(bits: Any) -> Any:
    """Where fp16 bit patterns (a numpy array or torch tensor of integers) hold inf or NaN."""
    return (bits & F16_EXP_BITS) == F16_EXP_BITS


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter: ``TRITON_INTERPRET`` as Triton
    reads it (``1``, ``true``, ``on``; ``false`` or ``off`` is not the interpreter, which the
    test of ``0`` alone took for it), set before triton is first imported."""
    return bool(triton.knobs.runtime.interpret)


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Within this context every buffer the kernels allocate (outputs and scratch) starts as
    NaN (floats) or all-ones bits (integers), so an element a kernel forgot to write cannot
    look right. For tests; it costs one fill per buffer."""
    global _POISON
    old, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = old


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, or a poisoned buffer inside :func:`poison_outputs`."""
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    if _POISON:
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(-1 if dtype.is_signed else torch.iinfo(dtype).max)
    return t


@functools.lru_cache(maxsize=None)
def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element stand-in for the pointer argument of a disabled branch (never read or
    written). It has the real buffer's dtype, so the disabled and the enabled setting share one
    compiled kernel; cached, so it costs no allocation per call."""
    return torch.zeros(1, dtype=dtype, device=device)


def next_pow2(v: int) -> int:
    """Smallest power of two >= max(v, 1)."""
    return 1 << max(int(v) - 1, 0).bit_length()


def ceil_log2(v: int) -> int:
    return max(int(v) - 1, 0).bit_length()


def device_of(device: Any) -> torch.device:
    """``device`` as a torch device: InvalidParameterError for a name torch does not know
    (torch's RuntimeError before), TypeError for another kind of value."""
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise InvalidParameterError(f"device {device!r} is not a device torch knows ({e})") from None


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise InvalidInputError(f"{name} is on {t.device}, expected {device}")


RowsLike = Union[None, Sequence[int], torch.Tensor]


def on_host(t: torch.Tensor) -> bool:
    """True for a tensor in host memory: its values are checked like any host data (a tensor
    on a GPU that the library built is trusted: checking it would read the device)."""
    return t.device.type == "cpu"


def rows_tensor(rows: RowsLike, b: int, n: int, device: torch.device) -> torch.Tensor:
    """Row counts as int32 ``[B]`` on ``device``. Host counts (a sequence of ints, or a CPU
    tensor) are checked: TypeError for a count that is not an int, InvalidInputError unless
    there are ``B`` of them in 1..N. A tensor on a GPU is trusted (checking it would read the
    device); the kernels clamp every count to N, so a bad one cannot reach past the buffers."""
    if rows is None:
        return torch.full((b,), n, dtype=torch.int32, device=device)
    if isinstance(rows, torch.Tensor):
        if rows.shape != (b,) or rows.dtype != torch.int32:
            raise InvalidInputError(f"rows must be int32 [{b}], got {rows.dtype} {tuple(rows.shape)}")
        check_device("rows", rows, device)
        if on_host(rows) and b and not 1 <= int(rows.min()) <= int(rows.max()) <= n:
            raise InvalidInputError(f"rows must hold {b} counts in 1..{n}, got {rows.tolist()}")
        return rows
    try:
        items = list(rows)
    except TypeError:
        raise TypeError(f"rows must be a sequence of {b} ints or an int32 tensor, got "
                        f"{type(rows).__name__}") from None
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
            raise TypeError(f"rows must hold ints, got {type(v).__name__} {v!r}")
    vals = [int(v) for v in items]
    if len(vals) != b or any(not 1 <= v <= n for v in vals):
        raise InvalidInputError(f"rows must hold {b} counts in 1..{n}, got {vals}")
    return torch.tensor(vals, dtype=torch.int32, device=device)


def check_finite_rows(name: str, x: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    """InvalidInputError naming the first non-finite value of the live rows of ``x`` (``[B, N,
    D]``; block / head ``i`` has ``rows[i]`` rows, the others are not read). One reduction
    over ``x`` and one read of its result, on any device."""
    bad = ~torch.isfinite(x).all(dim=2)
    bad &= torch.arange(x.shape[1], device=x.device)[None, :] < rows[:, None]
    if bool(bad.any()):
        i, r = (int(v) for v in torch.nonzero(bad)[0])
        c = int(torch.nonzero(~torch.isfinite(x[i, r]))[0, 0])
        v = float(x[i, r, c])
        shown = "NaN" if v != v else ("inf" if v > 0 else "-inf")
        raise InvalidInputError(f"{name}: non-finite value {shown} at {what} {i}, row {r}, column {c}")


def check_out(out: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    """An ``out`` tensor of ``shape`` and ``dtype`` on ``device`` whose elements are distinct
    (no zero stride over an axis of more than one element, as an ``expand``-ed view has:
    programs writing different rows would race on it). Raises ValueError."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise InvalidInputError(f"out must be {dtype} {list(shape)}, got {out.dtype} {tuple(out.shape)}")
    check_device("out", out, device)
    if any(st == 0 and sz > 1 for st, sz in zip(out.stride(), out.shape)):
        raise InvalidInputError(f"out must not repeat elements (strides {out.stride()})")


def check_exponents(name: str, exps: Any, what: str = "block") -> None:
    """InvalidParameterError unless every shared exponent (host values) is in -126..=127."""
    for i, e in enumerate(np.asarray(exps).reshape(-1).tolist()):
        if not MIN_EXP <= e <= MAX_EXP:
            raise InvalidParameterError(f'{what} {i}: parts["{name}"] must be in {MIN_EXP}..={MAX_EXP}, got {e}')


def check_outlier_lists(codes: Mapping[str, torch.Tensor], cells: Sequence[int], what: str,
                        error: type = CorruptDataError) -> None:
    """Checks batched outlier lists in host memory: ``outlier_ptr`` must run from 0 to ``M``
    without decreasing (CorruptDataError), each entry's positions must be ascending and below
    its ``cells[i]`` (``error``), and every value a finite fp16 (``error``)."""
    ptr = codes["outlier_ptr"].tolist()
    m = int(codes["outlier_pos"].numel())
    if ptr[0] != 0 or ptr[-1] != m or any(a > b for a, b in zip(ptr, ptr[1:])):
        raise CorruptDataError(f"outlier_ptr must run from 0 to {m} (the outliers) without decreasing, got {ptr}")
    pos = codes["outlier_pos"]
    for i, c in enumerate(cells):
        p = pos[ptr[i]:ptr[i + 1]]
        if p.numel() and (int(p[0]) < 0 or int(p[-1]) >= c or bool((p[1:] <= p[:-1]).any())):
            raise error(f"{what} {i}: outlier positions out of range ({c} cells) or not ascending")
    bits = codes["outlier_bits"]
    if bits.numel() and bool(f16_nonfinite(bits).any()):
        raise error("outlier_bits holds a non-finite fp16 value")


def row_starts(codes: Mapping[str, torch.Tensor], d_eff: torch.Tensor, n: int, w: int) -> torch.Tensor:
    """int64 ``[B, N + 1]``: index into ``outlier_pos`` of the first outlier of each row (and
    of the end of the block), found on device by binary search of the sorted lists; ``w``
    bounds every ``d_eff``. Every start lies in ``0..M`` whatever the lists hold (corrupted
    lists on a GPU are not checked: that would read the device), so the kernels' reads stay in
    ``outlier_pos``."""
    ptr, pos = codes["outlier_ptr"], codes["outlier_pos"]
    b = d_eff.shape[0]
    # One sorted key over all blocks: block * stride + position, stride > any n * d_eff.
    stride = n * w + 1
    # The block of entry j: the number of blocks ending at or before j (in 0..B - 1 always).
    idx = torch.arange(pos.numel(), device=pos.device)
    blk = torch.searchsorted(ptr[1:].contiguous(), idx, right=True).clamp_(max=b - 1)
    key = blk * stride + pos
    query = torch.arange(b, device=pos.device)[:, None] * stride + torch.arange(
        n + 1, device=pos.device
    )[None, :] * d_eff[:, None].to(torch.int64)
    return torch.searchsorted(key, query.reshape(-1)).reshape(b, n + 1)


def f16_values(bits: np.ndarray) -> np.ndarray:
    """float32 values of fp16 bit patterns (uint16)."""
    return bits.view(np.float16).astype(np.float32)


def outlier_parts(codes: Mapping[str, torch.Tensor], i: int) -> Dict[str, np.ndarray]:
    """Entry ``i`` of batched outlier lists (``outlier_ptr [B + 1]``, ``outlier_pos``,
    ``outlier_bits``) as a parts dict's ``outlier_pos`` int64, ``outlier_bits`` uint16 and
    ``outlier_val`` float32 (numpy)."""
    lo, hi = (int(v) for v in codes["outlier_ptr"][i : i + 2])
    bits = codes["outlier_bits"][lo:hi].cpu().numpy().view(np.uint16)
    return {
        "outlier_pos": codes["outlier_pos"][lo:hi].cpu().numpy().astype(np.int64),
        "outlier_bits": bits,
        "outlier_val": f16_values(bits),
    }


def stack_outliers(parts_list: Sequence[Mapping[str, Any]], device: torch.device) -> Dict[str, torch.Tensor]:
    """The outlier lists of parts dicts batched on ``device``: ``outlier_ptr`` int64 ``[B + 1]``
    (case ``i`` owns entries ``outlier_ptr[i]:outlier_ptr[i+1]``), ``outlier_pos`` int64 and
    ``outlier_bits`` int16 (fp16 bit patterns)."""
    pos = [np.asarray(p["outlier_pos"], np.int64) for p in parts_list]
    bits = [np.asarray(p["outlier_bits"]).view(np.uint16) for p in parts_list]
    ptr = np.zeros(len(pos) + 1, np.int64)
    ptr[1:] = np.cumsum([a.size for a in pos])
    return {
        "outlier_ptr": torch.from_numpy(ptr).to(device),
        "outlier_pos": torch.from_numpy(np.concatenate(pos)).to(device),
        "outlier_bits": torch.from_numpy(np.concatenate(bits).view(np.int16)).to(device),
    }


@triton.jit
def pow2(e):
    """``2**e`` as f32 for int32 ``e`` in [-126, 127], exact: built from the exponent bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def shared_exponent(max_abs):
    """Smallest ``e`` in [-126, 127] with ``max_abs * 2**-e <= 2**15`` (0 for zero or non-finite
    input), read exactly from the float's bits (``f16.rs::shared_exponent``)."""
    bits = max_abs.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    # A normal value is 1.m * 2**(biased-127): ceil(log2) is biased-126, or biased-127 for an
    # exact power of two (m = 0). Subnormals give e < -126 and are clamped.
    e = biased - 141 - ((bits & 0x7FFFFF) == 0).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 127)
    return tl.where((max_abs > 0) & (biased < 255), e, 0)


@triton.jit
def to_scaled_f16(v, e):
    """fp16 bits (int16) of ``v * 2**-e``, round to nearest even; ``2**-e`` is a normal f32 for
    every exponent a finite f32 maximum produces, so the product is exact."""
    return (v * pow2(-e)).to(tl.float16).to(tl.int16, bitcast=True)


@triton.jit
def from_scaled_f16(h, e):
    """The stored value ``f32(h) * 2**e`` of fp16 bits ``h`` (int16)."""
    return h.to(tl.float16, bitcast=True).to(tl.float32) * pow2(e)


@triton.jit
def residual_tile(c_ptr, centers_ptr, seg, k_b, t_hat, row_off, rmask, cols, W: tl.constexpr):
    """``r = c - t^ centre_seg`` for a tile of rows of the ``c`` scratch (``[*, W]``), with the
    stored ``t^``: a product then a difference, two roundings as in Rust (the launchers disable
    fp fusion, so no fma). ``centers_ptr`` points at the block's ``[KP, W]`` centres; ``seg`` is
    clamped to ``0..k_b - 1`` (the block's centres), so no index reads past them."""
    seg = tl.maximum(tl.minimum(seg, k_b - 1), 0)
    cen = tl.load(centers_ptr + seg[:, None] * W + cols[None, :])
    c = tl.load(c_ptr + row_off[:, None] * W + cols[None, :], mask=rmask[:, None], other=0.0)
    return c - t_hat[:, None] * cen


@triton.jit
def block_absmax(ptr, n, RB: tl.constexpr):
    """``max |ptr[0:n]|`` (f32). Each program of a block reduces the same per-row values the
    previous launch wrote (a few KB, cached): no atomics, no zero-filled buffer, deterministic."""
    m = tl.zeros((RB,), tl.float32)
    for s in range(0, n, RB):
        i = s + tl.arange(0, RB)
        m = tl.maximum(m, tl.abs(tl.load(ptr + i, mask=i < n, other=0.0)))
    return tl.max(m, 0)


@triton.jit
def band_live(d_eff, cols):
    """``d_eff ^ j`` for coordinates ``j < d_eff`` and 0 beyond. The bands are the binary
    digits of ``d_eff``, largest first, so each is an aligned block and the band of ``j`` has
    the width of the highest set bit of ``d_eff ^ j``."""
    return tl.where(cols < d_eff, d_eff ^ cols, 0)


@triton.jit
def band_width(live, LOG_W: tl.constexpr):
    """Width ``W_b`` of the band of each coordinate (the highest set bit of ``live``; 1 where
    ``live`` is 0, i.e. padding)."""
    wb = tl.full(live.shape, 1, tl.int32)
    for lvl in tl.static_range(1, LOG_W + 1):
        wb = tl.where(live >= (1 << lvl), 1 << lvl, wb)
    return wb


@triton.jit
def band_hadamard(x, live, BN: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """Unnormalised Hadamard transform of each band of the rows of ``x`` (``[BN, W]`` f32).

    The radix-2 butterfly of ``wht.rs`` in its order, ``h = 1, 2, 4, ...: (a, b) -> (a + b,
    a - b)``, over the whole padded row; level ``h`` is kept only where the band is wider than
    ``h`` (``live >= 2h``), which is exactly each band's own transform since bands are aligned
    and a pair (j, j ^ h) always lies in one band."""
    for lvl in tl.static_range(LOG_W):
        v = tl.reshape(x, (BN, W // (2 << lvl), 2, 1 << lvl))
        v = tl.permute(v, (0, 1, 3, 2))
        a, b = tl.split(v)
        v = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.where(live >= (2 << lvl), tl.reshape(v, (BN, W)), x)
    return x


@triton.jit
def band_factor(d_eff, wb):
    """``f_b = sqrt(d_eff / W_b)`` in f32 with IEEE division and square root, as in Rust."""
    return tl.math.sqrt_rn(tl.math.div_rn(d_eff.to(tl.float32) + tl.zeros(wb.shape, tl.float32),
                                          wb.to(tl.float32)))
