"""`kakeyaturbo eval`: the EVAL.md protocol on a causal LM and a text, with baselines."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import List, Optional

DEFAULT_BASELINES = "identity,bf16,fp8_e4m3,int4,kivi2,turboquant3,turboquant4"
DEFAULT_RECIPES = "balanced,max-compression,predecessor"


def _eval(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import recipes
    from .eval import data, harness, model, report

    if args.model == "hard-case":
        model_path = data.hard_case_model()
    else:
        model_path = Path(args.model) if args.model else data.default_model()
    text_path = Path(args.text) if args.text else data.default_text()
    print(f"model {model_path}\ntext  {text_path} (evaluation split)", file=sys.stderr)
    m, tok = model.load(model_path)
    _, eval_texts = data.split(data.load_articles(text_path))
    need = args.windows * (args.ctx + args.n_eval + 1)
    ids: List[int] = []
    for t in eval_texts:
        ids.extend(tok.encode(t + "\n\n", add_special_tokens=False))
        if len(ids) >= need:
            break
    wins = data.windows(ids, args.ctx + args.n_eval + 1, args.windows, model.bos_id(tok))
    if len(wins) < args.windows:
        print(f"text holds only {len(wins)} windows", file=sys.stderr)
    layers = m.config.num_hidden_layers
    methods = harness.baseline_methods([b for b in args.baselines.split(",") if b])
    methods += [harness.codec_method(recipes.load(r), layers) for r in args.recipes.split(",") if r]
    res_methods = harness.evaluate(m, wins, args.ctx, methods,
                                   progress=lambda it: tqdm(it, desc="windows", file=sys.stderr))
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


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kakeyaturbo")
    sub = ap.add_subparsers(dest="command", required=True)
    e = sub.add_parser("eval", help="perplexity, top-1 and KL of the codec and baselines on a model")
    e.add_argument("--model", help="a model directory or GGUF file, or 'hard-case' for EVAL.md's Qwen2.5 0.5B "
                   "(default: the embedded SmolLM2-135M)")
    e.add_argument("--text", help="a UTF-8 text or the wiki JSON (default: the embedded Wikipedia summaries)")
    e.add_argument("--windows", type=int, default=4)
    e.add_argument("--ctx", type=int, default=512)
    e.add_argument("--n-eval", type=int, default=64)
    e.add_argument("--recipes", default=DEFAULT_RECIPES, help="comma-separated recipe names or files")
    e.add_argument("--baselines", default=DEFAULT_BASELINES)
    e.add_argument("--out", default="eval-out")
    args = ap.parse_args(argv)
    return _eval(args)


if __name__ == "__main__":
    raise SystemExit(main())
