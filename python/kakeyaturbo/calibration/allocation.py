"""Bit allocation: integer reverse water-filling of a row's bits over the components of one
head (`allocate_bits`), its Gaussian closed form (`water_fill_rates`), and one water-filling
pooled over many heads, layers and streams (`global_allocation`)."""

from __future__ import annotations

import heapq
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .._core import MAX_DIM
from ..codec import _checks
from ..errors import InvalidInputError, InvalidParameterError

#: N(0, 1) Lloyd-Max distortion at 0..8 bits (0 bits: the variance itself).
LLOYD_MAX_MSE = (1.0, 0.36338, 0.11748, 0.034548, 0.0095010, 0.0025047, 0.00064424,
                 0.00016348, 0.000041185)

#: The largest target of all-in bits per element: a row costs at most 8 bits per component and
#: a 16-bit scale (24 bits per element at D = 1); a target far past that is no target, and one
#: near float64's limit overflowed the row's bit count.
MAX_BITS_PER_ELEMENT = 64.0


def allocate_bits(variances: Sequence[float], budget: int, max_bits: int = 8,
                  distortion: Sequence[float] = LLOYD_MAX_MSE,
                  floor: "int | Sequence[int]" = 0,
                  max_components: "int | Sequence[Optional[int]] | None" = None,
                  segments: Optional[Sequence[int]] = None,
                  component_cost: "float | Sequence[float]" = 0.0) -> np.ndarray:
    """Integer reverse water-filling: ``budget`` bits over components of the given variances,
    at most ``max_bits`` each and at least ``floor`` each (one for all, or one per component;
    paid first, out of the budget), minimising ``sum_j var_j * distortion[b_j]``.

    ``distortion`` must be convex and decreasing in the bits (the Lloyd-Max errors are), so
    handing out one bit at a time to the component whose error falls most is optimal. Ties go
    to the lower index. Returns int64 bits, non-increasing when the variances are. Raises
    InvalidParameterError when the budget cannot pay the floor.

    ``max_components`` caps how many components get any bits: one cap for all, or (with
    ``segments``, a segment index per component) one cap per segment, ``None`` for none. A
    component past its segment's cap gets no first bit, the bits go on to the others (greedy:
    which components get bits is decided by the gain of their first bit, so with a cap the
    result need not be optimal).

    ``component_cost`` (one for all, or one per component, each ``>= 0``) charges a component's
    first bit that many times the water level, the gain of the best bit the allocation without
    costs leaves unspent: the bits are then handed out again, one at a time, in the order of
    their gain less that charge, so a weak component's first bit waits until the bits of the
    components that have some gain less than it does; the whole budget is still spent where
    anything is left to gain. It prices work that grows with the number of components
    (attention over keys coded before RoPE synthesises each key at ``m x D`` multiply-adds).
    All zero: the allocation without costs.
    """
    lam = np.asarray(variances)
    if lam.dtype.kind not in "fiu":  # np.asarray(..., float64) of a str raises ValueError
        raise TypeError(f"variances must be numeric, got dtype {lam.dtype}")
    lam = lam.astype(np.float64)
    if lam.ndim != 1 or np.any(~np.isfinite(lam)) or np.any(lam < 0):
        raise InvalidParameterError("variances must be a 1-D array of finite values >= 0")
    dist = _checks.vector(distortion, "distortion", np.float64)
    if dist.size < 1 or not np.all(np.isfinite(dist)):
        raise InvalidParameterError(f"distortion must be finite values, one per bit width from 0, got {distortion!r}")
    _checks.integer(budget, "budget")
    _checks.integer(max_bits, "max_bits")
    if budget < 0 or max_bits < 0 or max_bits >= len(distortion):
        raise InvalidParameterError(f"need budget >= 0 and 0 <= max_bits < {len(distortion)}")
    floors = np.broadcast_to(np.asarray(floor), lam.shape) if np.ndim(floor) == 0 else np.asarray(floor)
    if floors.shape != lam.shape or floors.dtype.kind not in "iu":
        raise InvalidParameterError(f"floor must be an integer or one integer per component, got {floor!r}")
    if np.any(floors < 0) or np.any(floors > max_bits):
        raise InvalidParameterError(f"need 0 <= floor <= max_bits = {max_bits}, got {floor}")
    paid = int(floors.sum())
    if paid > budget:
        raise InvalidParameterError(f"a floor of {floor} bits for {len(lam)} components needs "
                                    f"{paid} bits, the budget is {budget}")
    seg, caps = _segment_caps(len(lam), max_components, segments)
    bits = floors.astype(np.int64)
    used = np.bincount(seg[bits > 0], minlength=len(caps))
    if np.any(used > caps):
        raise InvalidParameterError(f"a floor of {floor} bits gives {int(used.max())} components "
                                    f"bits, more than max_components = {int(caps.min())}")
    budget -= paid
    cost = np.broadcast_to(np.asarray(component_cost, dtype=np.float64), lam.shape) \
        if np.ndim(component_cost) == 0 else np.asarray(component_cost, dtype=np.float64)
    if cost.shape != lam.shape or np.any(~np.isfinite(cost)) or np.any(cost < 0):
        raise InvalidParameterError(f"component_cost must be one finite value >= 0, or one per "
                                    f"component, got {component_cost!r}")
    free, level = _greedy(lam, bits, budget, max_bits, distortion, seg, caps, used, None)
    if level <= 0 or not np.any(cost > 0):
        return free
    return _greedy(lam, bits, budget, max_bits, distortion, seg, caps, used, cost * level)[0]


