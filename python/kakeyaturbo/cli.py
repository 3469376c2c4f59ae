"""`kakeyaturbo eval` and `kakeyaturbo calibrate`: the EVAL.md protocol on a causal LM and a
text, with baselines; the calibration statistics of the calibrated mode."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from . import assets, recipes
from .calibration import (calibration_windows, collect, collect_sensitivity, for_recipe,
                          sensitivity_path, stats_path)
from .eval import data, model, report

DEFAULT_BASELINES = "identity,bf16,fp8_e4m3,int4,kivi2,turboquant3,turboquant4"
DEFAULT_RECIPES = "calibrated-4bit,calibrated-3bit,balanced,max-compression,predecessor"


def _model_and_text(args: argparse.Namespace) -> Tuple[Path, Path]:
    if args.model == "hard-case":
        model_path = assets.hard_case_model()
    else:
        model_path = Path(args.model) if args.model else assets.default_model()
    text_path = Path(args.text) if args.text else assets.default_text()
    return model_path, text_path


def _progress(desc: str) -> Any:
    from tqdm import tqdm

    return lambda it: tqdm(it, desc=desc, file=sys.stderr)


def _eval(args: argparse.Namespace) -> int:
    from .eval import harness  # torch

    model_path, text_path = _model_and_text(args)
    print(f"model {model_path}\ntext  {text_path} (evaluation split)", file=sys.stderr)
    m, tok = model.load(model_path)
    wins = data.evaluation_windows(tok, text_path, args.windows, args.ctx + args.n_eval + 1)
    if len(wins) < args.windows:
        print(f"text holds only {len(wins)} windows", file=sys.stderr)
    layers = m.config.num_hidden_layers
    methods = harness.baseline_methods([b for b in args.baselines.split(",") if b])
    calibrations: Dict[Any, Any] = {}  # recipes with the same calibration settings share it
    for name in (r for r in args.recipes.split(",") if r):
        rec = recipes.load(name)
        key = (rec.calibration, max(rec.n_sink, 1), rec.needs_sensitivity)
        if rec.mode == "calibrated" and key not in calibrations:
            calibrations[key] = for_recipe(rec, m, tok, model_path, text_path,
                                                  progress=_progress)
        stats, sens = calibrations.get(key, (None, None))
        methods.append(harness.codec_method(rec, layers, stats=stats, sensitivity=sens))
        if args.attribute:
            methods += harness.attribution_methods(methods[-1], layers, args.attribute)
    res_methods = harness.evaluate(m, wins, args.ctx, methods, progress=_progress("windows"))
    any_m = next(iter(res_methods.values()))
    res = {
        "meta": {"model": model_path.name, "text": text_path.name, "windows": len(wins),
                 "ctx": args.ctx, "n_eval": args.n_eval, "ppl_ref": any_m["ppl_ref"],
                 "date": datetime.date.today().isoformat(), "layers": layers},
        "methods": res_methods,
    }
    paths = report.write(res, Path(args.out))
    print(report.markdown(res))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    model_path, text_path = _model_and_text(args)
    print(f"model {model_path}\ntext  {text_path} (calibration split)", file=sys.stderr)
    m, tok = model.load(model_path)
    settings = recipes.CalibrationSettings(
        windows=args.windows, window=args.window, weighting=args.weighting,
        sensitivity_windows=max(args.sensitivity_windows, 1), score=args.score).checked()
    meta = {"model": model_path.name, "text": text_path.name, "split": "calibration"}
    wins = calibration_windows(tok, text_path, args.windows, args.window)
    stats = collect(m, wins, n_sink=args.n_sink, weighting=args.weighting,
                            samples=args.samples, progress=_progress("calibration"), meta=meta)
    out = Path(args.out) if args.out else stats_path(model_path, text_path, settings)
    for p in stats.save(out):
        print(f"wrote {p}", file=sys.stderr)
    if args.sensitivity_windows > 0:
        wins = calibration_windows(tok, text_path, args.sensitivity_windows, args.window)
        sens = collect_sensitivity(m, wins, n_sink=args.n_sink, score=args.score,
                                           progress=_progress("sensitivity"), meta=meta)
        sout = (out.with_name(out.stem + "-sensitivity.safetensors") if args.out else
                sensitivity_path(model_path, text_path, settings, args.n_sink))
        for p in sens.save(sout):
            print(f"wrote {p}", file=sys.stderr)
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line: ``kakeyaturbo eval`` and ``kakeyaturbo calibrate``."""
    ap = argparse.ArgumentParser(prog="kakeyaturbo")
    sub = ap.add_subparsers(dest="command", required=True)
    model_help = ("a model directory or GGUF file, or 'hard-case' for EVAL.md's Qwen2.5 0.5B "
                  "(default: the embedded SmolLM2-135M)")
    text_help = "a UTF-8 text or the wiki JSON (default: the embedded Wikipedia summaries)"
    e = sub.add_parser("eval", help="perplexity, top-1 and KL of the codec and baselines on a model")
    e.add_argument("--model", help=model_help)
    e.add_argument("--text", help=text_help)
    e.add_argument("--windows", type=int, default=4)
    e.add_argument("--ctx", type=int, default=512)
    e.add_argument("--n-eval", type=int, default=64)
    e.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma-separated recipe names or files")
    e.add_argument("--baselines", default=DEFAULT_BASELINES)
    e.add_argument("--attribute", type=int, default=0, metavar="GROUPS",
                   help="also run every recipe on K only, on V only, and on each of GROUPS "
                        "groups of consecutive layers alone (where the loss comes from)")
    e.add_argument("--out", default="eval-out")
    c = sub.add_parser("calibrate", help="attention statistics of a model on the calibration split "
                       "(safetensors + JSON sidecar), for the calibrated mode")
    c.add_argument("--model", help=model_help)
    c.add_argument("--text", help=text_help)
    c.add_argument("--windows", type=int, default=16)
    c.add_argument("--window", type=int, default=1024)
    c.add_argument("--n-sink", type=int, default=1, help="leading tokens left out of K/V statistics")
    c.add_argument("--weighting", choices=("attention", "uniform"), default="attention")
    c.add_argument("--samples", type=int, default=512, help="rows kept per (layer, kv-head)")
    c.add_argument("--sensitivity-windows", type=int, default=16,
                   help="windows for the model's sensitivity (gradients; 0: skip it)")
    c.add_argument("--score", type=int, default=256,
                   help="tokens at the end of each sensitivity window that are scored")
    c.add_argument("--out", help="output .safetensors (default: the cache eval looks in); the "
                   "sensitivity goes beside it as <stem>-sensitivity.safetensors")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    return _eval(args) if args.command == "eval" else _calibrate(args)


if __name__ == "__main__":
    raise SystemExit(main())
