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
from .calibration import corpus
from .calibration.gather import model_dtype
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
    cal_text = _calibration_text(args, text_path)
    print(f"model {model_path}\ntext  {text_path} (evaluation split)\ncalibration text "
          f"{cal_text or 'as each recipe names it (default: mixture)'} (calibration split)",
          file=sys.stderr)
    m, tok = model.load(model_path, args.dtype)
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
            calibrations[key] = for_recipe(rec, m, tok, model_path, cal_text,
                                                  progress=_progress)
        stats, sens = calibrations.get(key, (None, None))
        methods.append(harness.codec_method(rec, layers, stats=stats, sensitivity=sens))
        if args.attribute:
            methods += harness.attribution_methods(methods[-1], layers, args.attribute)
    res_methods = harness.evaluate(m, wins, args.ctx, methods, progress=_progress("windows"))
    any_m = next(iter(res_methods.values()))
    res = {
        "meta": {"model": model_path.name, "text": text_path.name, "windows": len(wins),
                 "calibration_text": cal_text or "recipe",
                 "ctx": args.ctx, "n_eval": args.n_eval, "ppl_ref": any_m["ppl_ref"],
                 "date": datetime.date.today().isoformat(), "layers": layers,
                 "dtype": model_dtype(m)},
        "methods": res_methods,
    }
    paths = report.write(res, Path(args.out))
    print(report.markdown(res))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def _calibration_text(args: argparse.Namespace, text_path: Path) -> Optional[str]:
    """``--calibration-text``: ``same`` is the evaluation text's own calibration split."""
    spec = getattr(args, "calibration_text", None)
    if spec is None:
        return None
    return corpus.check_spec(str(text_path) if spec == "same" else spec)


def _calibrate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .calibration.mixture import composition, pool_sensitivity, pool_stats

    model_path, text_path = _model_and_text(args)
    text = corpus.check_spec(args.calibration_text or (str(text_path) if args.text else "mixture"))
    print(f"model {model_path}\ntext  {text} (calibration split)", file=sys.stderr)
    m, tok = model.load(model_path, args.dtype)
    dtype = model_dtype(m)
    settings = recipes.CalibrationSettings(
        windows=args.windows, window=args.window, weighting=args.weighting,
        sensitivity_windows=max(args.sensitivity_windows, 1), score=args.score,
        corpus=text).checked()
    mixed = corpus.is_mixture(text)
    out = Path(args.out) if args.out else None

    def write(obj: Any, path: Path) -> None:
        for p in obj.save(path):
            print(f"wrote {p}", file=sys.stderr)

    # A mixture is collected per domain into the cache (where eval finds it) and pooled.
    parts = composition(text, args.windows, tok) if mixed else [(text, args.windows)]
    got = []
    for d, c in parts:
        meta = {"model": model_path.name, **corpus.meta(d)}
        wins = calibration_windows(tok, d, c, args.window)
        stats = collect(m, wins, n_sink=args.n_sink, weighting=args.weighting,
                        samples=args.samples, progress=_progress(f"calibration {d}"), meta=meta)
        if mixed or out is None:
            write(stats, stats_path(model_path, d, replace(settings, windows=c), dtype))
        got.append((stats, c))
    if out is not None:
        write(pool_stats(got, meta={"text": text}) if mixed else got[0][0], out)
    if args.sensitivity_windows > 0:
        parts = (composition(text, args.sensitivity_windows, tok) if mixed
                 else [(text, args.sensitivity_windows)])
        sgot = []
        for d, c in parts:
            meta = {"model": model_path.name, **corpus.meta(d)}
            wins = calibration_windows(tok, d, c, args.window)
            sens = collect_sensitivity(m, wins, n_sink=args.n_sink, score=args.score,
                                       progress=_progress(f"sensitivity {d}"), meta=meta)
            if mixed or out is None:
                write(sens, sensitivity_path(model_path, d,
                                             replace(settings, sensitivity_windows=c),
                                             args.n_sink, dtype))
            sgot.append((sens, c))
        if out is not None:
            write(pool_sensitivity(sgot, meta={"text": text}) if mixed else sgot[0][0],
                  out.with_name(out.stem + "-sensitivity.safetensors"))
    return 0


def parser() -> argparse.ArgumentParser:
    """The command line: ``kakeyaturbo eval`` and ``kakeyaturbo calibrate``."""
    ap = argparse.ArgumentParser(prog="kakeyaturbo")
    sub = ap.add_subparsers(dest="command", required=True)
    model_help = ("a model directory or GGUF file, or 'hard-case' for EVAL.md's Qwen2.5 0.5B "
                  "(default: the embedded SmolLM2-135M)")
    text_help = ("a domain (wiki-en, wiki-fr, wiki-es, code, prose, chat), a UTF-8 text or the "
                 "wiki JSON (default: the embedded English Wikipedia summaries)")
    cal_help = ("calibration text, its calibration split only: 'mixture' (the shipped "
                "multi-domain mixture), 'mixture:DOMAIN=WEIGHT,...', a domain or a file")
    dtype_help = ("weights and cache dtype: auto = as the checkpoint stores it where the CPU computes in "
                  "it (bfloat16 or float32); default float32, in which every published figure was measured")
    e = sub.add_parser("eval", help="perplexity, top-1 and KL of the codec and baselines on a model")
    e.add_argument("--model", help=model_help)
    e.add_argument("--text", help=text_help)
    e.add_argument("--dtype", choices=model.DTYPES, default="float32", help=dtype_help)
    e.add_argument("--calibration-text", metavar="TEXT",
                   help=cal_help + "; 'same': the evaluation text's own (default: as each "
                   "recipe's [calibration] corpus says, 'mixture' for the shipped ones)")
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
    c.add_argument("--dtype", choices=model.DTYPES, default="float32", help=dtype_help)
    c.add_argument("--calibration-text", metavar="TEXT",
                   help=cal_help + " (default: --text if given, else 'mixture')")
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
