"""What each `metric` changes, measured: error of q . k, MSE and max |error| per metric.

    python benches/bench_metrics.py [--json PATH]

Keys are synthetic and KV-like (a decaying spectrum 0.93^j in a random basis, a shared offset
and one channel 8x larger, D = 128, N = 4096); queries are drawn isotropic and anisotropic
(spectrum 0.95^j in the keys' basis). Real keys and queries come with the model evaluation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import kakeyaturbo as kt


def keys_and_queries(n: int = 4096, d: int = 128, seed: int = 0):
    g = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(g.standard_normal((d, d)))
    k = (g.standard_normal((n, d)) * 0.93 ** (np.arange(d) / 2)) @ basis.T + 0.5
    k[:, 5] *= 8.0
    q_iso = g.standard_normal((512, d))
    q_aniso = (g.standard_normal((512, d)) * 0.95 ** (np.arange(d) / 2)) @ basis.T
    return k.astype(np.float32), {"isotropic": q_iso, "anisotropic": q_aniso}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench-out/bench_metrics.json")
    args = ap.parse_args()
    k, queries = keys_and_queries()
    rows = []
    for bits in (2, 3, 4):
        for metric in ("mse", "inner_product", "linf"):
            y, r = kt.roundtrip_layer(k, bit_width=bits, metric=metric)
            err = k.astype(np.float64) - y
            row = {"bits": bits, "metric": metric, "bits_per_element": r["bits_per_element"],
                   "mse": r["mse"], "max_abs_error": r["max_abs_error"]}
            for name, q in queries.items():
                row[f"qk_mse_{name}"] = float(np.mean((err @ q.T) ** 2))
            rows.append(row)
    cols = ["bits", "metric", "bits_per_element", "mse", "max_abs_error",
            "qk_mse_isotropic", "qk_mse_anisotropic"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c])
                                for c in cols) + " |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
