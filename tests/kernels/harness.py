"""The parity harness of both kernel modes: the torch reference and the Triton kernels against
the Rust codec (the oracle).

Plain Python (no pytest import) so that ``benches/gpu_bench.py`` runs the same fuzz on a
machine without pytest. A mode (``perblock/parity.py``, ``calibrated/parity.py``) defines its
cases (a *group* of batch-wide parameters and several *cases*: blocks or heads), how the
oracle prepares them, how one case's codes are compared, and a :class:`Mode`: one small
function per step that differs between the modes. Everything else is here, once:

- case plumbing: which groups run (the full set or the CI subset), the row counts, inputs as
  Rust sees them, the padded batch the kernels code in one launch set;
- the bookkeeping of one comparison (:class:`Comparison`): a disagreement passes only where the
  value that decides it lies within an epsilon of ``tolerances.py`` of its threshold; each is
  recorded as a :class:`Near` and they must be rare; anything else raises :class:`ParityError`
  naming the field, the first index and the count;
- the checks both modes make the same way: shared fp16 exponents, stored fp16 values,
  neighbouring quantiser indices, outlier flags and values, the ``inner_product`` gain, packed
  bytes, decoded values;
- the runners: the reference case by case, the kernels in one batched encode and decode per
  group with poisoned outputs, and the results (:class:`GroupResult`) the tests and the GPU
  script report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

import numpy as np
import torch

from .tolerances import TOLERANCES as TOL

METRICS = ("mse", "inner_product", "linf")
DIMS = (64, 96, 128, 256)
ROWS = (1, 63, 512, 1024, 0)  # 0: a random count
DEFAULT_SEED = 0xCAFEBABE


class ParityError(AssertionError):
    """A disagreement with the oracle that no tolerance covers."""


# ---------------------------------------------------------------------------------------
# Case plumbing.


def plan(
    full: bool, full_set: Tuple[int, int], subset: Tuple[Sequence[int], int]
) -> Tuple[Sequence[int], int]:
    """Group ids and cases per group: ``full_set`` is (groups, cases per group) of the full
    fuzz, ``subset`` (group ids, cases per group) of the CI subset."""
    if full:
        return range(full_set[0]), full_set[1]
    return subset


def row_count(g: np.random.Generator, gid: int, j: int, full: bool) -> int:
    """Rows of case ``j`` of group ``gid``: cycling through :data:`ROWS`, a random count (from
    ``g``, which is drawn only then) for the 0 entry."""
    return ROWS[(gid + j) % 5] or int(g.integers(2, 1100 if full else 300))


def as_seen(x: np.ndarray, input_dtype: str) -> np.ndarray:
    """float32 rows as Rust sees them: rounded to bfloat16 for a bfloat16 group."""
    if input_dtype == "bfloat16":
        return torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    return x


def padded(xs: Sequence[np.ndarray], d: int) -> np.ndarray:
    """The cases' rows zero-padded to one float32 ``[B, max n, d]`` batch."""
    out = np.zeros((len(xs), max(len(x) for x in xs), d), np.float32)
    for i, x in enumerate(xs):
        out[i, : len(x)] = x
    return out


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
# Exact arithmetic of the format.


def exponent_of(m: float) -> int:
    """f16.rs::shared_exponent in exact arithmetic."""
    if m == 0 or not np.isfinite(m):
        return 0
    mant, ex = np.frexp(m)
    return int(np.clip(ex - 15 - (mant == 0.5), -126, 127))


def f16_round(v: np.ndarray, e: int) -> np.ndarray:
    """``v`` stored as fp16 with the shared exponent ``e``, as float64."""
    return (v * 2.0**-e).astype(np.float16).astype(np.float64) * 2.0**e


