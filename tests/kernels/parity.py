"""Parity fuzzing of the torch reference and the Triton kernels against the Rust codec.

Plain Python (no pytest import) so that ``benches/gpu_bench.py`` runs the same fuzz on a
machine without pytest. A *group* is one set of codec parameters (D, metric, bit width,
outlier threshold, centroid table, seed, input dtype) and several *blocks* (cases), each with
its own data, row count, PCA method, skeleton precision, variance ratio, rank cap and k; the
kernels code a group's blocks in one batched launch set.

For every block the Rust codec fits the skeleton and encodes (the oracle); the implementation
under test re-encodes stages 2-5 from that skeleton; every code is compared by name. Float64
recomputation from the stored skeleton (given Rust's discrete decisions) tells how far the
deciding value of a disagreement sits from its threshold; only disagreements within the
epsilons of ``tolerances.py`` pass, each is recorded as a :class:`Near`, and they must be rare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import kakeyaturbo as kt
from kakeyaturbo.reference import perblock as ref
from .tolerances import TOLERANCES as TOL

METRICS = ("mse", "inner_product", "linf")
DIMS = (64, 96, 128, 256)
ROWS = (1, 63, 512, 1024, 0)  # 0: a random count
THRESHOLDS = (None, 2.0, 1.0, 2.5)
KINDS = ("kv", "heavy", "lowrank", "flat", "repeat")
DEFAULT_SEED = 0xCAFEBABE

#: Codes that are fp16 roundings (their near-threshold share is ``near_fraction_fp16``).
FP16_FIELDS = ("t_bits", "norm_bits", "outlier_bits", "norm")

#: Blocks per group and groups: the full set and the CI subset.
FULL = (150, 7)
SUBSET = (12, 3)


class ParityError(AssertionError):
    """A disagreement with the oracle that no tolerance covers."""


@dataclasses.dataclass(frozen=True)
class BlockCase:
    seed: int
    n: int
    kind: str
    scale: float
    pca: str
    skeleton_dtype: str
    variance_ratio: float
    rank_cap: Optional[int]
    k: int
    sketch_rank: int  # rsvd_target_rank of the randomized PCA

    def data(self, d: int) -> np.ndarray:
        """The block's rows, float32 ``[n, d]``."""
        g = np.random.default_rng(self.seed)
        n = self.n
        q, _ = np.linalg.qr(g.standard_normal((d, d)))
        if self.kind in ("kv", "heavy"):
            x = (g.standard_normal((n, d)) * g.uniform(0.85, 0.995) ** np.arange(d)) @ q.T
            if self.kind == "heavy":
                x[:, g.integers(d)] *= 8.0
        elif self.kind == "lowrank":
            r = int(g.integers(1, max(2, d // 2)))
            x = g.standard_normal((n, r)) @ q[:r] + 1e-4 * g.standard_normal((n, d))
        elif self.kind == "flat":
            x = g.standard_normal((n, d))
        else:  # "repeat": a few distinct rows, repeated
            distinct = g.standard_normal((3, d)) @ q.T
            x = distinct[g.integers(0, 3, size=n)]
        x = x * self.scale + g.standard_normal(d) * self.scale * g.uniform(0, 3)
        return x.astype(np.float32)

    def kwargs(self) -> Dict[str, Any]:
        kw: Dict[str, Any] = {
            "pca_method": self.pca,
            "skeleton_dtype": self.skeleton_dtype,
            "variance_ratio": self.variance_ratio,
            "rank_cap": self.rank_cap,
            "k": self.k,
            "kmeans_max_iter": 8,
        }
        if self.pca == "randomized":
            kw.update(rsvd_target_rank=self.sketch_rank, rsvd_oversample=4, rsvd_power_iters=1)
        return kw


@dataclasses.dataclass(frozen=True)
class GroupCase:
    gid: int
    d: int
    metric: str
    bit_width: int
    outlier_threshold: Optional[float]
    centroids: Optional[Tuple[float, ...]]
    rotation_seed: int
    input_dtype: str
    blocks: Tuple[BlockCase, ...]

    @property
    def label(self) -> str:
        table = "custom" if self.centroids else "gauss"
        return (
            f"g{self.gid}-D{self.d}-{self.metric}-b{self.bit_width}-T{self.outlier_threshold}-"
            f"{table}-{self.input_dtype}"
        )

    def params(self) -> Dict[str, Any]:
        return {
            "metric": self.metric,
            "bit_width": self.bit_width,
            "outlier_threshold": self.outlier_threshold,
            "centroids": None if self.centroids is None else list(self.centroids),
            "rotation_seed": self.rotation_seed,
        }


def make_groups(full: bool) -> List[GroupCase]:
    """The deterministic case list. Consecutive group ids cycle through every metric x bit
    width (12 groups), D, threshold, table, seed and input dtype; blocks cycle through the row
    counts, data kinds, PCA methods and skeleton precisions."""
    n_groups, per_group = FULL if full else SUBSET
    groups = []
    for gid in range(n_groups):
        g = np.random.default_rng(1000 + gid)
        d = DIMS[gid % 4]
        bw = 1 + (gid // 3) % 4
        table = None
        if (gid // 4) % 3 == 1:
            vals = np.sort(g.standard_normal(1 << bw) * g.uniform(0.5, 2.0))
            vals[1:] = np.maximum(vals[1:], vals[:-1] + 1e-2)  # strictly ascending
            table = tuple(float(np.float32(v)) for v in np.maximum.accumulate(vals))
            if len(set(table)) != len(table):
                table = None
        blocks = []
        for j in range(per_group):
            n = ROWS[(gid + j) % 5] or int(g.integers(2, 1100 if full else 300))
            if not full and n == 1024:
                n = 700
            # d_eff mostly set by the cap (variance ratio near 1), so that it is rarely a power
            # of two; no cap on every fourth block.
            cap = None if (gid + j) % 4 == 3 else int(g.integers(3, d + 1))
            ratio = 1.0 if (gid + j) % 3 == 1 else float(g.uniform(0.9, 0.999))
            blocks.append(
                BlockCase(
                    seed=int(g.integers(2**31)),
                    n=n,
                    kind=KINDS[(gid * 7 + j) % 5],
                    scale=float(10 ** g.uniform(-3, 4)),
                    pca="randomized" if (gid + j) % 2 else "exact",
                    skeleton_dtype="fp32" if (gid + j) % 3 == 0 else "fp16",
                    variance_ratio=ratio,
                    rank_cap=cap,
                    k=int(g.integers(1, 21)),
                    sketch_rank=int(g.integers(3, d)),
                )
            )
        groups.append(
            GroupCase(
                gid=gid,
                d=d,
                metric=METRICS[gid % 3],
                bit_width=bw,
                outlier_threshold=THRESHOLDS[(gid // 2) % 4],
                centroids=table,
                rotation_seed=int(g.integers(2**63)) if gid % 5 == 4 else DEFAULT_SEED,
                input_dtype="bfloat16" if (gid // 6) % 2 else "float32",
                blocks=tuple(blocks),
            )
        )
    return groups


def kv_layer(heads: int, tokens: int, dim: int, seed: int = 7) -> np.ndarray:
    """A KV-like layer, float32 ``[heads, tokens, dim]`` holding bf16 values: per head a
    decaying spectrum in a random basis, noise, per-channel offsets and two offset outlier
    channels (the workload of ``benches/bench_codec.py``)."""
    g = np.random.default_rng(seed)
    r = dim // 2
    out = np.empty((heads, tokens, dim), np.float32)
    for h in range(heads):
        basis, _ = np.linalg.qr(g.standard_normal((dim, r)))
        x = (g.standard_normal((tokens, r)) * np.exp(-3.0 * np.arange(r) / r)) @ basis.T
        x += 0.05 * g.standard_normal((tokens, dim)) + 0.3 * g.standard_normal(dim)
        for c, shift in ((1, 4.0), (dim // 3, -6.0)):
            x[:, c] = 3.0 * x[:, c] + shift
        out[h] = x
    return torch.from_numpy(out).to(torch.bfloat16).float().numpy()


# ---------------------------------------------------------------------------------------
# The oracle side: Rust parts and float64 recomputation of the deciding values.


@dataclasses.dataclass
class Prepared:
    group: GroupCase
    x: List[np.ndarray]  # float32 rows as Rust saw them (bf16-rounded for bf16 groups)
    rust: List[Dict[str, Any]]


def prepare(group: GroupCase) -> Prepared:
    xs, parts = [], []
    for blk in group.blocks:
        x = blk.data(group.d)
        if group.input_dtype == "bfloat16":
            x = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
        xs.append(x)
        parts.append(kt.encode_block_codes(x, **group.params(), **blk.kwargs()))
    return Prepared(group, xs, parts)


def _exponent(m: float) -> int:
    """f16.rs::shared_exponent in exact arithmetic."""
    if m == 0 or not np.isfinite(m):
        return 0
    mant, ex = np.frexp(m)
    return int(np.clip(ex - 15 - (mant == 0.5), -126, 127))


def _f16_round(v: np.ndarray, e: int) -> np.ndarray:
    return (v * 2.0**-e).astype(np.float16).astype(np.float64) * 2.0**e


@dataclasses.dataclass
class Exact:
    """Float64 values of one block computed from the stored skeleton, taking Rust's discrete
    decisions (segments, rounded ``t``, stored norm) as given."""

    xc: np.ndarray  # |x_i - mu|
    g: np.ndarray  # [n, k]
    t: np.ndarray  # g at Rust's segment
    norm: np.ndarray  # |r|
    s_hat: np.ndarray  # the stored norm Rust used
    s_ambiguous: np.ndarray  # inner_product only: |r| within epsilon of an fp16 rounding midpoint
    z: np.ndarray  # [n, d_eff]
    eps_c: np.ndarray  # per-row epsilon of c-linear values (g, t)
    eps_r: np.ndarray  # per-row epsilon of r and |r| (absolute)
    eps_z: np.ndarray  # per-row epsilon of z (z units; inf for a zero residual)


def exact(x: np.ndarray, p: Dict[str, Any]) -> Exact:
    mu = p["mean"].astype(np.float64)
    u = p["basis"].astype(np.float64)
    cen = p["centers"].astype(np.float64)
    de = int(p["d_eff"])
    xc = x.astype(np.float64) - mu
    c = xc @ u.T
    g = c @ cen.T
    seg = p["seg_id"].astype(np.int64)
    t = g[np.arange(len(seg)), seg]
    t_hat = p["t"].astype(np.float64)
    r = c - t_hat[:, None] * cen[seg]
    norm = np.linalg.norm(r, axis=1)
    xn = np.linalg.norm(xc, axis=1)
    eps_c = TOL["c"] * xn
    eps_r = TOL["z"] * (xn + np.abs(t_hat))
    with np.errstate(divide="ignore"):
        eps_z = np.where(norm > 0, eps_r / np.where(norm > 0, norm, 1.0), np.inf)
    if p["metric"] == "inner_product":
        e = _exponent(float(norm.max()))
        s_hat = _f16_round(norm, e)
        # The norm's rounding is ambiguous when |r| lies within epsilon of an fp16 midpoint.
        lo = _f16_round(norm * (1 - 2.0**-11), e)
        hi = _f16_round(norm * (1 + 2.0**-11), e)
        s_ambiguous = (lo != hi) & (
            np.minimum(np.abs(norm - 0.5 * (lo + s_hat)), np.abs(norm - 0.5 * (hi + s_hat)))
            <= eps_r
        )
    else:
        s_hat = p["norm"].astype(np.float64)
        s_ambiguous = np.zeros(len(norm), bool)
    signs = ref.sign_pattern(int(p["rotation_seed"]), de).double()
    y = ref.rotate(torch.from_numpy(r), signs, de).numpy()
    f = ref.band_factors(de).double().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(s_hat[:, None] > 0, y * f[None, :] / s_hat[:, None], 0.0)
    return Exact(xn, g, t, norm, s_hat, s_ambiguous, z, eps_c, eps_r, eps_z)


# ---------------------------------------------------------------------------------------
# Comparison.


@dataclasses.dataclass(frozen=True)
class Near:
    """A disagreement within epsilon of a decision threshold."""

    field: str
    where: str
    index: Tuple[int, ...]
    distance: float  # |deciding value - threshold|
    epsilon: float

    def __str__(self) -> str:
        return (
            f"{self.where} {self.field}{list(self.index)}: {self.distance:.3g} from threshold "
            f"(eps {self.epsilon:.3g})"
        )


@dataclasses.dataclass
class BlockResult:
    nears: List[Near]
    compared: Dict[str, int]
    undetermined_rows: int
    cascaded_rows: int
    decoded: Optional[np.ndarray] = None  # the oracle's decode of its own codes


def _fail(field: str, where: str, idx: Tuple[int, ...], detail: str, count: int, total: int) -> None:
    raise ParityError(
        f"{where}: {field} differs at {count} of {total} values; first at {list(idx)}: {detail}"
    )


def _stored_near(
    v: np.ndarray, a: np.ndarray, b: np.ndarray, scale: Any, eps: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """For stored values ``a``, ``b`` (fp16 times the power of two ``scale``) of an exact value
    ``v``: whether each is the rounding of some value within ``eps`` of ``v`` (so both
    implementations may legitimately have stored them), and by how much ``v`` lies outside the
    farther one's rounding interval (0 when inside)."""
    out = []
    for s_ in (a, b):
        h = (s_ / scale).astype(np.float16)
        half_ulp = 0.5 * np.spacing(np.abs(h)).astype(np.float64) * scale
        out.append(np.maximum(np.abs(s_.astype(np.float64) - v) - half_ulp, 0.0))
    excess = np.maximum(out[0], out[1])
    return excess <= eps, excess


def compare_block(x: np.ndarray, rust: Dict[str, Any], ours: Dict[str, Any], where: str) -> BlockResult:
    """Compares every code of ``ours`` with ``rust`` (both parts dicts of the extension's types).
    Raises ParityError on a disagreement no tolerance covers; returns the near-threshold ones."""
    n, de = int(rust["n"]), int(rust["d_eff"])
    for key in ("n", "d", "d_eff", "k", "bit_width", "metric", "rotation_seed", "outlier_threshold"):
        if rust[key] != ours[key]:
            _fail(key, where, (), f"{ours[key]!r} vs {rust[key]!r}", 1, 1)
    ex = exact(x, rust)
    nears: List[Near] = []
    compared: Dict[str, int] = {}
    live = np.ones(n, bool)  # rows whose codes are still compared
    # Rows whose residual is below the f32 resolution of the projection: no f32 implementation
    # determines their quantiser indices (checked through the decoded values instead).
    undetermined = ex.eps_z > TOL["undetermined_z"]
    rows = np.arange(n)

    def near(field: str, idx: Tuple[int, ...], dist: float, eps: float) -> None:
        nears.append(Near(field, where, tuple(int(v) for v in idx), float(dist), float(eps)))

    # Segments: |g| of the two centres must tie within epsilon.
    a, b = rust["seg_id"], ours["seg_id"]
    compared["seg_id"] = n
    for i in rows[a != b]:
        gap = abs(abs(ex.g[i, a[i]]) - abs(ex.g[i, b[i]]))
        if not (0 <= b[i] < int(rust["k"])) or gap > 2 * ex.eps_c[i]:
            _fail("seg_id", where, (i,), f"{b[i]} vs {a[i]}, |g| gap {gap:.3g} > eps {2 * ex.eps_c[i]:.3g}",
                  int((a != b).sum()), n)
        near("seg_id", (i,), gap, 2 * ex.eps_c[i])
        live[i] = False

    def exponent_check(field: str, ea: int, eb: int, values: np.ndarray, eps: np.ndarray) -> bool:
        if ea == eb:
            return True
        j = int(np.argmax(np.abs(values)))
        bound = 2.0 ** (min(ea, eb) + 15)  # the maximum decides e <= min or > min
        dist = abs(abs(values[j]) - bound)
        if abs(ea - eb) != 1 or dist > eps[j]:
            _fail(field, where, (), f"{eb} vs {ea}; max {abs(values[j]):.9g}, boundary {bound:.9g}", 1, 1)
        near(field, (j,), dist, eps[j])
        return False

    # t: exponent of the block, then each row's fp16 rounding.
    compared["t_exp"] = 1
    if not exponent_check("t_exp", int(rust["t_exp"]), int(ours["t_exp"]), ex.t, ex.eps_c):
        return BlockResult(nears, compared, int(undetermined.sum()), n, kt.decode_block_from_parts(rust))
    compared["t_bits"] = n
    tb_a, tb_b = rust["t_bits"], ours["t_bits"]
    scale_t = 2.0 ** int(rust["t_exp"])
    bad = live & (tb_a != tb_b)
    ok, excess = _stored_near(ex.t, rust["t"], ours["t"], scale_t, ex.eps_c)
    if (bad & ~ok).any():
        i = int(rows[bad & ~ok][0])
        _fail("t_bits", where, (i,), f"{ours['t'][i]!r} vs {rust['t'][i]!r}, exact {ex.t[i]!r}",
              int(bad.sum()), n)
    for i in rows[bad]:
        near("t_bits", (i,), excess[i], ex.eps_c[i])
        live[i] = False

    metric_ip = rust["metric"] == "inner_product"
    if not metric_ip:
        # The stored scale is the norm.
        compared["norm_exp"] = 1
        if not exponent_check("norm_exp", int(rust["norm_exp"]), int(ours["norm_exp"]), ex.norm, ex.eps_r):
            return BlockResult(nears, compared, int(undetermined.sum()), n, kt.decode_block_from_parts(rust))
        # A norm whose uncertainty exceeds undetermined_z is not determined at fp16 precision.
        compared["norm_bits"] = int((live & ~undetermined).sum())
        bad = live & ~undetermined & (rust["norm_bits"] != ours["norm_bits"])
        ok, excess = _stored_near(ex.norm, rust["norm"], ours["norm"], 2.0 ** int(rust["norm_exp"]), ex.eps_r)
        if (bad & ~ok).any():
            i = int(rows[bad & ~ok][0])
            detail = f"{ours['norm'][i]!r} vs {rust['norm'][i]!r}, exact {ex.norm[i]!r}"
            _fail("norm_bits", where, (i,), detail, int(bad.sum()), n)
        for i in rows[bad]:
            near("norm_bits", (i,), excess[i], ex.eps_r[i])
            live[i] = False

    # Dense outlier flags and fp16 values of both.
    thr_out = rust["outlier_threshold"]
    dense = []
    for p in (rust, ours):
        pos = np.asarray(p["outlier_pos"], np.int64)
        if pos.size and (np.any(np.diff(pos) <= 0) or pos.min() < 0 or pos.max() >= n * de):
            _fail("outlier_pos", where, (), "positions not strictly ascending within range", 1, 1)
        flags, vals = np.zeros(n * de, bool), np.zeros(n * de, np.uint16)
        flags[pos] = True
        vals[pos] = np.asarray(p["outlier_bits"]).view(np.uint16)
        dense += [flags.reshape(n, de), vals.reshape(n, de)]
    fa, va, fb, vb = dense
    ca = np.asarray(rust["residual_codes"]).reshape(n, de).astype(np.int64)
    cb = np.asarray(ours["residual_codes"]).reshape(n, de).astype(np.int64)
    check = live & ~undetermined
    # inner_product stores the gain, not the norm: a row whose norm sits on an fp16 midpoint may
    # be scaled by either rounding, which moves all its z. Such a row, when anything in it
    # differs, is one near-threshold case of the (internal) norm and is not compared further.
    amb = check & ex.s_ambiguous & ((ca != cb) | (fa != fb) | (va != vb)).any(axis=1)
    for i in rows[amb]:
        near("norm (internal, inner_product)", (i,), 0.0, ex.eps_r[i])
    check &= ~amb

    # Quantiser indices: neighbouring indices, z within epsilon of the threshold between them.
    thr = ref.thresholds(torch.from_numpy(np.asarray(rust["centroids"], np.float32))).double().numpy()
    compared["residual_codes"] = int(check.sum()) * de
    diff = (ca != cb) & check[:, None]
    row_code_diff = diff.any(axis=1)
    eps = ex.eps_z[:, None] * np.ones(de)
    if diff.any():
        lo = np.minimum(ca, cb)
        adj = np.abs(ca - cb) == 1
        dist = np.abs(ex.z - thr[np.clip(lo, 0, len(thr) - 1)])
        bad = diff & ~(adj & (dist <= eps))
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            _fail("residual_codes", where, (i, j),
                  f"{cb[i, j]} vs {ca[i, j]}, z = {ex.z[i, j]!r}, {dist[i, j]:.3g} from the threshold "
                  f"(eps {eps[i, j]:.3g})", int(diff.sum()), int(check.sum()) * de)
        for i, j in np.argwhere(diff):
            near("residual_codes", (i, j), dist[i, j], eps[i, j])

    # Outliers: flags (|z| against T), then the fp16 values where both flag.
    row_out_diff = np.zeros(n, bool)
    if thr_out is not None:
        compared["outlier_flags"] = int(check.sum()) * de
        dflag = (fa != fb) & check[:, None]
        dist = np.abs(np.abs(ex.z) - float(np.float32(thr_out)))
        bad = dflag & ~(dist <= eps)
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            _fail("outlier_pos", where, (i, j), f"flag {fb[i, j]} vs {fa[i, j]}, |z| = {abs(ex.z[i, j])!r}",
                  int(dflag.sum()), int(check.sum()) * de)
        for i, j in np.argwhere(dflag):
            near("outlier_flags", (i, j), dist[i, j], eps[i, j])
        both = fa & fb & check[:, None]
        compared["outlier_bits"] = int(both.sum())
        dval = both & (va != vb)
        if dval.any():
            za = va.view(np.float16).astype(np.float64)
            zb = vb.view(np.float16).astype(np.float64)
            ok, excess = _stored_near(ex.z, za, zb, 1.0, eps)
            if (dval & ~ok).any():
                i, j = (int(v) for v in np.argwhere(dval & ~ok)[0])
                _fail("outlier_bits", where, (i, j), f"{zb[i, j]!r} vs {za[i, j]!r}, z = {ex.z[i, j]!r}",
                      int(dval.sum()), int(both.sum()))
            for i, j in np.argwhere(dval):
                near("outlier_bits", (i, j), excess[i, j], eps[i, j])
        row_out_diff = (dflag | dval).any(axis=1)

    if metric_ip:
        # The gain s^ <z, q> / <q, q> from Rust's quantised values: exponent, then fp16 rounding.
        table = np.asarray(rust["centroids"], np.float64)
        q = np.where(fa, va.view(np.float16).astype(np.float64), table[ca])
        qq, zq = (q * q).sum(axis=1), (ex.z * q).sum(axis=1)
        safe = np.where(qq > 0, qq, 1.0)
        gain = np.where(qq > 0, ex.s_hat * zq / safe, ex.s_hat)
        # <z, q> may cancel (a table far from z's distribution): bound its error by the z error
        # times |q|_1 plus the f32 rounding of a d_eff-term sum, with 2x slack.
        zq_err = np.where(np.isfinite(ex.eps_z), ex.eps_z, 0.0) * np.abs(q).sum(axis=1)
        zq_err += de * 2.0**-24 * np.abs(ex.z * q).sum(axis=1)
        eps_g = np.where(qq > 0, 2 * ex.s_hat * zq_err / safe, 0.0) + 2 * 2.0**-24 * np.abs(gain)
        compared["norm_exp"] = 1
        usable = check & ~row_code_diff & ~row_out_diff
        if not exponent_check("norm_exp", int(rust["norm_exp"]), int(ours["norm_exp"]), gain, eps_g):
            return BlockResult(nears, compared, int(undetermined.sum()), n, kt.decode_block_from_parts(rust))
        compared["norm_bits"] = int(usable.sum())
        bad = usable & (rust["norm_bits"] != ours["norm_bits"])
        ok, excess = _stored_near(gain, rust["norm"], ours["norm"], 2.0 ** int(rust["norm_exp"]), eps_g)
        if (bad & ~ok).any():
            i = int(rows[bad & ~ok][0])
            detail = f"gain {ours['norm'][i]!r} vs {rust['norm'][i]!r}, exact {gain[i]!r}"
            _fail("norm_bits", where, (i,), detail, int(bad.sum()), int(usable.sum()))
        for i in rows[bad]:
            near("norm_bits (gain)", (i,), excess[i], eps_g[i])

    # The packed stream is exactly our indices packed by the extension's own packer.
    stream = kt.pack_bits(np.asarray(ours["residual_codes"]).reshape(-1), int(rust["bit_width"]))
    if bytes(ours["residual_packed"]) != stream:
        got = np.frombuffer(bytes(ours["residual_packed"]), np.uint8)
        exp = np.frombuffer(stream, np.uint8)
        m = min(got.size, exp.size)
        i = int(np.argmax(got[:m] != exp[:m])) if (got[:m] != exp[:m]).any() else m
        _fail("residual_packed", where, (i,), f"{got.size} bytes vs {exp.size}", 1, exp.size)
    # Decoded values through the oracle's decoder: identical where every code agrees; within
    # the residual's f32 uncertainty on undetermined rows.
    want = kt.decode_block_from_parts(rust)
    got = kt.decode_block_from_parts(ours)
    same = equal_code_rows(rust, ours)
    assert_decoded(got[same], want[same], TOL["decode_float32"], f"{where}: oracle decode of our codes")
    und = undetermined & live & ~same
    if und.any() and int(rust["norm_exp"]) == int(ours["norm_exp"]):
        dist = np.linalg.norm(got[und].astype(np.float64) - want[und], axis=1)
        limit = TOL["undetermined_decode"] * ex.eps_r[und]
        if (dist > limit).any():
            i = int(rows[und][np.argmax(dist > limit)])
            _fail("decoded row (undetermined codes)", where, (i,),
                  f"|difference| {dist.max():.3g} > {limit.max():.3g}",
                  int((dist > limit).sum()), int(und.sum()))
    return BlockResult(nears, compared, int(undetermined.sum()), int((~live).sum()), want)


def rel_error(a: np.ndarray, b: np.ndarray) -> Tuple[float, Tuple[int, ...]]:
    """``max |a - b| / max |b|`` and the index of the largest difference."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    if d.size == 0:
        return 0.0, ()
    if not np.isfinite(d).all():
        idx = tuple(int(v) for v in np.argwhere(~np.isfinite(d))[0])
        return float("inf"), idx
    idx = tuple(int(v) for v in np.unravel_index(int(np.argmax(d)), d.shape))
    return float(d.max() / max(float(np.abs(b).max()), 1e-30)), idx


def assert_decoded(got: np.ndarray, want: np.ndarray, limit: float, what: str) -> float:
    err, idx = rel_error(got, want)
    if not err <= limit:
        raise ParityError(
            f"{what}: relative error {err:.3g} > {limit:.3g}; largest at {list(idx)} "
            f"({got[idx] if idx else None!r} vs {want[idx] if idx else None!r})"
        )
    return err


def equal_code_rows(rust: Dict[str, Any], ours: Dict[str, Any]) -> np.ndarray:
    """Rows whose every code agrees (and the block's exponents), for decode comparisons."""
    n, de = int(rust["n"]), int(rust["d_eff"])
    if int(rust["t_exp"]) != int(ours["t_exp"]) or int(rust["norm_exp"]) != int(ours["norm_exp"]):
        return np.zeros(n, bool)
    same = (rust["seg_id"] == ours["seg_id"]) & (rust["t_bits"] == ours["t_bits"])
    same &= rust["norm_bits"] == ours["norm_bits"]
    ca = np.asarray(rust["residual_codes"]).reshape(n, de)
    same &= (ca == np.asarray(ours["residual_codes"]).reshape(n, de)).all(1)
    dense = []
    for p in (rust, ours):
        v = np.full(n * de, -1, np.int64)
        v[np.asarray(p["outlier_pos"], np.int64)] = np.asarray(p["outlier_bits"]).view(np.uint16)
        dense.append(v.reshape(n, de))
    return same & (dense[0] == dense[1]).all(1)


# ---------------------------------------------------------------------------------------
# Running a group through an implementation.


@dataclasses.dataclass
class GroupResult:
    label: str
    impl: str
    blocks: int
    nears: List[Near]
    compared: Dict[str, int]
    undetermined_rows: int
    cascaded_rows: int
    max_decode_error: float  # float32 decodes
    d_effs: List[int]
    seconds: float

    def near_violations(self) -> List[str]:
        """Kinds whose near-threshold disagreements exceed their share of the tolerance table
        (at least one is always allowed per kind and group)."""
        out = []
        for field in sorted({nr.field for nr in self.nears}):
            count = sum(nr.field == field for nr in self.nears)
            base = field.split(" ")[0]
            total = self.compared.get(base, self.compared.get("seg_id", 1))
            share = TOL["near_fraction_fp16" if base in FP16_FIELDS else "near_fraction"]
            if count > max(1.0, share * total):
                out.append(f"{self.label} [{self.impl}] {field}: {count} near-threshold of {total}")
        return out


def run_reference(prep: Prepared, device: str) -> GroupResult:
    """The torch reference, block by block, against the oracle."""
    t0 = time.perf_counter()
    group = prep.group
    res = GroupResult(group.label, "reference", len(prep.rust), [], {}, 0, 0, 0.0, [], 0.0)
    dt = getattr(torch, group.input_dtype)
    for i, (x, rust) in enumerate(zip(prep.x, prep.rust)):
        where = f"{group.label} block {i} [reference]"
        xt = torch.from_numpy(x).to(device=device, dtype=dt)
        ours = ref.to_numpy_parts(ref.encode_block(xt, rust))
        want = _merge(res, compare_block(x, rust, ours, where))
        got = ref.decode_block(rust, device).cpu().numpy()
        err = assert_decoded(got, want, TOL["decode_float32"], f"{where}: decode of the oracle's codes")
        res.max_decode_error = max(res.max_decode_error, err)
        res.d_effs.append(int(rust["d_eff"]))
    res.seconds = time.perf_counter() - t0
    return res


def run_kernels(prep: Prepared, device: str, poison: bool = True) -> GroupResult:
    """The Triton kernels, one batched encode and decode for the whole group."""
    from kakeyaturbo import kernels as K

    t0 = time.perf_counter()
    group = prep.group
    res = GroupResult(group.label, "kernels", len(prep.rust), [], {}, 0, 0, 0.0, [], 0.0)
    ns = [len(x) for x in prep.x]
    n = max(ns)
    xs = np.zeros((len(ns), n, group.d), np.float32)
    for i, x in enumerate(prep.x):
        xs[i, : len(x)] = x
    dt = getattr(torch, group.input_dtype)
    skel = K.stack_skeletons(prep.rust, device)
    with K.poison_outputs() if poison else contextlib.nullcontext():
        codes = K.encode_blocks(torch.from_numpy(xs).to(device=device, dtype=dt), skel, ns)
        dec_ours = K.decode_blocks(codes, skel, ns).cpu().numpy()
        rcodes = K.stack_codes(prep.rust, skel)
        dec_rust = K.decode_blocks(rcodes, skel, ns).cpu().numpy()
        dec_rust16 = K.decode_blocks(rcodes, skel, ns, torch.bfloat16).float().cpu().numpy()
    for i, (x, rust) in enumerate(zip(prep.x, prep.rust)):
        where = f"{group.label} block {i} [kernels]"
        ours = K.block_parts(codes, skel, ns, i, rust)
        want = _merge(res, compare_block(x, rust, ours, where))
        m = ns[i]
        assert_decoded(dec_rust16[i, :m], want, TOL["decode_bfloat16"],
                       f"{where}: bf16 decode of the oracle's codes")
        errs = [
            assert_decoded(dec_rust[i, :m], want, TOL["decode_float32"],
                           f"{where}: decode of the oracle's codes"),
            assert_decoded(dec_ours[i, :m], kt.decode_block_from_parts(ours), TOL["decode_float32"],
                           f"{where}: decode of our codes vs the oracle's decoder"),
        ]
        res.max_decode_error = max([res.max_decode_error] + errs)
        res.d_effs.append(int(rust["d_eff"]))
    res.seconds = time.perf_counter() - t0
    return res


def _merge(res: GroupResult, b: BlockResult) -> np.ndarray:
    res.nears.extend(b.nears)
    for k, v in b.compared.items():
        res.compared[k] = res.compared.get(k, 0) + v
    res.undetermined_rows += b.undetermined_rows
    res.cascaded_rows += b.cascaded_rows
    assert b.decoded is not None
    return b.decoded


def run_all(
    groups: Sequence[GroupCase], device: str, impls: Sequence[str] = ("reference", "kernels")
) -> List[GroupResult]:
    """Runs every group through every implementation; raises ParityError on the first failure."""
    out = []
    for group in groups:
        prep = prepare(group)
        for impl in impls:
            r = run_reference(prep, device) if impl == "reference" else run_kernels(prep, device)
            out.append(r)
    return out
