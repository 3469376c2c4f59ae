"""Parity cases of the calibrated mode and the comparison of one head's codes; the oracle is
the Rust codec (``CalibratedCodec.encode_parts`` / ``decode_parts``).

A *group* is one set of batch-wide parameters (D, metric, ``norm``, outlier threshold, input
dtype) and several *heads* (cases), each with its own calibration (fitted by
:func:`kakeyaturbo.calibrate.fit_stream` on its own covariance: bits water-filled at a target
of 1.5..8 bits per element, or a hand-made layout of runs whose lengths are not powers of two;
optionally whitened; N(0, 1), fitted or random Lloyd-Max tables; its own rotation seed), its
own data and row count. The kernels code a group's heads in one batched launch set, the
reference one head at a time.

Every code is compared by name. Float64 recomputation from the calibration (given Rust's
stored scale) tells how far the deciding value of a disagreement sits from its threshold.
Values whose epsilon exceeds ``undetermined_z`` (a component whose ``1 / spread`` is so large
that the f32 projection cannot resolve it) are counted, not compared. Decoded values: each
decoder against the oracle's on the same codes, and the oracle's decode of our codes against
its own codes' on rows where every code agrees, all within ``decode_float32``. The runners,
the bookkeeping and the checks both modes share are in ``../harness.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import kakeyaturbo as kt
from kakeyaturbo import calibrate
from kakeyaturbo.reference import calibrated as rc

from .. import harness
from ..harness import DEFAULT_SEED, DIMS, METRICS, TOL, Comparison, assert_decoded

THRESHOLDS = (None, 2.5, 1.0, 3.0)
TARGETS = (1.5, 2.0, 2.5, 3.0, 3.4, 4.0, 4.4, 5.0, 6.0, 7.0, 8.0)
LAYOUTS = ("water", "hand")
TABLES = ("gauss", "fitted", "random")
DATA = ("model", "heavy", "shift", "offspan", "repeat", "zero", "scaled")

#: Codes that are fp16 roundings (their near-threshold share is ``near_fraction_fp16``).
FP16_FIELDS = ("g", "scale_bits", "outlier_bits")

#: Groups and heads per group: the full set (1,000 cases) and the CI subset, whose two groups
#: (of the full set's parameters, 3 heads of at most 150 rows each) cover inner_product with
#: outliers at T = 1 in f32, and mse without norm with outliers at T = 3 in bf16.
FULL = (125, 8)
SUBSET = ((4, 6), 3)


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
    gids, per_group = harness.plan(full, FULL, SUBSET)
    groups = []
    for gid in gids:
        g = np.random.default_rng(5000 + gid)
        metric = METRICS[gid % 3]
        heads = []
        for j in range(per_group):
            n = harness.row_count(g, gid, j, full)
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
        x = harness.as_seen(head.rows(group.d, head.n, head.data), group.input_dtype)
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


def pack_independent(indices: np.ndarray, bits: Any) -> bytes:
    """Rows of per-component widths packed with numpy's bit packer (LSB first, each row padded
    to whole bytes): the format's packing, independently of both implementations."""
    b = np.asarray(bits, dtype=np.int64)
    idx = np.asarray(indices, dtype=np.int64).reshape(-1, len(b))
    cols = np.repeat(np.arange(len(b)), b)
    shifts = np.concatenate([np.arange(v) for v in b])
    stream = ((idx[:, cols] >> shifts[None, :]) & 1).astype(np.uint8)
    return np.packbits(stream, axis=1, bitorder="little").tobytes()


