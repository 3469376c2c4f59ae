"""Cases for attention over the codes, shared by the codec tests and the Triton parity fuzz:
random calibrations (water-filled bit layouts, every metric, scale on and off, outliers,
custom tables, whitening), a layer of sealed blocks, raw sink and tail rows, queries and the
call's settings; and the comparison with the float64 reference under the limits of
``tests/kernels/tolerances.py``. Plain Python (no pytest) so that ``benches/gpu_bench.py`` can
use it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

import kakeyaturbo as kt
from kakeyaturbo import calibration

METRICS = ("mse", "inner_product", "linf")
THRESHOLDS = (None, 2.5, 1.0, 3.0)
TARGETS = (1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One call: layer shape, codecs, sealed blocks, raw rows, settings. ``seed`` draws the
    calibrations (their spectra, bits targets, whitening and tables) and every value."""

    seed: int = 0
    batch: int = 1
    kv_heads: int = 2
    group: int = 3
    dk: int = 64
    dv: int = 64
    blocks: Tuple[int, ...] = (200, 64)
    sink: int = 1
    tail: int = 5
    n_q: int = 1
    metric: str = "mse"
    norm: bool = True
    threshold: Optional[float] = None
    tables: bool = False
    softcap: Optional[float] = None
    window: Optional[int] = None
    mask: Optional[str] = None  # None, "additive" or "bool"
    q_scale: float = 1.0

    @property
    def total(self) -> int:
        return self.sink + sum(self.blocks) + self.tail