def _greedy(lam: np.ndarray, bits: np.ndarray, budget: int, max_bits: int,
            distortion: Sequence[float], seg: np.ndarray, caps: np.ndarray, used: np.ndarray,
            first: Optional[np.ndarray]) -> Tuple[np.ndarray, float]:
    """:func:`allocate_bits`' hand-out of ``budget`` bits on top of ``bits`` (the floors, of
    which ``used`` counts the components per segment), a component's first bit charged
    ``first[j]`` (None: nothing): (the bits, the largest gain left unspent, 0 if none)."""
    bits, used = bits.copy(), used.copy()

    def gain(j: int) -> float:
        return float(lam[j] * (distortion[bits[j]] - distortion[bits[j] + 1]))

    def key(j: int) -> float:  # the order of the hand-out: the gain less any charge
        return -(gain(j) - first[j]) if first is not None and bits[j] == 0 else -gain(j)

    heap = [(key(j), j) for j in range(len(lam)) if max_bits > bits[j]]
    heapq.heapify(heap)
    while budget > 0 and heap:
        _, j = heapq.heappop(heap)
        if gain(j) <= 0:  # nothing to gain: zero-variance components get no bits
            continue
        if bits[j] == 0:
            if used[seg[j]] >= caps[seg[j]]:
                continue  # its segment has all the components it may have
            used[seg[j]] += 1
        bits[j] += 1
        budget -= 1
        if bits[j] < max_bits:
            heapq.heappush(heap, (key(j), j))
    # The water level: the best bit left (a first bit its segment's cap forbids does not count).
    level = 0.0
    for _, j in heap:
        if bits[j] > 0 or used[seg[j]] < caps[seg[j]]:
            level = max(level, gain(j))
    return bits, level