def compare_head(x: np.ndarray, codec: kt.CalibratedCodec, cal: rc.Calibration, rust: Dict[str, Any],
                 ours: Dict[str, Any], where: str) -> harness.CaseResult:
    """Compares every code of ``ours`` with ``rust`` (both parts dicts of the extension's types,
    ``ours`` with ``z``, ``g`` and ``indices``). Raises ParityError on a disagreement no
    tolerance covers; returns the near-threshold ones."""
    n, m = int(rust["n"]), cal.m
    cmp = Comparison(where, compared={"rows": n})
    for key in ("n", "d", "m", "row_bytes"):
        if rust[key] != ours[key]:
            cmp.fail(key, (), f"{ours[key]!r} vs {rust[key]!r}", 1, 1)
    ex = exact(x, cal, np.asarray(rust["g"]))
    live = np.ones(n, bool)
    ip = cal.metric == "inner_product"

    # The per-row scale g (the rms of u, stored as fp16 with the head's exponent).
    ga, gb = np.asarray(rust["g"], np.float32), np.asarray(ours["g"], np.float32)
    if cal.norm:
        if not ip:
            cmp.compared["scale_exp"] = 1
            ea, eb = int(rust["scale_exp"]), int(ours["scale_exp"])
            if not cmp.exponent("scale_exp", ea, eb, ex.rms, ex.eps_rms):
                return cmp.result(0, 0, n, codec.decode_parts(rust))
        e = int(rust["scale_exp"]) if not ip else harness.exponent_of(float(ex.rms.max()))
        cmp.compared["g"] = n
        bad = ga != gb
        cmp.stored("g", bad, ex.rms, ga, gb, 2.0**e, ex.eps_rms, n,
                   lambda i: f"{gb[i]!r} vs {ga[i]!r}, exact rms {ex.rms[i]!r}")
        live &= ~bad
        if not ip:
            sa, sb = np.asarray(rust["scale_bits"]), np.asarray(ours["scale_bits"])
            if not np.array_equal(sa[~bad], sb[~bad]):
                cmp.fail("scale_bits", (), "differ where g agrees", 1, n)
    elif not np.all(gb == 1.0):
        cmp.fail("g", (), "not 1 without norm", 1, n)

    # Quantiser indices at each component's width: neighbouring indices, z within epsilon of
    # the threshold between them.
    det = ex.eps_z <= TOL["undetermined_z"]
    undetermined_values, undetermined_rows = int((~det).sum()), int((~det).any(axis=1).sum())
    check = live[:, None] & det
    ca = np.asarray(rust["indices"]).reshape(n, m).astype(np.int64)
    cb = np.asarray(ours["indices"]).reshape(n, m).astype(np.int64)
    widths = cal.bits.astype(np.int64)

    def distance(lo: np.ndarray) -> np.ndarray:
        dist = np.full((n, m), np.inf)
        for b in np.unique(widths[((ca != cb) & check).any(axis=0)]):
            table = cal.centroids(int(b))
            thr = (np.float32(0.5) * (table[:-1] + table[1:])).astype(np.float64)
            cols = widths == b
            dist[:, cols] = np.abs(ex.z[:, cols] - thr[np.clip(lo[:, cols], 0, len(thr) - 1)])
        return dist

    cmp.indices("indices", ca, cb, check, ex.z, ex.eps_z, distance, note=lambda j: f" ({widths[j]} bits)")

    # Outliers: flags (|z| against T), then the fp16 values where both flag.
    fa, va = harness.dense_outliers(rust, n, m, f"{where} (oracle)")
    fb, vb = harness.dense_outliers(ours, n, m, where)
    out_diff = cmp.outliers((fa, fb), (va, vb), check, ex.z, ex.eps_z, cal.threshold)

    if ip:
        # The gain g^ <z, q> / <q, q> from Rust's quantised values: exponent, then fp16.
        q = np.zeros((n, m))
        for off, w, b in rc.sub_bands(cal.bits):
            q[:, off:off + w] = cal.centroids(b).astype(np.float64)[ca[:, off:off + w]]
        q = np.where(fa, va.view(np.float16).astype(np.float64), q)
        gain, eps_g = harness.exact_gain(ex.z, q, ga.astype(np.float64), (ex.eps_z * np.abs(q)).sum(axis=1))
        usable = live & det.all(axis=1) & ~((ca != cb) | out_diff).any(axis=1)
        cmp.compared["scale_exp"] = 1
        if not cmp.exponent("scale_exp", int(rust["scale_exp"]), int(ours["scale_exp"]), gain, eps_g):
            return cmp.result(undetermined_values, undetermined_rows, n, codec.decode_parts(rust))
        cmp.compared["scale_bits"] = int(usable.sum())
        sa, sb = np.asarray(rust["scale"], np.float32), np.asarray(ours["scale"], np.float32)
        cmp.stored("scale_bits", usable & (sa != sb), gain, sa, sb, 2.0 ** int(rust["scale_exp"]), eps_g,
                   int(usable.sum()), lambda i: f"gain {sb[i]!r} vs {sa[i]!r}, exact {gain[i]!r}",
                   near_field="scale_bits (gain)")

    # The packed rows are exactly the indices packed by an independent packer.
    for name, p in (("oracle", rust), ("ours", ours)):
        stream = pack_independent(p["indices"], cal.bits)
        i = harness.first_difference(bytes(p["codes"]), stream)
        if i is not None:
            detail = f"{len(bytes(p['codes']))} bytes vs {len(stream)} packed from its indices"
            cmp.fail(f"codes ({name})", (i // cal.row_bytes, i % cal.row_bytes), detail, 1, len(stream))
    # Decoded values through the oracle: identical where every code agrees.
    want = codec.decode_parts(rust)
    got = codec.decode_parts(ours)
    same = equal_code_rows(rust, ours, n, m)
    assert_decoded(got[same], want[same], TOL["decode_float32"], f"{where}: oracle decode of our codes")
    return cmp.result(undetermined_values, undetermined_rows, (~live).sum(), want)


def equal_code_rows(rust: Dict[str, Any], ours: Dict[str, Any], n: int, m: int) -> np.ndarray:
    """Rows whose every code agrees (and the head's exponent), for decode comparisons."""
    same = np.ones(n, bool)
    if "scale_exp" in rust:
        if int(rust["scale_exp"]) != int(ours["scale_exp"]):
            return np.zeros(n, bool)
        same &= np.asarray(rust["scale_bits"]) == np.asarray(ours["scale_bits"])
    same &= (np.asarray(rust["indices"]).reshape(n, m) == np.asarray(ours["indices"]).reshape(n, m)).all(1)
    return same & harness.same_outliers(rust, ours, n, m)


# ---------------------------------------------------------------------------------------
# Running a group through an implementation (``../harness.py``).

MODE = harness.Mode(
    unit="head",
    fp16_fields=FP16_FIELDS,
    compare=lambda prep, i, ours, where: compare_head(prep.x[i], prep.codecs[i], prep.cals[i], prep.rust[i],
                                                      ours, where),
    size=lambda prep, i: prep.cals[i].m,
    reference_encode=lambda prep, i, x: rc.to_numpy_parts(rc.encode(x, prep.cals[i])),
    reference_decode=lambda prep, i, parts, device: rc.decode(parts, prep.cals[i], device).cpu().numpy(),
    oracle_decode=lambda prep, i, parts: prep.codecs[i].decode_parts(parts),
    kernel_batch=lambda K, prep, device: K.stack_calibrations(prep.cals, device),
    kernel_encode=lambda K, x, batch, ns: K.encode_calibrated(x, batch, ns, intermediates=True),
    kernel_decode=lambda K, codes, batch, ns, dtype, n: K.decode_calibrated(codes, batch, ns, dtype, n=n),
    kernel_stack=lambda K, parts, batch: K.stack_calibrated_parts(parts, batch),
    kernel_parts=lambda K, codes, batch, ns, i, prep: K.head_parts(codes, batch, ns, i),
)


def run_reference(prep: Prepared, device: str) -> harness.GroupResult:
    """The torch reference, head by head, against the oracle."""
    return harness.run_reference(MODE, prep, device)


def run_kernels(prep: Prepared, device: str, poison: bool = True) -> harness.GroupResult:
    """The Triton kernels, one batched encode and decode for the whole group."""
    return harness.run_kernels(MODE, prep, device, poison)


def run_all(groups: Sequence[GroupCase], device: str,
            impls: Sequence[str] = ("reference", "kernels")) -> List[harness.GroupResult]:
    """Runs every group through every implementation; raises ParityError on the first failure."""
    return harness.run_all(MODE, prepare, groups, device, impls)
