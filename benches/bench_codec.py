"""Codec throughput, bits and error beside a naive numpy TurboQuant-style quantiser, one run.

    python benches/bench_codec.py [--repeats 7] [--json bench-out/bench_codec.json] [--quick]

Workloads: float32 [4096, 128] and [4096, 64] KV-like tensors (seeded): a spectrum decaying as
0.97^j in a random orthonormal basis, a per-channel offset, and two channels 10x and 25x
larger than the rest (the outlier channels attention keys have). Settings: the predecessor's
production K recipe (b = 3, randomized PCA rank D/2, k = 16, outliers T = 2.0, inner_product)
and V recipe (b = 2, share_basis, mse). Baseline: dense random orthogonal rotation, fp16 norm,
`searchsorted` against the N(0,1) Lloyd-Max thresholds (b = 3 for K, b = 2 for V), with BLAS
limited to one thread. Medians over `repeats` runs after one warm-up. Reports, never fails.
"""

from __future__ import annotations

import os

# The baseline is timed on one core; set before numpy loads its BLAS.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List  # noqa: E402

import numpy as np  # noqa: E402

import kakeyaturbo as kt  # noqa: E402

N = 4096
TARGET_ROUNDTRIP_MS = 20.0
TARGET_SPEEDUP = 10.0