@dataclasses.dataclass
class Case:
    spec: Spec
    codes: kt.LayerCodes
    q: np.ndarray
    tail_k: np.ndarray
    tail_v: np.ndarray
    sink_k: Optional[np.ndarray]
    sink_v: Optional[np.ndarray]
    kwargs: Dict[str, Any]

    def call(self) -> Dict[str, Any]:
        """The keyword arguments of ``decode_attention`` after ``codes, q, tail_k, tail_v``."""
        return dict(sink_k=self.sink_k, sink_v=self.sink_v, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class Head:
    """A calibration with the model its rows are drawn from."""

    codec: kt.CalibratedCodec
    mean: np.ndarray
    basis: np.ndarray
    variances: np.ndarray

    def rows(self, g: np.random.Generator, shape: Sequence[int]) -> np.ndarray:
        e = g.standard_normal((*shape, len(self.mean))) * np.sqrt(self.variances)
        return (self.mean + e @ self.basis.T).astype(np.float32)


def head(g: np.random.Generator, d: int, s: Spec) -> Head:
    """A calibration fitted by ``fit_stream`` on a random decaying spectrum: bits water-filled
    for a random target (1.5..8 bits per element, components of 1..8 bits), optionally
    whitened, with custom Lloyd-Max tables when ``s.tables``."""
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    scale = 10 ** g.uniform(-2, 2)
    lam = g.uniform(0.8, 0.99) ** np.arange(d) * g.uniform(0.5, 1.5, d) + 10 ** g.uniform(-7, -3)
    lam = scale**2 * np.sort(lam)[::-1]
    mean = scale * g.standard_normal(d) * g.uniform(0, 3)
    w = None
    if g.random() < 0.3:
        b = g.standard_normal((d, d)) / math.sqrt(d)
        w = calibration.whitening_factor(b @ b.T)
    # At least one byte of index bits once the 16-bit scale is paid (tiny D).
    target = max(float(TARGETS[int(g.integers(len(TARGETS)))]), (24 if s.norm else 8) / d)
    fit = calibration.fit_stream(mean, (q * lam) @ q.T, target, whitening=w, norm=s.norm)
    kw: Dict[str, Any] = dict(metric=s.metric, norm=s.norm, outlier_threshold=s.threshold)
    if s.tables:
        widths = sorted({int(b) for b in fit.bits})
        kw["centroids"] = {b: kt.centroids_gaussian(b) * g.uniform(0.8, 1.25) for b in widths}
    return Head(fit.codec(**kw), mean, q, lam)


def build(s: Spec) -> Case:
    g = np.random.default_rng(s.seed)
    ks = [head(g, s.dk, s) for _ in range(s.kv_heads)]
    vs = [head(g, s.dv, s) for _ in range(s.kv_heads)]
    codes = kt.LayerCodes([h.codec for h in ks], [h.codec for h in vs], batch=s.batch)
    for n in s.blocks:
        codes.append_blocks(
            [[h.codec.encode(h.rows(g, (n,))) for h in ks] for _ in range(s.batch)],
            [[h.codec.encode(h.rows(g, (n,))) for h in vs] for _ in range(s.batch)])

    def raw(heads: List[Head], n: int) -> np.ndarray:
        return np.ascontiguousarray(np.stack([h.rows(g, (s.batch, n)) for h in heads], axis=1))

    sink_k = raw(ks, s.sink) if s.sink else None
    sink_v = raw(vs, s.sink) if s.sink else None
    tail_k, tail_v = raw(ks, s.tail), raw(vs, s.tail)
    # Queries scaled so that scores are O(1) (times q_scale): 1 / sqrt(total key variance).
    qs = s.q_scale / math.sqrt(np.mean([h.variances.sum() for h in ks]) / s.dk) / math.sqrt(s.dk)
    q = (g.standard_normal((s.batch, s.kv_heads * s.group, s.n_q, s.dk)) * qs).astype(np.float32)
    kwargs: Dict[str, Any] = {}
    if s.softcap is not None:
        kwargs["softcap"] = s.softcap
    if s.window is not None:
        kwargs["window"] = s.window
    if s.mask == "additive":
        m = g.standard_normal((s.batch, s.n_q, s.total)).astype(np.float32)
        m[g.random(m.shape) < 0.1] = -np.inf
        kwargs["mask"] = m
    elif s.mask == "bool":
        kwargs["mask"] = g.random((s.batch, 1, s.n_q, s.total)) > 0.2
    return Case(s, codes, q, tail_k, tail_v, sink_k, sink_v, kwargs)


def magnitudes(c: Case) -> Tuple[float, float]:
    """``S = scale * max |q| . |k|`` over every query and position and ``V = max |v|`` of the
    decoded cache (what the limits are relative to)."""
    from kakeyaturbo.reference.attention import decoded_kv

    k, v = decoded_kv(c.codes, c.sink_k, c.sink_v, c.tail_k, c.tail_v)
    kk = k.numpy().repeat(c.spec.group, axis=1)
    scale = c.kwargs.get("scale", 1.0 / math.sqrt(c.spec.dk))
    s = np.abs(c.q.astype(np.float64)) @ np.abs(kk).transpose(0, 1, 3, 2)
    return float(s.max(initial=0.0)) * scale, float(np.abs(v.numpy()).max(initial=0.0))


class AttentionMismatch(AssertionError):
    """An attention output beyond its limit."""


def compare(what: str, got: Tuple[np.ndarray, np.ndarray], want: Tuple[np.ndarray, np.ndarray],
            s_mag: float, v_mag: float, out_limit: float, lse_limit: float) -> Tuple[float, float]:
    """Checks ``(out, lse)`` against ``want``: ``|out - want| <= out_limit * V (1 + S)`` and
    ``|lse - want| <= lse_limit (1 + S)`` (``-inf`` exactly where ``want`` is). Raises
    AttentionMismatch naming the largest error and the first index beyond the limit; returns
    the two errors in units of their limits' scales."""
    out, lse = (np.asarray(x, dtype=np.float64) for x in got)
    wo, wl = (np.asarray(x, dtype=np.float64) for x in want)
    if out.shape != wo.shape or lse.shape != wl.shape:
        raise AttentionMismatch(f"{what}: shapes {out.shape}, {lse.shape} vs {wo.shape}, {wl.shape}")
    unit_o, unit_l = max(v_mag, 1e-30) * (1 + s_mag), 1 + s_mag
    dead = np.isneginf(wl)
    if not np.array_equal(dead, np.isneginf(lse)):
        i = tuple(int(x) for x in np.argwhere(dead != np.isneginf(lse))[0])
        raise AttentionMismatch(f"{what}: lse is -inf at {i} on one side only ({lse[i]} vs {wl[i]})")
    eo = np.abs(out - wo) / unit_o
    el = np.where(dead, 0.0, np.abs(np.where(dead, 0.0, lse) - np.where(dead, 0.0, wl))) / unit_l
    for name, e, limit, a, b in (("out", eo, out_limit, out, wo), ("lse", el, lse_limit, lse, wl)):
        bad = ~(e <= limit)  # NaN fails
        if bad.any():
            first = tuple(int(x) for x in np.argwhere(bad)[0])
            worst = tuple(int(x) for x in np.unravel_index(int(np.nanargmax(e)), e.shape))
            raise AttentionMismatch(
                f"{what}: {name} error {np.nanmax(e):.3g} > {limit:.3g} (in units of "
                f"{'V (1 + S)' if name == 'out' else '1 + S'}, S = {s_mag:.3g}, V = {v_mag:.3g}) "
                f"at {int(bad.sum())} of {e.size} values; first at {list(first)} ({a[first]!r} vs "
                f"{b[first]!r}), largest at {list(worst)}")
    return float(eo.max(initial=0.0)), float(el.max(initial=0.0))


def spec_from(g: np.random.Generator, seed: int, dims: Sequence[int] = (64, 128, 256),
              max_block: int = 700) -> Spec:
    """A random spec (the fuzz's case distribution)."""
    metric = METRICS[int(g.integers(3))]
    dk = int(g.choice(dims))
    n_q = int(g.integers(1, 5))
    blocks = tuple(int(g.choice([1, 63, 64, 65, 512, int(g.integers(2, max_block))]))
                   for _ in range(int(g.integers(0, 4))))
    s = Spec(
        seed=seed, batch=int(g.integers(1, 3)), kv_heads=int(g.integers(1, 4)),
        group=int(g.integers(1, 9)), dk=dk, dv=dk if g.random() < 0.8 else int(g.choice(dims)),
        blocks=blocks, sink=int(g.integers(0, 4)), tail=n_q + int(g.integers(0, 70)), n_q=n_q,
        metric=metric, norm=True if metric == "inner_product" else bool(g.random() < 0.7),
        threshold=THRESHOLDS[int(g.integers(4))], tables=bool(g.random() < 0.3),
        softcap=float(g.uniform(1, 30)) if g.random() < 0.3 else None,
        mask=[None, None, "additive", "bool"][int(g.integers(4))],
        q_scale=float(10 ** g.uniform(-0.5, 1.5)))
    if g.random() < 0.3:
        s = dataclasses.replace(s, window=int(g.integers(1, s.total + 5)))
    return s
