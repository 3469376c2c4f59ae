"""Codec throughput, bits and error beside a naive numpy TurboQuant-style quantiser, in one run.

    python benches/bench_codec.py [--repeats 7] [--json bench-out/bench_codec.json] [--quick]

Workloads: float32 [4096, 128] and [4096, 64], from ``numpy.random.default_rng(SEED + D)``:
``x = (z * s) @ B.T + noise + bias``, where ``z`` is [N, D/2] standard normal, ``s_j =
exp(-3 j / (D/2))`` (a decaying spectrum: 95 % of the variance in about D/4 directions), ``B``
a random orthonormal [D, D/2] basis, ``noise`` isotropic N(0, 0.05^2) and ``bias`` a
per-channel N(0, 0.3^2) offset. Channels 1 and D/3 are then made outliers, the way attention
keys have a few large-magnitude channels: scaled 3x and shifted by +4 and -6 (about 15-20x a
typical channel's spread). The same tensor serves the K and the V settings.

Settings: the predecessor's production K recipe (bit_width 3, randomized PCA with target rank
D/2, k = 16, outlier_threshold 2.0, inner_product) and V recipe (bit_width 2, share_basis, mse).
Each (workload, setting, threads in {1, 2}) runs once to warm up, then ``repeats`` times; every
time is the median over the repeats. ``stages25_encode_vps`` = N / code_seconds, which sums
per-block thread time, so it is reported from the threads=1 runs only.

Baseline: dense random orthogonal rotation (QR of a Gaussian D x D, fixed seed), fp16 norm per
vector, unit vectors scaled by sqrt(D) and quantised by ``searchsorted`` against the midpoints of
``centroids_gaussian(b)`` (b = 3 beside K, b = 2 beside V); decode is the centroid lookup,
/ sqrt(D), the transposed rotation, times the norm. BLAS is held to one thread for it
(threadpoolctl when installed, else *_NUM_THREADS=1 set before numpy loads). The script
reports: it exits 0 when a target is missed and non-zero only on an exception.
"""

from __future__ import annotations

import importlib.util
import os

# The baseline must be timed on one core; the env route only works before numpy loads its BLAS.
HAVE_THREADPOOLCTL = importlib.util.find_spec("threadpoolctl") is not None
if not HAVE_THREADPOOLCTL:
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple  # noqa: E402

import numpy as np  # noqa: E402

import kakeyaturbo as kt  # noqa: E402

N = 4096
DIMS = (128, 64)
THREADS = (1, 2)
SEED = 20240
TARGET_ROUNDTRIP_MS = 20.0
TARGET_SPEEDUP = 10.0
Timings = Dict[str, float]