def workload(d: int, seed: int = 0) -> np.ndarray:
    """The KV-like tensor described in the module docstring."""
    g = np.random.default_rng(seed + d)
    basis, _ = np.linalg.qr(g.standard_normal((d, d)))
    x = (g.standard_normal((N, d)) * 0.97 ** np.arange(d)) @ basis.T
    x += g.standard_normal(d) * 0.3
    x[:, 1] *= 10.0
    x[:, d // 3] *= 25.0
    return x.astype(np.float32)


def settings(d: int) -> Dict[str, Dict[str, Any]]:
    return {
        "K": dict(bit_width=3, pca_method="randomized", rsvd_target_rank=d // 2, k=16,
                  outlier_threshold=2.0, metric="inner_product"),
        "V": dict(bit_width=2, share_basis=True, metric="mse"),
    }


def median_of(fn: Callable[[], Dict[str, float]], repeats: int) -> Dict[str, float]:
    fn()  # warm-up: thread pools, page faults
    runs = [fn() for _ in range(repeats)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def codec_run(x: np.ndarray, kw: Dict[str, Any], threads: int) -> Dict[str, float]:
    _, r = kt.roundtrip_layer(x, threads=threads, **kw)
    return {k: float(r[k]) for k in ("encode_seconds", "decode_seconds", "code_seconds",
                                     "bits_per_element", "ratio_vs_bf16", "relative_error")}


class TurboQuantNumpy:
    """The naive baseline: y = R x / |x| * sqrt(D), indices by searchsorted, fp16 norm."""

    def __init__(self, d: int, bits: int, seed: int = 1):
        self.rot, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
        self.rot = self.rot.astype(np.float32)
        self.table = kt.centroids_gaussian(bits)
        self.thresholds = (self.table[1:] + self.table[:-1]) / 2
        self.bits, self.d = bits, d

    def encode(self, x: np.ndarray):
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        y = (x @ self.rot.T) * (np.sqrt(self.d) / np.maximum(norm, 1e-30))
        return np.searchsorted(self.thresholds, y).astype(np.uint8), norm.astype(np.float16)

    def decode(self, idx: np.ndarray, norm: np.ndarray) -> np.ndarray:
        y = self.table[idx] * (norm.astype(np.float32) / np.sqrt(self.d))
        return y @ self.rot


def baseline_run(x: np.ndarray, bits: int) -> Dict[str, float]:
    tq = TurboQuantNumpy(x.shape[1], bits)
    t0 = time.perf_counter()
    idx, norm = tq.encode(x)
    t1 = time.perf_counter()
    y = tq.decode(idx, norm)
    t2 = time.perf_counter()
    return {"encode_seconds": t1 - t0, "decode_seconds": t2 - t1,
            "bits_per_element": bits + 16 / x.shape[1],
            "relative_error": float(np.linalg.norm(x - y) / np.linalg.norm(x))}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(repeats: int) -> Dict[str, Any]:
    rows: List[Dict[str, Any]] = []
    checks: List[Dict[str, Any]] = []
    for d in (128, 64):
        x = workload(d)
        for name, kw in settings(d).items():
            bits = kw["bit_width"]
            base = median_of(lambda: baseline_run(x, bits), repeats)
            per_thread = {t: median_of(lambda: codec_run(x, kw, t), repeats) for t in (1, 2)}
            for t, m in per_thread.items():
                rows.append({
                    "shape": f"{N}x{d}", "setting": name, "impl": "kakeyaturbo", "threads": t,
                    "encode_vps": N / m["encode_seconds"], "decode_vps": N / m["decode_seconds"],
                    "stages25_encode_vps": N / m["code_seconds"] if t == 1 else None,
                    "roundtrip_ms": 1e3 * (m["encode_seconds"] + m["decode_seconds"]),
                    "bits_per_element": m["bits_per_element"], "relative_error": m["relative_error"],
                })
            rows.append({
                "shape": f"{N}x{d}", "setting": name, "impl": f"numpy TurboQuant b={bits}",
                "threads": 1, "encode_vps": N / base["encode_seconds"],
                "decode_vps": N / base["decode_seconds"], "stages25_encode_vps": None,
                "roundtrip_ms": 1e3 * (base["encode_seconds"] + base["decode_seconds"]),
                "bits_per_element": base["bits_per_element"],
                "relative_error": base["relative_error"],
            })
            one = per_thread[1]
            enc_x = (N / one["code_seconds"]) / (N / base["encode_seconds"])
            dec_x = (N / one["decode_seconds"]) / (N / base["decode_seconds"])
            checks.append({"target": f"{N}x{d} {name}: stages 2-5 encode >= 10x baseline",
                           "value": enc_x, "goal": TARGET_SPEEDUP, "pass": enc_x >= TARGET_SPEEDUP})
            checks.append({"target": f"{N}x{d} {name}: decode >= 10x baseline",
                           "value": dec_x, "goal": TARGET_SPEEDUP, "pass": dec_x >= TARGET_SPEEDUP})
            if d == 128 and name == "K":
                ms = 1e3 * (per_thread[2]["encode_seconds"] + per_thread[2]["decode_seconds"])
                checks.append({"target": "4096x128 K round trip at 2 threads <= 20 ms (ms)",
                               "value": ms, "goal": TARGET_ROUNDTRIP_MS,
                               "pass": ms <= TARGET_ROUNDTRIP_MS})
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(), "nproc": os.cpu_count(), "numpy": np.__version__,
        "kakeyaturbo": kt.__version__, "repeats": repeats, "rows": rows, "checks": checks,
    }


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def markdown(res: Dict[str, Any]) -> str:
    cols = ["shape", "setting", "impl", "threads", "encode_vps", "stages25_encode_vps",
            "decode_vps", "roundtrip_ms", "bits_per_element", "relative_error"]
    out = [f"{res['date']} | {res['cpu']} | {res['nproc']} cores | numpy {res['numpy']} "
           f"(BLAS 1 thread) | kakeyaturbo {res['kakeyaturbo']} | median of {res['repeats']}", "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in res["rows"]]
    out += ["", "| target | measured | goal | verdict |", "|---|---|---|---|"]
    out += [f"| {c['target']} | {c['value']:.3g} | {c['goal']:g} | "
            f"{'PASS' if c['pass'] else 'MISS'} |" for c in res["checks"]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default="bench-out/bench_codec.json")
    ap.add_argument("--quick", action="store_true", help="2 repeats, for a smoke test")
    args = ap.parse_args()
    res = run(2 if args.quick else args.repeats)
    print(markdown(res))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
