"""Parity fuzzing of the calibrated mode: the torch reference and the Triton kernels against the
Rust codec (``CalibratedCodec.encode_parts`` / ``decode_parts``, the oracle).

Plain Python (no pytest import) so that ``benches/gpu_bench.py`` runs the same fuzz on a
machine without pytest. A *group* is one set of batch-wide parameters (D, metric, ``norm``,
outlier threshold, input dtype) and several *heads* (cases), each with its own calibration
(fitted by :func:`kakeyaturbo.calibrate.fit_stream` on its own covariance: bits water-filled
at a target of 1.5..8 bits per element, or a hand-made layout of runs whose lengths are not
powers of two; optionally whitened; N(0, 1), fitted or random Lloyd-Max tables; its own
rotation seed), its own data and row count. The kernels code a group's heads in one batched
launch set, the reference one head at a time.

Every code is compared by name. Float64 recomputation from the calibration (given Rust's
stored scale) tells how far the deciding value of a disagreement sits from its threshold;
only disagreements within the epsilons of ``tolerances.py`` pass, each is recorded as a
:class:`~parity.Near`, and they must be rare. Values whose epsilon exceeds
``undetermined_z`` (a component whose ``1 / spread`` is so large that the f32 projection
cannot resolve it) are counted, not compared. Decoded values: each decoder against the
oracle's on the same codes, and the oracle's decode of our codes against its own codes' on
rows where every code agrees, all within ``decode_float32``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import kakeyaturbo as kt
from kakeyaturbo import calibrate
from kakeyaturbo.reference import calibrated as rc
from .parity import Near, ParityError, _exponent, _stored_near, assert_decoded
from .tolerances import TOLERANCES as TOL

METRICS = ("mse", "inner_product", "linf")
DIMS = (64, 96, 128, 256)
ROWS = (1, 63, 512, 1024, 0)  # 0: a random count
THRESHOLDS = (None, 2.5, 1.0, 3.0)
TARGETS = (1.5, 2.0, 2.5, 3.0, 3.4, 4.0, 4.4, 5.0, 6.0, 7.0, 8.0)
LAYOUTS = ("water", "hand")
TABLES = ("gauss", "fitted", "random")
DATA = ("model", "heavy", "shift", "offspan", "repeat", "zero", "scaled")
DEFAULT_SEED = 0xCAFEBABE

#: Codes that are fp16 roundings (their near-threshold share is ``near_fraction_fp16``).
FP16_FIELDS = ("g", "scale_bits", "outlier_bits")

#: Groups and heads per group: the full set (1,000 cases) and the CI subset, whose two groups
#: (of the full set's parameters, 3 heads of at most 150 rows each) cover inner_product with
#: outliers at T = 1 in f32, and mse without norm with outliers at T = 3 in bf16.
FULL = (125, 8)
SUBSET_GIDS = (4, 6)
SUBSET_HEADS = 3


@dataclasses.dataclass(frozen=True)
class HeadCase:
    """One head: a calibration and rows to code with it."""

    seed: int
    n: int
    layout: str  # "water": bits water-filled at `target`; "hand": runs of random bits
    target: float
    whiten: bool
    table: str  # "gauss", "fitted" (Lloyd-Max on the codec's own z), "random"
    rotation_seed: int
    data: str
    scale: float

    def model(self, d: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The head's Gaussian model: mean, eigenvectors (columns) and variances."""
        return _model(self.seed, self.scale, d)

    def codec(self, group: "GroupCase") -> kt.CalibratedCodec:
        d = group.d
        mean, q, lam = self.model(d)
        g = np.random.default_rng(self.seed + 1)
        w = None
        if self.whiten:
            b = g.standard_normal((d, d)) / np.sqrt(d)
            w = calibrate.whitening_factor(b @ b.T * g.uniform(0.1, 10))
        cov = (q * lam) @ q.T
        if self.layout == "water":
            fit = calibrate.fit_stream(mean, cov, self.target, whitening=w, norm=group.norm)
        else:
            fit = calibrate.fit_stream(mean, cov, self.target, whitening=w, norm=group.norm,
                                       bits=hand_bits(g, d))
        kw: Dict[str, Any] = dict(rotation_seed=self.rotation_seed, metric=group.metric,
                                  norm=group.norm, outlier_threshold=group.threshold)
        codec = fit.codec(**kw)
        tables: Dict[int, np.ndarray] = {}
        widths = sorted(set(int(b) for b in fit.bits))
        if self.table == "fitted":
            z = codec.encode_parts(self.rows(d, 512, "model", seed_offset=7))["z"]
            for off, width, b in codec.bands:
                tables.setdefault(int(b), np.zeros(0))
                tables[int(b)] = np.concatenate([tables[int(b)], z[:, off:off + width].ravel()])
            tables = {b: calibrate.lloyd_max(v, b) for b, v in tables.items() if v.size >= 64 * 2**b}
        elif self.table == "random":
            for b in g.choice(widths, size=min(2, len(widths)), replace=False):
                t = np.sort(g.standard_normal(2 ** int(b)) * g.uniform(0.5, 2.0)).astype(np.float32)
                for i in range(1, len(t)):  # strictly ascending in f32
                    t[i] = max(t[i], np.nextafter(t[i - 1], np.float32(np.inf)))
                tables[int(b)] = t
        return fit.codec(**kw, centroids=tables or None) if tables else codec

    def rows(self, d: int, n: int, kind: str, seed_offset: int = 2) -> np.ndarray:
        """``n`` rows of data kind ``kind`` for the head's model, float32 ``[n, d]``."""
        mean, q, lam = self.model(d)
        g = np.random.default_rng(self.seed + seed_offset)
        e = g.standard_normal((n, d))
        if kind == "heavy":
            e = g.standard_t(3, size=(n, d))
        x = mean + (e * np.sqrt(lam)) @ q.T
        if kind == "shift":
            x += 2.0 * np.sqrt(lam[0]) * q[:, 0] + np.sqrt(lam[1]) * q[:, 1]
        elif kind == "offspan":
            x = mean + 0.1 * (x - mean) + np.sqrt(lam[d // 2]) * g.standard_normal((n, d))
        elif kind == "repeat":
            x = x[g.integers(0, min(3, n), size=n)]
        elif kind == "zero":
            x[g.random(n) < 0.25] = mean  # exactly the mean: u = 0, a zero scale
        elif kind == "scaled":
            x = mean + (x - mean) * 10 ** g.uniform(-3, 3)
        return x.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _model(seed: int, scale: float, d: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    # A decaying spectrum over a noise floor 1e-7..1e-3 of the top variance.
    lam = g.uniform(0.8, 0.99) ** np.arange(d) * g.uniform(0.5, 1.5, d) + 10 ** g.uniform(-7, -3)
    lam = scale**2 * np.sort(lam)[::-1]
    mean = scale * g.standard_normal(d) * g.uniform(0, 3)
    for a in (q, lam, mean):
        a.flags.writeable = False
    return mean, q, lam


def hand_bits(g: np.random.Generator, d: int) -> np.ndarray:
    """A hand-made layout over ``d`` components: runs of one random width in 1..8 whose lengths
    are mostly not powers of two, in no particular order, then zeros (left out)."""
    m = int(g.integers(1, d + 1))
    bits: List[int] = []
    while len(bits) < m:
        bits += [int(g.integers(1, 9))] * int(g.choice([1, 3, 5, 6, 7, 11, 13, 23, 37]))
    out = np.zeros(d, np.int64)
    out[:m] = bits[:m]
    return out


@dataclasses.dataclass(frozen=True)
class GroupCase:
    gid: int
    d: int
    metric: str
    norm: bool
    threshold: Optional[float]
    input_dtype: str
    heads: Tuple[HeadCase, ...]

    @property
    def label(self) -> str:
        return (f"c{self.gid}-D{self.d}-{self.metric}-{'norm' if self.norm else 'nonorm'}-"
                f"T{self.threshold}-{self.input_dtype}")


def make_groups(full: bool) -> List[GroupCase]:
    """The deterministic case list. Group ids cycle through D, metric, norm, threshold and input
    dtype; heads through row counts, layouts and targets, whitening, tables, seeds and data
    kinds."""
    gids = range(FULL[0]) if full else SUBSET_GIDS
    per_group = FULL[1] if full else SUBSET_HEADS
    groups = []
    for gid in gids:
        g = np.random.default_rng(5000 + gid)
        metric = METRICS[gid % 3]
        heads = []
        for j in range(per_group):
            n = ROWS[(gid + j) % 5] or int(g.integers(2, 1100 if full else 300))
            if not full:
                n = min(n, 150)
            heads.append(HeadCase(
                seed=int(g.integers(2**31)),
                n=n,
                layout="hand" if (gid + j) % 3 == 2 else "water",
                target=TARGETS[(gid * 3 + j) % len(TARGETS)],
                whiten=(gid + 2 * j) % 4 == 1,
                table=TABLES[(gid + j) % 3],
                rotation_seed=int(g.integers(2**63)) if (gid + j) % 5 == 4 else DEFAULT_SEED,
                data=DATA[(gid * 5 + j) % len(DATA)],
                scale=float(10 ** g.uniform(-3, 3)),
            ))
        groups.append(GroupCase(
            gid=gid,
            d=DIMS[gid % 4],
            metric=metric,
            norm=True if metric == "inner_product" else (gid // 3) % 3 != 2,
            threshold=THRESHOLDS[(gid // 2) % 4],
            input_dtype="bfloat16" if (gid // 6) % 2 else "float32",
            heads=tuple(heads),
        ))
    return groups


# ---------------------------------------------------------------------------------------
# The oracle side.


@dataclasses.dataclass
class Prepared:
    group: GroupCase
    codecs: List[kt.CalibratedCodec]
    cals: List[rc.Calibration]
    x: List[np.ndarray]  # float32 rows as Rust saw them (bf16-rounded for bf16 groups)
    rust: List[Dict[str, Any]]


def prepare(group: GroupCase) -> Prepared:
    codecs, cals, xs, parts = [], [], [], []
    for head in group.heads:
        c = head.codec(group)
        x = head.rows(group.d, head.n, head.data)
        if group.input_dtype == "bfloat16":
            x = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
        codecs.append(c)
        cals.append(rc.calibration_of(c))
        xs.append(x)
        parts.append(c.encode_parts(x))
    return Prepared(group, codecs, cals, xs, parts)


@dataclasses.dataclass
class Exact:
    """Float64 values of one head from the calibration, with Rust's stored scale ``g``."""

    rms: np.ndarray  # [n], the exact rms of u
    eps_rms: np.ndarray  # [n]
    z: np.ndarray  # [n, m], from Rust's g
    eps_z: np.ndarray  # [n, m] (z units)


def exact(x: np.ndarray, cal: rc.Calibration, g_rust: np.ndarray) -> Exact:
    # x - mean in f32, as both implementations form it; then the product in f64.
    xc = (x.astype(np.float32) - cal.mean).astype(np.float64)
    a = cal.a_scaled.astype(np.float64)
    u = xc @ a.T
    xn = np.linalg.norm(xc, axis=1)
    eps_u = TOL["cal_u"] * xn[:, None] * np.linalg.norm(a, axis=1)[None, :]
    rms = np.sqrt((u * u).sum(axis=1) / cal.m)
    eps_rms = TOL["cal_u"] * xn * np.linalg.norm(a) / np.sqrt(cal.m)
    g = g_rust.astype(np.float64)
    signs = rc.sign_pattern(cal.rotation_seed, cal.m).double()
    z = np.zeros_like(u)
    eps_z = np.zeros_like(u)
    pos = g > 0
    safe = np.where(pos, g, 1.0)
    for off, w, _ in rc.sub_bands(cal.bits):
        sl = slice(off, off + w)
        y = rc.fwht(torch.from_numpy(u[:, sl]) * signs[sl]).numpy()
        r = rc.band_norm(w)
        z[:, sl] = np.where(pos[:, None], y * r / safe[:, None], 0.0)
        # Every butterfly output is a signed sum of the band's u: independent rounding errors,
        # each within its eps_u, add in quadrature.
        eps_y = np.sqrt((eps_u[:, sl] ** 2).sum(axis=1))
        eps_z[:, sl] = np.where(pos, eps_y * r / safe, 0.0)[:, None]
    return Exact(rms, eps_rms, z, eps_z)


# ---------------------------------------------------------------------------------------
# Comparison.


@dataclasses.dataclass
class HeadResult:
    nears: List[Near]
    compared: Dict[str, int]
    undetermined_values: int
    undetermined_rows: int
    cascaded_rows: int
    decoded: np.ndarray  # the oracle's decode of its own codes


def _fail(field: str, where: str, idx: Tuple[int, ...], detail: str, count: int, total: int) -> None:
    raise ParityError(
        f"{where}: {field} differs at {count} of {total} values; first at {list(idx)}: {detail}"
    )


def pack_independent(indices: np.ndarray, bits: Any) -> bytes:
    """Rows of per-component widths packed with numpy's bit packer (LSB first, each row padded
    to whole bytes): the format's packing, independently of both implementations."""
    b = np.asarray(bits, dtype=np.int64)
    idx = np.asarray(indices, dtype=np.int64).reshape(-1, len(b))
    cols = np.repeat(np.arange(len(b)), b)
    shifts = np.concatenate([np.arange(v) for v in b])
    stream = ((idx[:, cols] >> shifts[None, :]) & 1).astype(np.uint8)
    return np.packbits(stream, axis=1, bitorder="little").tobytes()


def dense_outliers(p: Dict[str, Any], n: int, m: int, where: str) -> Tuple[np.ndarray, np.ndarray]:
    pos = np.asarray(p["outlier_pos"], np.int64)
    bits = np.asarray(p["outlier_bits"]).view(np.uint16)
    if pos.size and (np.any(np.diff(pos) <= 0) or pos.min() < 0 or pos.max() >= n * m):
        _fail("outlier_pos", where, (), "positions not strictly ascending within range", 1, 1)
    if not np.array_equal(np.asarray(p["outlier_val"], np.float32), bits.view(np.float16).astype(np.float32)):
        _fail("outlier_val", where, (), "values are not the fp16 of outlier_bits", 1, 1)
    flags, vals = np.zeros(n * m, bool), np.zeros(n * m, np.uint16)
    flags[pos] = True
    vals[pos] = bits
    return flags.reshape(n, m), vals.reshape(n, m)


def compare_head(x: np.ndarray, codec: kt.CalibratedCodec, cal: rc.Calibration, rust: Dict[str, Any],
                 ours: Dict[str, Any], where: str) -> HeadResult:
    """Compares every code of ``ours`` with ``rust`` (both parts dicts of the extension's types,
    ``ours`` with ``z``, ``g`` and ``indices``). Raises ParityError on a disagreement no
    tolerance covers; returns the near-threshold ones."""
    n, m = int(rust["n"]), cal.m
    for key in ("n", "d", "m", "row_bytes"):
        if rust[key] != ours[key]:
            _fail(key, where, (), f"{ours[key]!r} vs {rust[key]!r}", 1, 1)
    ex = exact(x, cal, np.asarray(rust["g"]))
    nears: List[Near] = []
    compared: Dict[str, int] = {"rows": n}
    live = np.ones(n, bool)
    rows = np.arange(n)
    ip = cal.metric == "inner_product"

    def near(field: str, idx: Tuple[int, ...], dist: float, eps: float) -> None:
        nears.append(Near(field, where, tuple(int(v) for v in idx), float(dist), float(eps)))

    def exponent_check(field: str, ea: int, eb: int, values: np.ndarray, eps: np.ndarray) -> None:
        if ea == eb:
            return
        j = int(np.argmax(np.abs(values)))
        bound = 2.0 ** (min(ea, eb) + 15)  # the maximum decides e <= min or > min
        dist = abs(abs(values[j]) - bound)
        if abs(ea - eb) != 1 or dist > eps[j]:
            _fail(field, where, (), f"{eb} vs {ea}; max {abs(values[j]):.9g}, boundary {bound:.9g}", 1, 1)
        near(field, (j,), dist, eps[j])
        raise _Cascade()

    # The per-row scale g (the rms of u, stored as fp16 with the head's exponent).
    ga, gb = np.asarray(rust["g"], np.float32), np.asarray(ours["g"], np.float32)
    if cal.norm:
        try:
            if not ip:
                compared["scale_exp"] = 1
                exponent_check("scale_exp", int(rust["scale_exp"]), int(ours["scale_exp"]), ex.rms,
                               ex.eps_rms)
        except _Cascade:
            return HeadResult(nears, compared, 0, 0, n, codec.decode_parts(rust))
        e = int(rust["scale_exp"]) if not ip else _exponent(float(ex.rms.max()))
        compared["g"] = n
        bad = ga != gb
        ok, excess = _stored_near(ex.rms, ga, gb, 2.0**e, ex.eps_rms)
        if (bad & ~ok).any():
            i = int(rows[bad & ~ok][0])
            _fail("g", where, (i,), f"{gb[i]!r} vs {ga[i]!r}, exact rms {ex.rms[i]!r}", int(bad.sum()), n)
        for i in rows[bad]:
            near("g", (i,), excess[i], ex.eps_rms[i])
            live[i] = False
        if not ip:
            sa, sb = np.asarray(rust["scale_bits"]), np.asarray(ours["scale_bits"])
            if not np.array_equal(sa[~bad], sb[~bad]):
                _fail("scale_bits", where, (), "differ where g agrees", 1, n)
    elif not np.all(gb == 1.0):
        _fail("g", where, (), "not 1 without norm", 1, n)

    # Quantiser indices at each component's width: neighbouring indices, z within epsilon of
    # the threshold between them.
    det = ex.eps_z <= TOL["undetermined_z"]
    check = live[:, None] & det
    ca = np.asarray(rust["indices"]).reshape(n, m).astype(np.int64)
    cb = np.asarray(ours["indices"]).reshape(n, m).astype(np.int64)
    compared["indices"] = int(check.sum())
    diff = (ca != cb) & check
    if diff.any():
        widths = cal.bits.astype(np.int64)
        dist = np.full((n, m), np.inf)
        lo = np.minimum(ca, cb)
        for b in np.unique(widths[diff.any(axis=0)]):
            table = cal.centroids(int(b))
            thr = (np.float32(0.5) * (table[:-1] + table[1:])).astype(np.float64)
            cols = widths == b
            dist[:, cols] = np.abs(ex.z[:, cols] - thr[np.clip(lo[:, cols], 0, len(thr) - 1)])
        bad = diff & ~((np.abs(ca - cb) == 1) & (dist <= ex.eps_z))
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            _fail("indices", where, (i, j),
                  f"{cb[i, j]} vs {ca[i, j]} ({widths[j]} bits), z = {ex.z[i, j]!r}, "
                  f"{dist[i, j]:.3g} from the threshold (eps {ex.eps_z[i, j]:.3g})", int(diff.sum()),
                  int(check.sum()))
        for i, j in np.argwhere(diff):
            near("indices", (i, j), dist[i, j], ex.eps_z[i, j])

    # Outliers: flags (|z| against T), then the fp16 values where both flag.
    fa, va = dense_outliers(rust, n, m, f"{where} (oracle)")
    fb, vb = dense_outliers(ours, n, m, where)
    out_diff = np.zeros((n, m), bool)
    if cal.threshold is not None:
        compared["outlier_flags"] = int(check.sum())
        dflag = (fa != fb) & check
        dist = np.abs(np.abs(ex.z) - float(np.float32(cal.threshold)))
        bad = dflag & ~(dist <= ex.eps_z)
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            _fail("outlier_pos", where, (i, j), f"flag {fb[i, j]} vs {fa[i, j]}, |z| = {abs(ex.z[i, j])!r}",
                  int(dflag.sum()), int(check.sum()))
        for i, j in np.argwhere(dflag):
            near("outlier_flags", (i, j), dist[i, j], ex.eps_z[i, j])
        both = fa & fb & check
        compared["outlier_bits"] = int(both.sum())
        dval = both & (va != vb)
        if dval.any():
            za, zb = va.view(np.float16).astype(np.float64), vb.view(np.float16).astype(np.float64)
            ok, excess = _stored_near(ex.z, za, zb, 1.0, ex.eps_z)
            if (dval & ~ok).any():
                i, j = (int(v) for v in np.argwhere(dval & ~ok)[0])
                _fail("outlier_bits", where, (i, j), f"{zb[i, j]!r} vs {za[i, j]!r}, z = {ex.z[i, j]!r}",
                      int(dval.sum()), int(both.sum()))
            for i, j in np.argwhere(dval):
                near("outlier_bits", (i, j), excess[i, j], ex.eps_z[i, j])
        out_diff = dflag | dval
    elif fb.any():
        _fail("outlier_pos", where, (), "outliers without a threshold", int(fb.sum()), n * m)

    if ip:
        # The gain g^ <z, q> / <q, q> from Rust's quantised values: exponent, then fp16.
        q = np.zeros((n, m))
        for off, w, b in rc.sub_bands(cal.bits):
            q[:, off:off + w] = cal.centroids(b).astype(np.float64)[ca[:, off:off + w]]
        q = np.where(fa, va.view(np.float16).astype(np.float64), q)
        g = ga.astype(np.float64)
        qq, zq = (q * q).sum(axis=1), (ex.z * q).sum(axis=1)
        safe = np.where(qq > 0, qq, 1.0)
        gain = np.where(qq > 0, g * zq / safe, g)
        # <z, q> may cancel: the z errors times |q|_1 plus the f32 rounding of an m-term sum
        # (each implementation sums in its own order), with 2x slack.
        zq_err = (ex.eps_z * np.abs(q)).sum(axis=1) + m * 2.0**-24 * np.abs(ex.z * q).sum(axis=1)
        eps_g = np.where(qq > 0, 2 * g * zq_err / safe, 0.0) + 2 * 2.0**-24 * np.abs(gain)
        usable = live & det.all(axis=1) & ~((ca != cb) | out_diff).any(axis=1)
        compared["scale_exp"] = 1
        try:
            exponent_check("scale_exp", int(rust["scale_exp"]), int(ours["scale_exp"]), gain, eps_g)
        except _Cascade:
            return HeadResult(nears, compared, int((~det).sum()), int((~det).any(axis=1).sum()), n,
                              codec.decode_parts(rust))
        compared["scale_bits"] = int(usable.sum())
        sa, sb = np.asarray(rust["scale"], np.float32), np.asarray(ours["scale"], np.float32)
        bad = usable & (sa != sb)
        ok, excess = _stored_near(gain, sa, sb, 2.0 ** int(rust["scale_exp"]), eps_g)
        if (bad & ~ok).any():
            i = int(rows[bad & ~ok][0])
            _fail("scale_bits", where, (i,), f"gain {sb[i]!r} vs {sa[i]!r}, exact {gain[i]!r}",
                  int(bad.sum()), int(usable.sum()))
        for i in rows[bad]:
            near("scale_bits (gain)", (i,), excess[i], eps_g[i])

    # The packed rows are exactly the indices packed by an independent packer.
    for name, p in (("oracle", rust), ("ours", ours)):
        stream = pack_independent(p["indices"], cal.bits)
        if bytes(p["codes"]) != stream:
            got = np.frombuffer(bytes(p["codes"]), np.uint8)
            exp = np.frombuffer(stream, np.uint8)
            k = min(got.size, exp.size)
            i = int(np.argmax(got[:k] != exp[:k])) if (got[:k] != exp[:k]).any() else k
            _fail(f"codes ({name})", where, (i // cal.row_bytes, i % cal.row_bytes),
                  f"{got.size} bytes vs {exp.size} packed from its indices", 1, exp.size)
    # Decoded values through the oracle: identical where every code agrees.
    want = codec.decode_parts(rust)
    got = codec.decode_parts(ours)
    same = equal_code_rows(rust, ours, n, m)
    assert_decoded(got[same], want[same], TOL["decode_float32"], f"{where}: oracle decode of our codes")
    return HeadResult(nears, compared, int((~det).sum()), int((~det).any(axis=1).sum()), int((~live).sum()),
                      want)


class _Cascade(Exception):
    """A head-wide exponent differs (near its boundary): nothing after it is comparable."""


def equal_code_rows(rust: Dict[str, Any], ours: Dict[str, Any], n: int, m: int) -> np.ndarray:
    """Rows whose every code agrees (and the head's exponent), for decode comparisons."""
    same = np.ones(n, bool)
    if "scale_exp" in rust:
        if int(rust["scale_exp"]) != int(ours["scale_exp"]):
            return np.zeros(n, bool)
        same &= np.asarray(rust["scale_bits"]) == np.asarray(ours["scale_bits"])
    same &= (np.asarray(rust["indices"]).reshape(n, m) == np.asarray(ours["indices"]).reshape(n, m)).all(1)
    dense = []
    for p in (rust, ours):
        v = np.full(n * m, -1, np.int64)
        v[np.asarray(p["outlier_pos"], np.int64)] = np.asarray(p["outlier_bits"]).view(np.uint16)
        dense.append(v.reshape(n, m))
    return same & (dense[0] == dense[1]).all(1)


# ---------------------------------------------------------------------------------------
# Running a group through an implementation.


@dataclasses.dataclass
class GroupResult:
    label: str
    impl: str
    blocks: int  # heads (the name the kernel tests' summary reads)
    nears: List[Near]
    compared: Dict[str, int]
    undetermined_values: int
    undetermined_rows: int
    cascaded_rows: int
    max_decode_error: float  # float32 decodes
    ms: List[int]
    seconds: float

    def near_violations(self) -> List[str]:
        """Kinds whose near-threshold disagreements exceed their share of the tolerance table
        (at least one is always allowed per kind and group)."""
        out = []
        for field in sorted({nr.field for nr in self.nears}):
            count = sum(nr.field == field for nr in self.nears)
            base = field.split(" ")[0]
            total = self.compared.get(base, self.compared.get("rows", 1))
            share = TOL["near_fraction_fp16" if base in FP16_FIELDS else "near_fraction"]
            if count > max(1.0, share * total):
                out.append(f"{self.label} [{self.impl}] {field}: {count} near-threshold of {total}")
        return out


def _merge(res: GroupResult, h: HeadResult) -> np.ndarray:
    res.nears.extend(h.nears)
    for k, v in h.compared.items():
        res.compared[k] = res.compared.get(k, 0) + v
    res.undetermined_values += h.undetermined_values
    res.undetermined_rows += h.undetermined_rows
    res.cascaded_rows += h.cascaded_rows
    return h.decoded


def run_reference(prep: Prepared, device: str) -> GroupResult:
    """The torch reference, head by head, against the oracle."""
    t0 = time.perf_counter()
    group = prep.group
    res = GroupResult(group.label, "reference", len(prep.rust), [], {}, 0, 0, 0, 0.0, [], 0.0)
    dt = getattr(torch, group.input_dtype)
    for i, (x, codec, cal, rust) in enumerate(zip(prep.x, prep.codecs, prep.cals, prep.rust)):
        where = f"{group.label} head {i} [reference]"
        ours = rc.to_numpy_parts(rc.encode(torch.from_numpy(x).to(device=device, dtype=dt), cal))
        want = _merge(res, compare_head(x, codec, cal, rust, ours, where))
        errs = [
            assert_decoded(rc.decode(rust, cal, device).cpu().numpy(), want, TOL["decode_float32"],
                           f"{where}: decode of the oracle's codes"),
            assert_decoded(rc.decode(ours, cal, device).cpu().numpy(), codec.decode_parts(ours),
                           TOL["decode_float32"], f"{where}: decode of our codes vs the oracle's decoder"),
        ]
        res.max_decode_error = max([res.max_decode_error] + errs)
        res.ms.append(cal.m)
    res.seconds = time.perf_counter() - t0
    return res


def run_kernels(prep: Prepared, device: str, poison: bool = True) -> GroupResult:
    """The Triton kernels, one batched encode and decode for the whole group."""
    from kakeyaturbo import kernels as K

    t0 = time.perf_counter()
    group = prep.group
    res = GroupResult(group.label, "kernels", len(prep.rust), [], {}, 0, 0, 0, 0.0, [], 0.0)
    ns = [len(x) for x in prep.x]
    n = max(ns)
    xs = np.zeros((len(ns), n, group.d), np.float32)
    for i, x in enumerate(prep.x):
        xs[i, : len(x)] = x
    dt = getattr(torch, group.input_dtype)
    batch = K.stack_calibrations(prep.cals, device)
    with K.poison_outputs() if poison else contextlib.nullcontext():
        xt = torch.from_numpy(xs).to(device=device, dtype=dt)
        codes = K.encode_calibrated(xt, batch, ns, intermediates=True)
        dec_ours = K.decode_calibrated(codes, batch, ns, n=n).cpu().numpy()
        rcodes = K.stack_calibrated_parts(prep.rust, batch)
        dec_rust = K.decode_calibrated(rcodes, batch, ns, n=n).cpu().numpy()
        dec_rust16 = K.decode_calibrated(rcodes, batch, ns, torch.bfloat16, n=n).float().cpu().numpy()
    for i, (x, codec, cal, rust) in enumerate(zip(prep.x, prep.codecs, prep.cals, prep.rust)):
        where = f"{group.label} head {i} [kernels]"
        ours = K.head_parts(codes, batch, ns, i)
        want = _merge(res, compare_head(x, codec, cal, rust, ours, where))
        m = ns[i]
        assert_decoded(dec_rust16[i, :m], want, TOL["decode_bfloat16"],
                       f"{where}: bf16 decode of the oracle's codes")
        errs = [
            assert_decoded(dec_rust[i, :m], want, TOL["decode_float32"],
                           f"{where}: decode of the oracle's codes"),
            assert_decoded(dec_ours[i, :m], codec.decode_parts(ours), TOL["decode_float32"],
                           f"{where}: decode of our codes vs the oracle's decoder"),
        ]
        res.max_decode_error = max([res.max_decode_error] + errs)
        res.ms.append(cal.m)
    res.seconds = time.perf_counter() - t0
    return res


def run_all(groups: Sequence[GroupCase], device: str,
            impls: Sequence[str] = ("reference", "kernels")) -> List[GroupResult]:
    """Runs every group through every implementation; raises ParityError on the first failure."""
    out = []
    for group in groups:
        prep = prepare(group)
        for impl in impls:
            out.append(run_reference(prep, device) if impl == "reference" else run_kernels(prep, device))
    return out