def _segment_caps(n: int, max_components: "int | Sequence[Optional[int]] | None",
                  segments: Optional[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """(segment index per component, cap per segment) of :func:`allocate_bits`' arguments; no
    cap is ``n``."""
    seg = np.zeros(n, np.int64) if segments is None else np.asarray(segments)
    if seg.shape != (n,) or seg.dtype.kind not in "iu" or (n and seg.min() < 0):
        raise InvalidParameterError("segments must be one index >= 0 per component")
    count = int(seg.max()) + 1 if n else 1
    given = [max_components] * count if max_components is None or np.ndim(max_components) == 0 \
        else list(max_components)
    if len(given) != count:
        raise InvalidParameterError(f"{len(given)} caps for {count} segments")
    caps = np.array([n if c is None else _checks.integer(c, "max_components") for c in given], np.int64)
    if np.any(caps < 1):
        raise InvalidParameterError(f"max_components must be at least 1, got {max_components}")
    return seg.astype(np.int64), caps


def water_fill_rates(variances: Sequence[float], rate: float) -> Tuple[np.ndarray, float]:
    """The closed form of reverse water-filling for Gaussian components: rates
    ``R_j = max(0, log2(var_j / theta) / 2)`` summing to ``rate``; returns (rates, theta).
    InvalidInputError unless the variances are a 1-D array of finite values >= 0,
    InvalidParameterError for a rate that is not finite or so large that the water level
    underflows float64 (TypeError: not a number)."""
    _checks.real(rate, "rate")
    lam = _checks.vector(variances, "variances", np.float64)
    if not np.all(np.isfinite(lam)) or np.any(lam < 0):
        raise InvalidInputError("variances must be finite and >= 0, got NaN, inf or a negative one")
    pos = lam[lam > 0]
    if rate <= 0 or len(pos) == 0:
        return np.zeros(len(lam)), float(lam.max(initial=0.0))
    lo, hi = np.log2(pos.min()) - 2 * rate - 1, np.log2(pos.max())
    for _ in range(200):
        mid = (lo + hi) / 2
        r = np.maximum(0.0, 0.5 * (np.log2(np.maximum(lam, 1e-300)) - mid)).sum()
        lo, hi = (mid, hi) if r > rate else (lo, mid)
    theta = 2.0 ** ((lo + hi) / 2)
    if not theta > 0:  # the water level underflowed float64: the rates came out infinite
        raise InvalidParameterError(f"rate {rate} is beyond what water-filling these variances can give")
    return np.maximum(0.0, 0.5 * np.log2(np.maximum(lam, 1e-300) / theta)), float(theta)


def check_target(bits_per_element: float) -> float:
    """A target of all-in bits per element in ``[0, MAX_BITS_PER_ELEMENT]`` as a float;
    InvalidParameterError otherwise (TypeError: not a number)."""
    b = _checks.real(bits_per_element, "bits_per_element")
    if not 0 <= b <= MAX_BITS_PER_ELEMENT:
        raise InvalidParameterError(f"bits_per_element must be in [0, {MAX_BITS_PER_ELEMENT:g}], got {b}")
    return b


def row_budget(bits_per_element: float, d: int, norm: bool) -> int:
    """Index bits per row for a target of all-in bits per element: the target times D, less
    the 16-bit scale, rounded down to whole bytes (rows are byte-aligned). InvalidParameterError
    for a target outside ``[0, 64]`` (:func:`check_target`) or ``d`` outside ``1..MAX_DIM`` (the
    core's bound on a row; TypeError: wrong types)."""
    check_target(bits_per_element)
    _checks.integer(d, "d", 1, MAX_DIM)
    _checks.boolean(norm, "norm")
    b = int(np.floor(bits_per_element * d + 1e-9)) - (16 if norm else 0)
    return max(0, b // 8 * 8)


def _add_bits(sp: np.ndarray, b: np.ndarray, n: int, max_bits: int,
              cap: Optional[int] = None) -> Tuple[float, np.ndarray]:
    """``n`` more bits for one head's components (at most ``cap`` of them with any), one at a
    time where the error falls most: (the fall in ``sum_j sp_j * mse(b_j)``, the new bits);
    ``-inf`` if they do not fit."""
    lm = np.asarray(LLOYD_MAX_MSE)
    b = b.copy()
    gain = 0.0
    for _ in range(n):
        room = b < max_bits
        if cap is not None and np.count_nonzero(b) >= cap:
            room &= b > 0
        if not np.any(room):
            return -np.inf, b
        g = np.where(room, sp * (lm[b] - lm[np.minimum(b + 1, len(lm) - 1)]), -np.inf)
        j = int(np.argmax(g))
        gain += float(g[j])
        b[j] += 1
    return gain, b


def _take_bits(sp: np.ndarray, b: np.ndarray, n: int, floor: int = 0) -> Tuple[float, np.ndarray]:
    """``n`` bits taken back from one head's components (none below ``floor``), one at a time
    where the error rises least: (the rise, the new bits); ``inf`` if they cannot be."""
    lm = np.asarray(LLOYD_MAX_MSE)
    b = b.copy()
    loss = 0.0
    for _ in range(n):
        have = b > floor
        if not np.any(have):
            return np.inf, b
        c = np.where(have, sp * (lm[np.maximum(b - 1, 0)] - lm[b]), np.inf)
        j = int(np.argmin(c))
        loss += float(c[j])
        b[j] -= 1
    return loss, b


def global_allocation(spectra: Sequence[np.ndarray], row_budgets: Sequence[int],
                      max_bits: int = 8, floor: "int | Sequence[int]" = 0,
                      max_components: "int | Sequence[Optional[int]] | None" = None,
                      component_cost: "float | Sequence[float]" = 0.0) -> List[np.ndarray]:
    """Water-filling across several (layer, kv-head) at once: the pooled budget goes where the
    (whitened or weighted) variances are largest, whichever head they belong to (every component
    given at least ``floor`` bits first: one floor for all, or one per spectrum, e.g. per
    stream; at most ``max_components`` components of a spectrum given any bits: one cap for
    all, or one per spectrum, ``None`` for none; each component's first bit charged
    ``component_cost`` times the water level, one for all or one per spectrum, see
    :func:`allocate_bits`); then each head's row is trimmed to whole bytes by taking back its
    least useful bits above the floor, and the bytes so freed go back, one byte at a time, to
    the head whose error falls most with it (so the total never exceeds the pooled budget, and
    every head keeps at least one byte; a head with a cost gives the bytes it gains to the
    components that have bits already)."""
    sps = [np.asarray(sp, dtype=np.float64) for sp in spectra]
    if not sps:
        raise InvalidParameterError("spectra must hold at least one spectrum, got none")
    if any(sp.ndim != 1 or sp.size < 1 for sp in sps):
        raise InvalidParameterError("every spectrum must be a non-empty 1-D array of variances")
    budgets = list(row_budgets)
    if len(budgets) != len(sps):
        raise InvalidParameterError(f"{len(budgets)} row budgets for {len(sps)} spectra")
    for b in budgets:
        _checks.integer(b, "row_budgets[i]", 0)
    for f in [floor] if np.ndim(floor) == 0 else list(floor):
        _checks.integer(f, "floor")
    total = int(sum(budgets))
    floors = [int(floor)] * len(sps) if np.ndim(floor) == 0 else [int(f) for f in floor]
    if len(floors) != len(sps):
        raise InvalidParameterError(f"{len(floors)} floors for {len(sps)} spectra")
    per = np.concatenate([np.full(len(sp), f, dtype=np.int64) for sp, f in zip(sps, floors)])
    seg = np.concatenate([np.full(len(sp), i, dtype=np.int64) for i, sp in enumerate(sps)])
    _, caps = _segment_caps(len(seg), max_components, seg)  # no cap: the total count
    costs = [float(component_cost)] * len(sps) if np.ndim(component_cost) == 0 \
        else [float(c) for c in component_cost]
    if len(costs) != len(sps):
        raise InvalidParameterError(f"{len(costs)} component costs for {len(sps)} spectra")
    bits = allocate_bits(np.concatenate(sps), total, max_bits, floor=per, max_components=caps,
                         segments=seg, component_cost=np.concatenate(
                             [np.full(len(sp), c) for sp, c in zip(sps, costs)]))
    out, at = [], 0
    for i, (sp, floor) in enumerate(zip(sps, floors)):
        b = bits[at:at + len(sp)]
        at += len(sp)
        if costs[i] > 0 and b.any():  # bytes added below go to components with bits
            caps[i] = min(int(caps[i]), int(np.count_nonzero(b)))
        cap = int(caps[i])
        extra = int(b.sum()) % 8
        trimmed = _take_bits(sp, b, extra, floor)
        # whole bytes: take the odd bits back, or (all at the floor) add up to the next byte
        b = trimmed[1] if np.isfinite(trimmed[0]) else _add_bits(sp, b, 8 - extra, max_bits, cap)[1]
        if b.sum() == 0:  # every head keeps at least one byte of codes
            b = _add_bits(sp, b, min(8, max_bits * len(b)), max_bits, cap)[1]
        out.append(b)
    left = total - sum(int(b.sum()) for b in out)
    while left < 0:  # the minimum bytes overdrew the budget: take bytes back where it costs least
        asks = [_take_bits(sp, b, 8, f) if b.sum() >= 16 else (np.inf, b)
                for sp, b, f in zip(sps, out, floors)]
        worst = int(np.argmin([c for c, _ in asks]))
        if not np.isfinite(asks[worst][0]):
            raise InvalidParameterError("the pooled budget cannot give every head one byte")
        out[worst] = asks[worst][1]
        left += 8
    offers = [_add_bits(sp, b, 8, max_bits, c) for sp, b, c in zip(sps, out, caps)] if left >= 8 else []
    while left >= 8:
        best = int(np.argmax([g for g, _ in offers]))
        if not np.isfinite(offers[best][0]) or offers[best][0] <= 0:
            break
        out[best] = offers[best][1]
        offers[best] = _add_bits(sps[best], out[best], 8, max_bits, caps[best])
        left -= 8
    return out
