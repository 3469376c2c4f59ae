"""A closed-loop correction of the measured sensitivity, on calibration text only: the recipe's
codecs fitted as ``eval`` fits them (the mixture's pooled statistics and sensitivity), then,
per (stream, layer), the model's **measured** loss when only that stream of that layer is coded
(mean KL of the next-token distributions from the uncompressed ones, on windows of the
calibration split) against the loss the sensitivity **predicts** for it (``tr(F E) / 2``, ``E``
the second moment of the decoding error of the calibration's sampled rows). The sensitivity of
every (stream, layer) is then multiplied by its ratio (normalised to a geometric mean of 1, so
only the allocation between them moves) and written as a sensitivity file with a recipe that
names it; ``eval`` / ``bench_domains.py --recipes OUT/RECIPE.toml`` measures it. With
``--groups G`` runs of consecutive layers are coded together (G groups, each stream apart) and
every layer of a group gets the group's ratio (its printed "measured" KL is the group's, shared
in proportion to the predicted losses).

    .venv/bin/python benches/refine_sensitivity.py --recipes calibrated-3bit \
        --windows 16 --n-eval 64 --out bench-out/refine3

The second-order prediction is what the water-filling trusts; where the model's loss grows
faster than it (peaked attention, where a score error moves a large share of the weight), the
ratio says so. Windows: the mixture's calibration split, never the evaluation split.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import List

import numpy as np

from kakeyaturbo import assets, recipes
from kakeyaturbo.calibration import corpus, gather
from kakeyaturbo.calibration.stats import Sensitivity
from kakeyaturbo.eval import harness
from kakeyaturbo.eval import model as model_mod


def predicted(mc, stats, sens) -> np.ndarray:
    """``[stream, layer]`` of ``tr(F E) / 2`` summed over kv-heads, on the statistics' rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from domain_error import predicted as per_domain

    return per_domain(mc, [("pooled", 0, stats, sens)])["pooled"].sum(axis=2)


def main(argv: "List[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file, or 'hard-case'")
    ap.add_argument("--recipes", default="calibrated-3bit", help="one recipe name or file")
    ap.add_argument("--windows", type=int, default=16, help="calibration windows scored")
    ap.add_argument("--n-eval", type=int, default=64, help="tokens scored per window")
    ap.add_argument("--text", help="score windows of this text's calibration split instead of the "
                    "recipe's calibration corpus (a domain of the mixture, say)")
    ap.add_argument("--groups", type=int, default=0,
                    help="measure runs of consecutive layers together, this many groups (0: every "
                         "layer on its own)")
    ap.add_argument("--power", type=float, default=1.0,
                    help="the ratio's exponent (1: the full correction)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    path = (assets.hard_case_model() if args.model == "hard-case"
            else Path(args.model or assets.default_model()))
    model, tok = model_mod.load(path, "float32")
    rec = recipes.load(args.recipes)
    stats, sens = gather.for_recipe(rec, model, tok, path)
    L = stats.num_layers
    base = harness.codec_method(rec, L, stats=stats, sensitivity=sens)
    pred = predicted(base.codec, stats, sens)
    n_groups = args.groups if 0 < args.groups < L else L
    edges = np.linspace(0, L, n_groups + 1).round().astype(int)
    groups = [range(a, b) for a, b in zip(edges[:-1], edges[1:])]
    methods = []
    for s in ("k", "v"):
        for gi, g in enumerate(groups):
            others = sorted(set(range(L)) - set(g) | set(base.boundary))
            methods.append(replace(base, name=f"{s}{gi}", streams=(s,), boundary=others))
    win = rec.calibration.window
    wins = corpus.calibration_windows(tok, args.text or rec.calibration.corpus, args.windows, win)
    ctx = win - args.n_eval - 1
    try:
        from tqdm import tqdm
        prog = lambda it: tqdm(it, desc="calibration windows", file=sys.stderr)  # noqa: E731
    except ImportError:  # pragma: no cover
        prog = lambda it: it  # noqa: E731
    res = harness.evaluate(model, wins, ctx, methods, progress=prog)
    group_kl = np.array([[res[f"{s}{gi}"]["kl"] for gi in range(len(groups))] for s in ("k", "v")])
    # A group's measured loss shared over its layers in proportion to their predicted losses, so
    # that every layer of a group gets the group's ratio.
    meas = np.zeros_like(pred)
    for gi, g in enumerate(groups):
        share = pred[:, g] / np.maximum(pred[:, g].sum(axis=1, keepdims=True), 1e-30)
        meas[:, g] = group_kl[:, gi:gi + 1] * share
    coded = pred > 0  # a stream a recipe leaves uncoded keeps its sensitivity
    ratio = np.ones_like(pred)
    ratio[coded] = (np.maximum(meas[coded], 1e-12) / pred[coded]) ** args.power
    ratio[coded] /= np.exp(np.mean(np.log(ratio[coded])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    k = sens.k * ratio[0][:, None, None, None]
    v = sens.v * ratio[1][:, None, None, None]
    meta = dict(sens.meta, refined={"recipe": rec.name, "windows": len(wins), "n_eval": args.n_eval,
                                    "power": args.power, "groups": n_groups})
    Sensitivity(meta=meta, k=k, v=v).save(out / "sensitivity.safetensors")
    src = (Path(args.recipes) if args.recipes.endswith(".toml")
           else Path(recipes.__file__).parent / f"{rec.name}.toml").read_text()
    name = f"{rec.name}-refined"
    src = re.sub(r'^name = ".*"', f'name = "{name}"', src, count=1, flags=re.M)
    src = re.sub(r'^description = ".*"',
                 f'description = "{rec.name} with its sensitivity corrected per (stream, layer) by '
                 f'the measured over the predicted loss on calibration windows '
                 f'(benches/refine_sensitivity.py)"', src, count=1, flags=re.M)
    src = src.replace("[calibration]\n",
                      '[calibration]\nsensitivity_path = "sensitivity.safetensors"\n', 1)
    (out / f"{name}.toml").write_text(src)
    print(f"{path.name} | {rec.name} | {len(wins)} calibration windows, ctx {ctx}, "
          f"n_eval {args.n_eval}")
    print("| layer | K measured KL | K predicted | K ratio | V measured KL | V predicted | V ratio |")
    print("|---|---|---|---|---|---|---|")
    for layer in range(L):
        print(f"| {layer} | {meas[0, layer]:.5f} | {pred[0, layer]:.4f} | {ratio[0, layer]:.2f} | "
              f"{meas[1, layer]:.5f} | {pred[1, layer]:.4f} | {ratio[1, layer]:.2f} |")
    (out / "refine.json").write_text(json.dumps({
        "model": path.name, "recipe": rec.name, "windows": len(wins), "ctx": ctx,
        "text": args.text or rec.calibration.corpus, "groups": n_groups,
        "measured_kl": meas.tolist(), "predicted": pred.tolist(), "ratio": ratio.tolist()},
        indent=1))
    print(f"wrote {out / (name + '.toml')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
