"""Parity cases of the per-block mode and the comparison of one block's codes.

A *group* is one set of codec parameters (D, metric, bit width, outlier threshold, centroid
table, seed, input dtype) and several *blocks* (cases), each with its own data, row count, PCA
method, skeleton precision, variance ratio, rank cap and k; the kernels code a group's blocks
in one batched launch set. For every block the Rust codec fits the skeleton and encodes (the
oracle); the implementation under test re-encodes stages 2-5 from that skeleton; every code is
compared by name. Float64 recomputation from the stored skeleton (given Rust's discrete
decisions) tells how far the deciding value of a disagreement sits from its threshold. The
runners, the bookkeeping and the checks both modes share are in ``../harness.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

import kakeyaturbo as kt
from kakeyaturbo.reference import perblock as ref

from .. import harness
from ..harness import DEFAULT_SEED, DIMS, METRICS, TOL, Comparison, assert_decoded

THRESHOLDS = (None, 2.0, 1.0, 2.5)
KINDS = ("kv", "heavy", "lowrank", "flat", "repeat")

#: Codes that are fp16 roundings (their near-threshold share is ``near_fraction_fp16``).
FP16_FIELDS = ("t_bits", "norm_bits", "outlier_bits", "norm")

#: Groups and blocks per group: the full set and the CI subset (its first 12 groups).
FULL = (150, 7)
SUBSET = (range(12), 3)


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
    gids, per_group = harness.plan(full, FULL, SUBSET)
    groups = []
    for gid in gids:
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
            n = harness.row_count(g, gid, j, full)
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
        x = harness.as_seen(blk.data(group.d), group.input_dtype)
        xs.append(x)
        parts.append(kt.encode_block_codes(x, **group.params(), **blk.kwargs()))
    return Prepared(group, xs, parts)


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
        e = harness.exponent_of(float(norm.max()))
        s_hat = harness.f16_round(norm, e)
        # The norm's rounding is ambiguous when |r| lies within epsilon of an fp16 midpoint.
        lo = harness.f16_round(norm * (1 - 2.0**-11), e)
        hi = harness.f16_round(norm * (1 + 2.0**-11), e)
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


def compare_block(
    x: np.ndarray, rust: Dict[str, Any], ours: Dict[str, Any], where: str
) -> harness.CaseResult:
    """Compares every code of ``ours`` with ``rust`` (both parts dicts of the extension's types).
    Raises ParityError on a disagreement no tolerance covers; returns the near-threshold ones."""
    n, de = int(rust["n"]), int(rust["d_eff"])
    cmp = Comparison(where)
    for key in ("n", "d", "d_eff", "k", "bit_width", "metric", "rotation_seed", "outlier_threshold"):
        if rust[key] != ours[key]:
            cmp.fail(key, (), f"{ours[key]!r} vs {rust[key]!r}", 1, 1)
    ex = exact(x, rust)
    live = np.ones(n, bool)  # rows whose codes are still compared
    # Rows whose residual is below the f32 resolution of the projection: no f32 implementation
    # determines their quantiser indices (checked through the decoded values instead).
    undetermined = ex.eps_z > TOL["undetermined_z"]
    rows = np.arange(n)

    def cascaded() -> harness.CaseResult:
        want = kt.decode_block_from_parts(rust)
        return cmp.result(int(undetermined.sum()) * de, undetermined.sum(), n, want)

    # Segments: |g| of the two centres must tie within epsilon.
    a, b = rust["seg_id"], ours["seg_id"]
    cmp.compared["seg_id"] = n
    for i in rows[a != b]:
        gap = abs(abs(ex.g[i, a[i]]) - abs(ex.g[i, b[i]]))
        if not (0 <= b[i] < int(rust["k"])) or gap > 2 * ex.eps_c[i]:
            cmp.fail("seg_id", (i,), f"{b[i]} vs {a[i]}, |g| gap {gap:.3g} > eps {2 * ex.eps_c[i]:.3g}",
                     int((a != b).sum()), n)
        cmp.near("seg_id", (i,), gap, 2 * ex.eps_c[i])
        live[i] = False

    # t: exponent of the block, then each row's fp16 rounding.
    cmp.compared["t_exp"] = 1
    if not cmp.exponent("t_exp", int(rust["t_exp"]), int(ours["t_exp"]), ex.t, ex.eps_c):
        return cascaded()
    cmp.compared["t_bits"] = n
    bad = live & (rust["t_bits"] != ours["t_bits"])
    cmp.stored("t_bits", bad, ex.t, rust["t"], ours["t"], 2.0 ** int(rust["t_exp"]), ex.eps_c, n,
               lambda i: f"{ours['t'][i]!r} vs {rust['t'][i]!r}, exact {ex.t[i]!r}")
    live &= ~bad

    metric_ip = rust["metric"] == "inner_product"
    if not metric_ip:
        # The stored scale is the norm.
        cmp.compared["norm_exp"] = 1
        if not cmp.exponent("norm_exp", int(rust["norm_exp"]), int(ours["norm_exp"]), ex.norm, ex.eps_r):
            return cascaded()
        # A norm whose uncertainty exceeds undetermined_z is not determined at fp16 precision.
        cmp.compared["norm_bits"] = int((live & ~undetermined).sum())
        bad = live & ~undetermined & (rust["norm_bits"] != ours["norm_bits"])
        cmp.stored("norm_bits", bad, ex.norm, rust["norm"], ours["norm"], 2.0 ** int(rust["norm_exp"]),
                   ex.eps_r, n, lambda i: f"{ours['norm'][i]!r} vs {rust['norm'][i]!r}, exact {ex.norm[i]!r}")
        live &= ~bad

    # Dense outlier flags and fp16 values of both.
    fa, va = harness.dense_outliers(rust, n, de, f"{where} (oracle)")
    fb, vb = harness.dense_outliers(ours, n, de, where)
    ca = np.asarray(rust["residual_codes"]).reshape(n, de).astype(np.int64)
    cb = np.asarray(ours["residual_codes"]).reshape(n, de).astype(np.int64)
    check = live & ~undetermined
    # inner_product stores the gain, not the norm: a row whose norm sits on an fp16 midpoint may
    # be scaled by either rounding, which moves all its z. Such a row, when anything in it
    # differs, is one near-threshold case of the (internal) norm and is not compared further.
    amb = check & ex.s_ambiguous & ((ca != cb) | (fa != fb) | (va != vb)).any(axis=1)
    for i in rows[amb]:
        cmp.near("norm (internal, inner_product)", (i,), 0.0, ex.eps_r[i])
    check &= ~amb
    check2 = np.repeat(check[:, None], de, axis=1)
    eps = ex.eps_z[:, None] * np.ones(de)

    # Quantiser indices: neighbouring indices, z within epsilon of the threshold between them.
    thr = ref.thresholds(torch.from_numpy(np.asarray(rust["centroids"], np.float32))).double().numpy()
    row_code_diff = cmp.indices("residual_codes", ca, cb, check2, ex.z, eps,
                                lambda lo: np.abs(ex.z - thr[np.clip(lo, 0, len(thr) - 1)])).any(axis=1)
    # Outliers: flags (|z| against T), then the fp16 values where both flag.
    row_out_diff = cmp.outliers((fa, fb), (va, vb), check2, ex.z, eps, rust["outlier_threshold"]).any(axis=1)

    if metric_ip:
        # The gain s^ <z, q> / <q, q> from Rust's quantised values: exponent, then fp16 rounding.
        table = np.asarray(rust["centroids"], np.float64)
        q = np.where(fa, va.view(np.float16).astype(np.float64), table[ca])
        z_error = np.where(np.isfinite(ex.eps_z), ex.eps_z, 0.0) * np.abs(q).sum(axis=1)
        gain, eps_g = harness.exact_gain(ex.z, q, ex.s_hat, z_error)
        cmp.compared["norm_exp"] = 1
        usable = check & ~row_code_diff & ~row_out_diff
        if not cmp.exponent("norm_exp", int(rust["norm_exp"]), int(ours["norm_exp"]), gain, eps_g):
            return cascaded()
        cmp.compared["norm_bits"] = int(usable.sum())
        bad = usable & (rust["norm_bits"] != ours["norm_bits"])
        cmp.stored("norm_bits", bad, gain, rust["norm"], ours["norm"], 2.0 ** int(rust["norm_exp"]), eps_g,
                   int(usable.sum()),
                   lambda i: f"gain {ours['norm'][i]!r} vs {rust['norm'][i]!r}, exact {gain[i]!r}",
                   near_field="norm_bits (gain)")

    # The packed stream is exactly our indices packed by the extension's own packer.
    stream = kt.pack_bits(np.asarray(ours["residual_codes"]).reshape(-1), int(rust["bit_width"]))
    i = harness.first_difference(bytes(ours["residual_packed"]), stream)
    if i is not None:
        cmp.fail("residual_packed", (i,), f"{len(bytes(ours['residual_packed']))} bytes vs {len(stream)}",
                 1, len(stream))
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
            cmp.fail("decoded row (undetermined codes)", (i,),
                     f"|difference| {dist.max():.3g} > {limit.max():.3g}", int((dist > limit).sum()),
                     int(und.sum()))
    return cmp.result(int(undetermined.sum()) * de, undetermined.sum(), (~live).sum(), want)


def equal_code_rows(rust: Dict[str, Any], ours: Dict[str, Any]) -> np.ndarray:
    """Rows whose every code agrees (and the block's exponents), for decode comparisons."""
    n, de = int(rust["n"]), int(rust["d_eff"])
    if int(rust["t_exp"]) != int(ours["t_exp"]) or int(rust["norm_exp"]) != int(ours["norm_exp"]):
        return np.zeros(n, bool)
    same = (rust["seg_id"] == ours["seg_id"]) & (rust["t_bits"] == ours["t_bits"])
    same &= rust["norm_bits"] == ours["norm_bits"]
    ca = np.asarray(rust["residual_codes"]).reshape(n, de)
    same &= (ca == np.asarray(ours["residual_codes"]).reshape(n, de)).all(1)
    return same & harness.same_outliers(rust, ours, n, de)


# ---------------------------------------------------------------------------------------
# Running a group through an implementation (``../harness.py``).

MODE = harness.Mode(
    unit="block",
    fp16_fields=FP16_FIELDS,
    compare=lambda prep, i, ours, where: compare_block(prep.x[i], prep.rust[i], ours, where),
    size=lambda prep, i: int(prep.rust[i]["d_eff"]),
    reference_encode=lambda prep, i, x: ref.to_numpy_parts(ref.encode_block(x, prep.rust[i])),
    reference_decode=lambda prep, i, parts, device: ref.decode_block(parts, device).cpu().numpy(),
    oracle_decode=lambda prep, i, parts: kt.decode_block_from_parts(parts),
    kernel_batch=lambda K, prep, device: K.stack_skeletons(prep.rust, device),
    kernel_encode=lambda K, x, skel, ns: K.encode_blocks(x, skel, ns),
    kernel_decode=lambda K, codes, skel, ns, dtype, n: K.decode_blocks(codes, skel, ns, dtype),
    kernel_stack=lambda K, parts, skel: K.stack_codes(parts, skel),
    kernel_parts=lambda K, codes, skel, ns, i, prep: K.block_parts(codes, skel, ns, i, prep.rust[i]),
)


def run_reference(prep: Prepared, device: str) -> harness.GroupResult:
    """The torch reference, block by block, against the oracle."""
    return harness.run_reference(MODE, prep, device)


def run_kernels(prep: Prepared, device: str, poison: bool = True) -> harness.GroupResult:
    """The Triton kernels, one batched encode and decode for the whole group."""
    return harness.run_kernels(MODE, prep, device, poison)


def run_all(groups: Sequence[GroupCase], device: str,
            impls: Sequence[str] = ("reference", "kernels")) -> List[harness.GroupResult]:
    """Runs every group through every implementation; raises ParityError on the first failure."""
    return harness.run_all(MODE, prepare, groups, device, impls)