def stored_near(
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


def exact_gain(
    z: np.ndarray, q: np.ndarray, scale: np.ndarray, z_error: np.ndarray
) -> Tuple[np.ndarray, np.ndarray]:
    """The ``inner_product`` gain ``scale <z, q> / <q, q>`` of every row (float64 ``[n]``, from
    the oracle's quantised values ``q [n, m]``) and its epsilon. ``<z, q>`` may cancel (a table
    far from z's distribution): its error is ``z_error`` (the z errors times ``|q|``) plus the
    f32 rounding of an m-term sum (each implementation sums in its own order), with 2x slack."""
    qq, zq = (q * q).sum(axis=1), (z * q).sum(axis=1)
    safe = np.where(qq > 0, qq, 1.0)
    gain = np.where(qq > 0, scale * zq / safe, scale)
    zq_err = z_error + q.shape[1] * 2.0**-24 * np.abs(z * q).sum(axis=1)
    eps = np.where(qq > 0, 2 * scale * zq_err / safe, 0.0) + 2 * 2.0**-24 * np.abs(gain)
    return gain, eps


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
    """Raises ParityError unless ``rel_error(got, want) <= limit`` (NaN, e.g. a poisoned value
    no kernel wrote, never passes); returns the error."""
    err, idx = rel_error(got, want)
    if not err <= limit:
        raise ParityError(
            f"{what}: relative error {err:.3g} > {limit:.3g}; largest at {list(idx)} "
            f"({got[idx] if idx else None!r} vs {want[idx] if idx else None!r})"
        )
    return err


def dense_outliers(p: Dict[str, Any], n: int, m: int, where: str) -> Tuple[np.ndarray, np.ndarray]:
    """The sparse outliers of a parts dict as dense ``[n, m]`` flags and fp16 bits (uint16).
    Raises ParityError unless the positions ascend strictly within range and ``outlier_val``
    holds the fp16 values of ``outlier_bits``."""
    pos = np.asarray(p["outlier_pos"], np.int64)
    bits = np.asarray(p["outlier_bits"]).view(np.uint16)
    if pos.size and (np.any(np.diff(pos) <= 0) or pos.min() < 0 or pos.max() >= n * m):
        fail("outlier_pos", where, (), "positions not strictly ascending within range", 1, 1)
    if not np.array_equal(np.asarray(p["outlier_val"], np.float32), bits.view(np.float16).astype(np.float32)):
        fail("outlier_val", where, (), "values are not the fp16 of outlier_bits", 1, 1)
    flags, vals = np.zeros(n * m, bool), np.zeros(n * m, np.uint16)
    flags[pos] = True
    vals[pos] = bits
    return flags.reshape(n, m), vals.reshape(n, m)


def same_outliers(a: Dict[str, Any], b: Dict[str, Any], n: int, m: int) -> np.ndarray:
    """Rows whose outliers (positions and fp16 bits) agree, ``[n]`` bool."""
    dense = []
    for p in (a, b):
        v = np.full(n * m, -1, np.int64)
        v[np.asarray(p["outlier_pos"], np.int64)] = np.asarray(p["outlier_bits"]).view(np.uint16)
        dense.append(v.reshape(n, m))
    return (dense[0] == dense[1]).all(1)


def first_difference(got: bytes, want: bytes) -> Optional[int]:
    """Index of the first byte where ``got`` and ``want`` differ (the shorter length when one
    is a prefix of the other); None when they are equal."""
    if got == want:
        return None
    a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
    k = min(a.size, b.size)
    return int(np.argmax(a[:k] != b[:k])) if (a[:k] != b[:k]).any() else k


def fail(field: str, where: str, idx: Tuple[int, ...], detail: str, count: int, total: int) -> NoReturn:
    raise ParityError(
        f"{where}: {field} differs at {count} of {total} values; first at {list(idx)}: {detail}"
    )


# ---------------------------------------------------------------------------------------
# One comparison: near-threshold bookkeeping and the checks both modes make.


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
class CaseResult:
    nears: List[Near]
    compared: Dict[str, int]
    undetermined_values: int  # values whose codes no f32 implementation determines
    undetermined_rows: int  # rows holding such values
    cascaded_rows: int  # rows not compared further after a near-threshold disagreement
    decoded: np.ndarray  # the oracle's decode of its own codes


@dataclasses.dataclass
class Comparison:
    """The comparison of one case: where it is (for messages), the near-threshold
    disagreements found so far, and how many values of each kind were compared."""

    where: str
    nears: List[Near] = dataclasses.field(default_factory=list)
    compared: Dict[str, int] = dataclasses.field(default_factory=dict)

    def fail(self, field: str, idx: Tuple[int, ...], detail: str, count: int, total: int) -> NoReturn:
        fail(field, self.where, idx, detail, count, total)

    def near(self, field: str, idx: Tuple[Any, ...], dist: float, eps: float) -> None:
        self.nears.append(Near(field, self.where, tuple(int(v) for v in idx), float(dist), float(eps)))

    def result(self, undetermined_values: int, undetermined_rows: int, cascaded_rows: int,
               decoded: np.ndarray) -> CaseResult:
        return CaseResult(self.nears, self.compared, int(undetermined_values), int(undetermined_rows),
                          int(cascaded_rows), decoded)

    def exponent(self, field: str, ea: int, eb: int, values: np.ndarray, eps: np.ndarray) -> bool:
        """A shared fp16 exponent: True when both agree; False when they differ by one and the
        maximum of ``values`` lies within ``eps`` of the boundary between them (recorded: then
        nothing after it is comparable); raises ParityError otherwise."""
        if ea == eb:
            return True
        j = int(np.argmax(np.abs(values)))
        bound = 2.0 ** (min(ea, eb) + 15)  # the maximum decides e <= min or > min
        dist = abs(abs(values[j]) - bound)
        if abs(ea - eb) != 1 or dist > eps[j]:
            self.fail(field, (), f"{eb} vs {ea}; max {abs(values[j]):.9g}, boundary {bound:.9g}", 1, 1)
        self.near(field, (j,), dist, eps[j])
        return False

    def stored(self, field: str, bad: np.ndarray, exact: np.ndarray, a: np.ndarray, b: np.ndarray,
               scale: Any, eps: np.ndarray, total: int, detail: Callable[[int], str],
               near_field: Optional[str] = None) -> None:
        """Rows ``bad`` whose stored fp16 values ``a`` (oracle) and ``b`` (ours) differ: each
        must be the rounding of a value within ``eps`` of ``exact`` (:func:`stored_near`)."""
        if not bad.any():
            return
        ok, excess = stored_near(exact, a, b, scale, eps)
        if (bad & ~ok).any():
            first = int(np.flatnonzero(bad & ~ok)[0])
            self.fail(field, (first,), detail(first), int(bad.sum()), total)
        for i in np.flatnonzero(bad):
            self.near(near_field or field, (i,), excess[i], eps[i])

    def indices(self, field: str, ca: np.ndarray, cb: np.ndarray, check: np.ndarray, z: np.ndarray,
                eps: np.ndarray, distance: Callable[[np.ndarray], np.ndarray],
                note: Callable[[int], str] = lambda j: "") -> np.ndarray:
        """Quantiser indices ``[n, m]`` where ``check``: a difference passes only between
        neighbouring indices with ``z`` within ``eps`` of the threshold between them
        (``distance(lower index)``, ``|z - threshold|``). Returns where they differ."""
        self.compared[field] = int(check.sum())
        diff = (ca != cb) & check
        if diff.any():
            dist = distance(np.minimum(ca, cb))
            bad = diff & ~((np.abs(ca - cb) == 1) & (dist <= eps))
            if bad.any():
                i, j = (int(v) for v in np.argwhere(bad)[0])
                self.fail(field, (i, j),
                          f"{cb[i, j]} vs {ca[i, j]}{note(j)}, z = {z[i, j]!r}, {dist[i, j]:.3g} from "
                          f"the threshold (eps {eps[i, j]:.3g})", int(diff.sum()), int(check.sum()))
            for i, j in np.argwhere(diff):
                self.near(field, (i, j), dist[i, j], eps[i, j])
        return diff

    def outliers(self, flags: Tuple[np.ndarray, np.ndarray], values: Tuple[np.ndarray, np.ndarray],
                 check: np.ndarray, z: np.ndarray, eps: np.ndarray, threshold: Optional[float]) -> np.ndarray:
        """Outlier flags (``|z|`` against the threshold) where ``check``, then the fp16 values
        where both flag; ``flags``, ``values``: dense (oracle, ours) of :func:`dense_outliers`.
        Without a threshold there must be none. Returns where flags or values differ."""
        fa, fb = flags
        va, vb = values
        if threshold is None:
            if fb.any():
                self.fail("outlier_pos", (), "outliers without a threshold", int(fb.sum()), fb.size)
            return np.zeros(fa.shape, bool)
        self.compared["outlier_flags"] = int(check.sum())
        dflag = (fa != fb) & check
        dist = np.abs(np.abs(z) - float(np.float32(threshold)))
        bad = dflag & ~(dist <= eps)
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            self.fail("outlier_pos", (i, j), f"flag {fb[i, j]} vs {fa[i, j]}, |z| = {abs(z[i, j])!r}",
                      int(dflag.sum()), int(check.sum()))
        for i, j in np.argwhere(dflag):
            self.near("outlier_flags", (i, j), dist[i, j], eps[i, j])
        both = fa & fb & check
        self.compared["outlier_bits"] = int(both.sum())
        dval = both & (va != vb)
        if dval.any():
            za, zb = va.view(np.float16).astype(np.float64), vb.view(np.float16).astype(np.float64)
            ok, excess = stored_near(z, za, zb, 1.0, eps)
            if (dval & ~ok).any():
                i, j = (int(v) for v in np.argwhere(dval & ~ok)[0])
                self.fail("outlier_bits", (i, j), f"{zb[i, j]!r} vs {za[i, j]!r}, z = {z[i, j]!r}",
                          int(dval.sum()), int(both.sum()))
            for i, j in np.argwhere(dval):
                self.near("outlier_bits", (i, j), excess[i, j], eps[i, j])
        return dflag | dval


# ---------------------------------------------------------------------------------------
# Running a group through an implementation.


@dataclasses.dataclass(frozen=True)
class Mode:
    """What differs between the modes when a group runs: the name of a case, the fields that
    are fp16 roundings (their near-threshold share is ``near_fraction_fp16``), and one function
    per step. ``prep`` is the mode's prepared group (with ``group``, ``x`` and ``rust``, the
    oracle's parts of every case), ``K`` the :mod:`kakeyaturbo.kernels` module (imported by
    :func:`run_kernels`, so that a mode's module needs no triton)."""

    unit: str  # "block" or "head"
    fp16_fields: Tuple[str, ...]
    #: Compares our parts of case i with the oracle's: (prep, i, ours, where) -> CaseResult.
    compare: Callable[[Any, int, Dict[str, Any], str], CaseResult]
    #: d_eff or m of case i.
    size: Callable[[Any, int], int]
    #: The reference's parts (the extension's types) of case i's rows on the device.
    reference_encode: Callable[[Any, int, torch.Tensor], Dict[str, Any]]
    #: The reference's decode of parts of case i, float32 numpy: (prep, i, parts, device).
    reference_decode: Callable[[Any, int, Dict[str, Any], str], np.ndarray]
    #: The oracle's decode of parts of case i, float32 numpy.
    oracle_decode: Callable[[Any, int, Dict[str, Any]], np.ndarray]
    #: The kernels' batch of the group's skeletons or calibrations: (K, prep, device).
    kernel_batch: Callable[[Any, Any, str], Any]
    #: The kernels' encode: (K, x [B, N, D], batch, rows) -> codes.
    kernel_encode: Callable[[Any, torch.Tensor, Any, List[int]], Dict[str, torch.Tensor]]
    #: The kernels' decode: (K, codes, batch, rows, out_dtype, N) -> [B, N, D].
    kernel_decode: Callable[[Any, Dict[str, torch.Tensor], Any, List[int], torch.dtype, int], torch.Tensor]
    #: Batched codes of parts dicts (the oracle's): (K, parts, batch).
    kernel_stack: Callable[[Any, List[Dict[str, Any]], Any], Dict[str, torch.Tensor]]
    #: Case i of batched codes as parts: (K, codes, batch, rows, i, prep).
    kernel_parts: Callable[[Any, Dict[str, torch.Tensor], Any, List[int], int, Any], Dict[str, Any]]


@dataclasses.dataclass
class GroupResult:
    label: str
    impl: str
    fp16_fields: Tuple[str, ...]
    cases: int  # blocks or heads
    rows: int
    nears: List[Near] = dataclasses.field(default_factory=list)
    compared: Dict[str, int] = dataclasses.field(default_factory=dict)
    undetermined_values: int = 0
    undetermined_rows: int = 0
    cascaded_rows: int = 0
    max_decode_error: float = 0.0  # float32 decodes
    sizes: List[int] = dataclasses.field(default_factory=list)  # d_eff or m of every case
    seconds: float = 0.0

    def add(self, case: CaseResult) -> np.ndarray:
        """Merges a case's result; returns the oracle's decode of its own codes."""
        self.nears.extend(case.nears)
        for k, v in case.compared.items():
            self.compared[k] = self.compared.get(k, 0) + v
        self.undetermined_values += case.undetermined_values
        self.undetermined_rows += case.undetermined_rows
        self.cascaded_rows += case.cascaded_rows
        return case.decoded

    def near_violations(self) -> List[str]:
        """Kinds whose near-threshold disagreements exceed their share of the tolerance table
        (at least one is always allowed per kind and group)."""
        out = []
        for field in sorted({nr.field for nr in self.nears}):
            count = sum(nr.field == field for nr in self.nears)
            base = field.split(" ")[0]
            total = self.compared.get(base, self.rows)
            share = TOL["near_fraction_fp16" if base in self.fp16_fields else "near_fraction"]
            if count > max(1.0, share * total):
                out.append(f"{self.label} [{self.impl}] {field}: {count} near-threshold of {total}")
        return out

    def summary(self) -> Dict[str, Any]:
        """A JSON-ready dict (what ``benches/gpu_bench.py`` collects from its workers)."""
        return {
            "label": self.label, "impl": self.impl, "error": None, "blocks": self.cases,
            "compared": self.compared, "nears": [str(n) for n in self.nears],
            "near_violations": self.near_violations(), "undetermined_rows": self.undetermined_rows,
            "cascaded_rows": self.cascaded_rows, "max_decode_error": self.max_decode_error,
            "d_effs": self.sizes, "seconds": self.seconds,
        }


def _start(mode: Mode, prep: Any, impl: str) -> GroupResult:
    return GroupResult(prep.group.label, impl, mode.fp16_fields, len(prep.rust), sum(len(x) for x in prep.x))


def run_reference(mode: Mode, prep: Any, device: str) -> GroupResult:
    """The torch reference, case by case, against the oracle: its codes, its decode of the
    oracle's codes, and its decode of its own codes against the oracle's decoder."""
    t0 = time.perf_counter()
    res = _start(mode, prep, "reference")
    dt = getattr(torch, prep.group.input_dtype)
    for i, (x, rust) in enumerate(zip(prep.x, prep.rust)):
        where = f"{res.label} {mode.unit} {i} [reference]"
        ours = mode.reference_encode(prep, i, torch.from_numpy(x).to(device=device, dtype=dt))
        want = res.add(mode.compare(prep, i, ours, where))
        errs = [
            assert_decoded(mode.reference_decode(prep, i, rust, device), want, TOL["decode_float32"],
                           f"{where}: decode of the oracle's codes"),
            assert_decoded(mode.reference_decode(prep, i, ours, device), mode.oracle_decode(prep, i, ours),
                           TOL["decode_float32"], f"{where}: decode of our codes vs the oracle's decoder"),
        ]
        res.max_decode_error = max([res.max_decode_error] + errs)
        res.sizes.append(mode.size(prep, i))
    res.seconds = time.perf_counter() - t0
    return res


def run_kernels(mode: Mode, prep: Any, device: str, poison: bool = True) -> GroupResult:
    """The Triton kernels, one batched encode and decode for the whole group, every buffer
    they allocate poisoned (NaN / all-ones bits) unless ``poison`` is False: their codes, their
    decode (f32 and bf16) of the oracle's codes, and their decode of their own codes against
    the oracle's decoder."""
    from kakeyaturbo import kernels as K

    t0 = time.perf_counter()
    res = _start(mode, prep, "kernels")
    ns = [len(x) for x in prep.x]
    n = max(ns)
    dt = getattr(torch, prep.group.input_dtype)
    batch = mode.kernel_batch(K, prep, device)
    with K.poison_outputs() if poison else contextlib.nullcontext():
        xt = torch.from_numpy(padded(prep.x, prep.group.d)).to(device=device, dtype=dt)
        codes = mode.kernel_encode(K, xt, batch, ns)
        dec_ours = mode.kernel_decode(K, codes, batch, ns, torch.float32, n).cpu().numpy()
        rcodes = mode.kernel_stack(K, prep.rust, batch)
        dec_rust = mode.kernel_decode(K, rcodes, batch, ns, torch.float32, n).cpu().numpy()
        dec_rust16 = mode.kernel_decode(K, rcodes, batch, ns, torch.bfloat16, n).float().cpu().numpy()
    for i in range(len(ns)):
        where = f"{res.label} {mode.unit} {i} [kernels]"
        ours = mode.kernel_parts(K, codes, batch, ns, i, prep)
        want = res.add(mode.compare(prep, i, ours, where))
        m = ns[i]
        assert_decoded(dec_rust16[i, :m], want, TOL["decode_bfloat16"],
                       f"{where}: bf16 decode of the oracle's codes")
        errs = [
            assert_decoded(dec_rust[i, :m], want, TOL["decode_float32"],
                           f"{where}: decode of the oracle's codes"),
            assert_decoded(dec_ours[i, :m], mode.oracle_decode(prep, i, ours), TOL["decode_float32"],
                           f"{where}: decode of our codes vs the oracle's decoder"),
        ]
        res.max_decode_error = max([res.max_decode_error] + errs)
        res.sizes.append(mode.size(prep, i))
    res.seconds = time.perf_counter() - t0
    return res


def run_all(mode: Mode, prepare: Callable[[Any], Any], groups: Sequence[Any], device: str,
            impls: Sequence[str] = ("reference", "kernels")) -> List[GroupResult]:
    """Runs every group through every implementation; raises ParityError on the first failure."""
    out = []
    for group in groups:
        prep = prepare(group)
        for impl in impls:
            run = run_reference if impl == "reference" else run_kernels
            out.append(run(mode, prep, device))
    return out
