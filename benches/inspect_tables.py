"""What a recipe's fitted Lloyd-Max tables (``tables = "calibrated"``) are, against the N(0, 1)
tables they replace: per stream and bit width, how many components of the model use that width
and the fitted table's outermost and two innermost centroids beside the Gaussian's. Builds the
model's codecs from the cached calibration (collected first when missing, as ``eval`` does).

    .venv/bin/python benches/inspect_tables.py [--model hard-case] \
        --recipes benches/recipes/calibrated-4bit-ctables.toml[,...]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List

import numpy as np

from kakeyaturbo import assets, centroids_gaussian, recipes
from kakeyaturbo.calibration import gather, model_codec
from kakeyaturbo.eval import model as model_mod


def main(argv: "List[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file, or 'hard-case'")
    ap.add_argument("--recipes", required=True, help="comma-separated recipe names or files")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    path = (assets.hard_case_model() if args.model == "hard-case"
            else Path(args.model or assets.default_model()))
    model, tok = model_mod.load(path, args.dtype)
    print(f"{path.name}\n")
    print("| recipe | stream | bits | components | fitted min / max | N(0,1) max | fitted inner pair "
          "| N(0,1) inner pair |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.recipes.split(","):
        rec = recipes.load(name)
        st = gather.cached_stats(model, tok, path, None, rec.calibration)
        sens = (gather.cached_sensitivity(model, tok, path, None, rec.calibration)
                if rec.needs_sensitivity else None)
        mc = model_codec.ModelCodec(st, rec, sensitivity=sens)
        for s in ("k", "v"):
            count: dict = {}
            for key, c in mc.codecs.items():
                if key[0] == s:
                    for _, width, b in c.bands:
                        count[int(b)] = count.get(int(b), 0) + int(width)
            for b in sorted(count):
                g = np.asarray(centroids_gaussian(b))
                t = mc.tables.get(s, {}).get(b)
                mid = len(g) // 2
                fitted = ("-" if t is None else f"{t.min():+.3f} / {t.max():+.3f}")
                inner = ("-" if t is None or len(t) < 2
                         else f"{t[mid - 1]:+.3f}, {t[mid]:+.3f}")
                print(f"| {rec.name} | {s} | {b} | {count[b]} | {fitted} | {g.max():.3f} | {inner} "
                      f"| {g[mid - 1]:+.3f}, {g[mid]:+.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