def workload(d: int) -> np.ndarray:
    """The KV-like [N, d] float32 tensor described in the module docstring."""
    g = np.random.default_rng(SEED + d)
    r = d // 2
    basis, _ = np.linalg.qr(g.standard_normal((d, r)))
    x = (g.standard_normal((N, r)) * np.exp(-3.0 * np.arange(r) / r)) @ basis.T
    x += 0.05 * g.standard_normal((N, d)) + 0.3 * g.standard_normal(d)
    # Mostly offset, little extra variance: a 25x-variance channel would swallow PCA's budget.
    for c, shift in ((1, 4.0), (d // 3, -6.0)):
        x[:, c] = 3.0 * x[:, c] + shift
    return x.astype(np.float32)


def settings(d: int) -> Dict[str, Dict[str, Any]]:
    """The predecessor's production K and V codec keyword arguments for head dimension d."""
    return {
        "K": dict(bit_width=3, pca_method="randomized", rsvd_target_rank=d // 2, k=16,
                  outlier_threshold=2.0, metric="inner_product"),
        "V": dict(bit_width=2, share_basis=True, metric="mse"),
    }


def median_of(fn: Callable[[], Timings], repeats: int) -> Timings:
    """One warm-up call (thread pool start, page faults), then the per-key median of repeats."""
    fn()
    runs = [fn() for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def codec_run(x: np.ndarray, kw: Dict[str, Any], threads: int) -> Timings:
    """One roundtrip_layer call: the report's times, size and error, plus the Python wall time."""
    t0 = time.perf_counter()
    _, rep = kt.roundtrip_layer(x, threads=threads, **kw)
    wall = time.perf_counter() - t0
    keys = ("encode_seconds", "decode_seconds", "fit_seconds", "code_seconds",
            "bits_per_element", "ratio_vs_bf16", "relative_error")
    # d_eff (mean kept PCA rank) explains most of the speed and bits, so it goes in the table.
    return {**{k: float(rep[k]) for k in keys}, "wall_seconds": wall,
            "d_eff": float(np.mean(rep["d_eff"]))}


class TurboQuantNumpy:
    """The naive baseline quantiser: dense rotation, searchsorted, fp16 norm per vector."""

    def __init__(self, d: int, bits: int, seed: int = 1) -> None:
        """Draws the rotation and the Lloyd-Max table once, outside any timing."""
        q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
        self.rot = np.ascontiguousarray(q.T, dtype=np.float32)  # x @ rot == (Q x) per row
        self.table = np.asarray(kt.centroids_gaussian(bits), dtype=np.float32)
        self.thresholds = (self.table[1:] + self.table[:-1]) / 2
        self.scale = np.float32(np.sqrt(d))

    def encode(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Indices [N, D] uint8 and fp16 norms [N, 1]."""
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        y = (x @ self.rot) * (self.scale / np.maximum(norm, np.float32(1e-30)))
        return np.searchsorted(self.thresholds, y).astype(np.uint8), norm.astype(np.float16)

    def decode(self, idx: np.ndarray, norm: np.ndarray) -> np.ndarray:
        """Centroid lookup, / sqrt(D), unrotate, times the stored norm."""
        y = (self.table[idx] / self.scale) @ self.rot.T
        return y * norm.astype(np.float32)


def one_blas_thread() -> ContextManager[Any]:
    """Limits BLAS to one thread for the baseline (a no-op when the env route already did)."""
    if HAVE_THREADPOOLCTL:
        from threadpoolctl import threadpool_limits
        return threadpool_limits(limits=1)
    return contextlib.nullcontext()


def baseline_run(tq: TurboQuantNumpy, x: np.ndarray, bits: int) -> Timings:
    """One encode and decode of the baseline, timed separately."""
    t0 = time.perf_counter()
    idx, norm = tq.encode(x)
    t1 = time.perf_counter()
    y = tq.decode(idx, norm)
    t2 = time.perf_counter()
    n, d = x.shape
    return {"encode_seconds": t1 - t0, "decode_seconds": t2 - t1,
            "bits_per_element": (n * d * bits + n * 16) / (n * d),
            "relative_error": float(np.linalg.norm(x - y) / np.linalg.norm(x))}


def cpu_model() -> str:
    """The first 'model name' of /proc/cpuinfo, or what platform knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def load_average() -> str:
    """The 1-minute load average at the start; other work on the cores skews threads=2."""
    with contextlib.suppress(OSError, IndexError):
        return Path("/proc/loadavg").read_text().split()[0]
    return "unknown"


def row(shape: str, setting: str, impl: str, threads: int, m: Timings,
        stages25: Optional[float]) -> Dict[str, Any]:
    """One table row from median timings."""
    return {"shape": shape, "setting": setting, "impl": impl, "threads": threads,
            "encode_vps": N / m["encode_seconds"], "stages25_encode_vps": stages25,
            "decode_vps": N / m["decode_seconds"],
            "roundtrip_ms": 1e3 * (m["encode_seconds"] + m["decode_seconds"]),
            "d_eff": m.get("d_eff", float(shape.split("x")[1])),
            "bits_per_element": m["bits_per_element"],
            "ratio_vs_bf16": m.get("ratio_vs_bf16", 16.0 / m["bits_per_element"]),
            "relative_error": m["relative_error"], "medians": m}


def check(target: str, value: float, goal: float, higher_is_better: bool) -> Dict[str, Any]:
    """A PASS/MISS verdict; margin is value/goal (>= 1 passes) or goal/value for limits."""
    margin = value / goal if higher_is_better else goal / value
    return {"target": target, "value": value, "op": ">=" if higher_is_better else "<=",
            "goal": goal, "margin": margin, "pass": margin >= 1.0}


def run(repeats: int) -> Dict[str, Any]:
    """Every workload x setting x thread count, the baselines, and the target checks."""
    load = load_average()
    rows: List[Dict[str, Any]] = []
    checks: List[Dict[str, Any]] = []
    for d in DIMS:
        x, shape = workload(d), f"{N}x{d}"
        for name, kw in settings(d).items():
            bits = kw["bit_width"]
            tq = TurboQuantNumpy(d, bits)
            with one_blas_thread():
                base = median_of(lambda: baseline_run(tq, x, bits), repeats)
            codec = {t: median_of(lambda: codec_run(x, kw, t), repeats) for t in THREADS}
            s25 = N / codec[1]["code_seconds"]
            for t, m in codec.items():
                rows.append(row(shape, name, "kakeyaturbo", t, m, s25 if t == 1 else None))
            rows.append(row(shape, name, f"numpy TurboQuant b={bits}", 1, base, None))
            base_enc, base_dec = N / base["encode_seconds"], N / base["decode_seconds"]
            checks.append(check(f"{shape} {name}: stages 2-5 encode vps (1 thr) / baseline",
                                s25 / base_enc, TARGET_SPEEDUP, True))
            checks.append(check(f"{shape} {name}: decode vps (1 thr) / baseline",
                                (N / codec[1]["decode_seconds"]) / base_dec, TARGET_SPEEDUP, True))
            if d == 128 and name == "K":
                ms = 1e3 * (codec[2]["encode_seconds"] + codec[2]["decode_seconds"])
                checks.insert(0, check(f"{shape} K round trip at 2 threads (ms)",
                                       ms, TARGET_ROUNDTRIP_MS, False))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(), "nproc": os.cpu_count(), "loadavg_1min": load, "numpy": np.__version__,
        "kakeyaturbo": kt.__version__, "repeats": repeats,
        "blas_limit": "threadpoolctl" if HAVE_THREADPOOLCTL else "*_NUM_THREADS=1",
        "rows": rows, "checks": checks,
    }


def fmt(v: Any) -> str:
    """Thousands separators for rates, 3 significant digits otherwise."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def markdown(res: Dict[str, Any]) -> str:
    """The header line, the results table and the targets table."""
    cols = ["shape", "setting", "impl", "threads", "encode_vps", "stages25_encode_vps",
            "decode_vps", "roundtrip_ms", "d_eff", "bits_per_element", "ratio_vs_bf16",
            "relative_error"]
    out = [f"{res['date']} | CPU {res['cpu']} | nproc {res['nproc']} (load {res['loadavg_1min']})"
           f" | numpy {res['numpy']} "
           f"(baseline BLAS 1 thread via {res['blas_limit']}) | kakeyaturbo {res['kakeyaturbo']}"
           f" | median of {res['repeats']} after 1 warm-up", "",
           "stages25_encode_vps: N / code_seconds from the threads=1 runs (code_seconds sums "
           "thread time); d_eff: mean PCA rank kept per block (D for the baseline).", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in res["rows"]]
    out += ["", "| target | measured | goal | margin | verdict |", "|---|---|---|---|---|"]
    out += [f"| {c['target']} | {c['value']:.3g} | {c['op']} "
            f"{c['goal']:g} | {c['margin']:.2f}x | {'PASS' if c['pass'] else 'MISS'} |"
            for c in res["checks"]]
    return "\n".join(out)


def main() -> None:
    """Parses the arguments, runs, prints the tables and writes the JSON."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per case (default 7)")
    ap.add_argument("--json", default="bench-out/bench_codec.json", help="where the JSON goes")
    ap.add_argument("--quick", action="store_true", help="repeats = 2, for a smoke test")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    res = run(2 if args.quick else args.repeats)
    print(markdown(res))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nJSON: {path}")


if __name__ == "__main__":
    main()
