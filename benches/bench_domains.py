"""Cross-domain evaluation (issue 14): recipes calibrated on each corpus and on the calibration
mixture, evaluated on the evaluation split of every domain (EVAL.md protocol, paired windows,
one uncompressed reference per window), with baselines on the same windows. Prints one matrix
per recipe (rows: calibration corpus; columns: domains; cells dppl % / top-1 % / KL and the
verdict's letter) and writes ``OUT/results.json`` and ``OUT/results.md``; each domain is kept in
``OUT/<domain>.json`` as it finishes, so an interrupted run resumes and methods can be added.

    .venv/bin/python benches/bench_domains.py [--model hard-case] [--windows 32] [--ctx 1024]
        [--calibrations wiki-en,code,prose,chat,mixture] [--domains wiki-en,...]
        [--recipes calibrated-4bit,calibrated-3bit] [--baselines turboquant4,turboquant3]
        [--calibrate-only] [--out bench-out/domains]

Long contexts: ``--ctx 8192 --domains prose,code --calibrations mixture`` (windows inside one
page or file). ``--report DIR,DIR`` evaluates nothing and prints the matrices of the per-domain
results kept by several runs on the same windows (e.g. the baselines in one folder, another
calibration in another), merged.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, List

from kakeyaturbo import assets, recipes
from kakeyaturbo.calibration import corpus
from kakeyaturbo.eval import domains as dom
from kakeyaturbo.eval import model as model_mod

ALL = ",".join(corpus.DOMAINS)


def _progress(desc: str) -> Any:
    from tqdm import tqdm

    return lambda it: tqdm(it, desc=desc, file=sys.stderr, mininterval=30)


def _uptime() -> str:
    try:
        return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()
    except OSError:
        return "?"


def _specs(arg: str) -> List[str]:
    """Comma-separated corpora; the ``DOMAIN=WEIGHT`` items after a ``mixture:`` stay with it
    (``mixture,mixture:wiki-en=3,code=3`` is two calibrations)."""
    out: List[str] = []
    for part in arg.split(","):
        if out and "=" in part and out[-1].startswith("mixture:"):
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out


def _tables(res: Any, recipe_names: List[str], head: str) -> str:
    parts = [head, ""]
    for r in recipe_names:
        parts += [f"{r}: rows = calibration corpus; cells dppl % / top-1 % / KL, verdict", "",
                  dom.matrix(res, f"kakeyaturbo:{r}@"), ""]
    parts += ["baselines", "", dom.matrix(res, "", exclude="kakeyaturbo:"), ""]
    parts += ["every method with its bootstrap 95 % intervals over windows", "",
              dom.long_table(res), ""]
    return "\n".join(parts)


def _adapted(model: Any, tok: Any, path: Path, recs: List[Any], cals: List[str], methods: List[Any],
             rows: int, streams: List[str]) -> List[Any]:
    """Every calibrated method again with per-sequence means (``adapt_mean.MeanAdapted``)."""
    from dataclasses import replace

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from adapt_mean import MeanAdapted
    from kakeyaturbo.calibration import for_recipe

    by_name = {m.name: m for m in methods}
    out = []
    for cal in cals:
        for rec in recs:
            if rec.mode != "calibrated":
                continue
            m = by_name[dom.method_name(rec, cal)]
            stats, _ = for_recipe(rec, model, tok, path, cal)
            tag = "kv" if set(streams) >= {"k", "v"} else "".join(streams)
            out.append(replace(m, name=f"{m.name}+mean{rows}{tag}",
                               codec=MeanAdapted(m.codec, stats, rec, rows, streams)))
    return out


def main(argv: "List[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file, or 'hard-case'")
    ap.add_argument("--calibrations", default="wiki-en,wiki-fr,wiki-es,code,prose,chat,mixture",
                    help="comma-separated corpora to calibrate on (domains, files, 'mixture' or "
                         "'mixture:DOMAIN=WEIGHT,...', whose items stay together)")
    ap.add_argument("--domains", default=ALL)
    ap.add_argument("--recipes", default="calibrated-4bit,calibrated-3bit")
    ap.add_argument("--baselines", default="turboquant4,turboquant3")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--dtype", choices=model_mod.DTYPES, default="float32")
    ap.add_argument("--calibrate-only", action="store_true",
                    help="gather (and cache) every calibration, evaluate nothing")
    ap.add_argument("--adapt-mean", type=int, default=0, metavar="ROWS",
                    help="also run every calibrated method with per-sequence means (the mean of "
                         "its first ROWS rows, stored as float16 and counted; benches/adapt_mean.py)")
    ap.add_argument("--adapt-streams", default="k,v", help="the streams --adapt-mean adapts")
    ap.add_argument("--out", default="bench-out/domains")
    ap.add_argument("--report", metavar="DIRS",
                    help="evaluate nothing: print the matrices of the per-domain results kept in "
                         "these comma-separated folders, merged (same windows)")
    args = ap.parse_args(argv)
    if args.report:
        doms = [corpus.check_spec(d, allow_mixture=False) for d in args.domains.split(",") if d]
        res = dom.load([d for d in args.report.split(",") if d], doms)
        print(_tables(res, [r for r in args.recipes.split(",") if r], "merged from " + args.report))
        return 0

    path = assets.hard_case_model() if args.model == "hard-case" else Path(args.model or assets.default_model())
    cals = [corpus.check_spec(c) for c in _specs(args.calibrations)]
    doms = [corpus.check_spec(d, allow_mixture=False) for d in args.domains.split(",") if d]
    recs = [recipes.load(r) for r in args.recipes.split(",") if r]
    t0 = time.time()
    print(f"start {datetime.datetime.now().isoformat(timespec='seconds')} load {_uptime()}",
          file=sys.stderr)
    model, tok = model_mod.load(path, args.dtype)
    methods = dom.methods_for(model, tok, path, recs, cals,
                              [b for b in args.baselines.split(",") if b], progress=_progress)
    if args.adapt_mean:
        methods += _adapted(model, tok, path, recs, cals, methods, args.adapt_mean,
                            [s for s in args.adapt_streams.split(",") if s])
    t1 = time.time()
    print(f"calibrations ready after {t1 - t0:.0f} s, load {_uptime()}", file=sys.stderr)
    if args.calibrate_only:
        return 0
    out = Path(args.out)
    meta = {"model": path.name, "date": datetime.date.today().isoformat(),
            "calibrations": [corpus.describe(c) for c in cals],
            "threads": os.environ.get("OMP_NUM_THREADS", "default")}
    res = dom.run(model, tok, methods, doms, windows=args.windows, ctx=args.ctx,
                  n_eval=args.n_eval, out=out, meta=meta, progress=_progress)
    res["meta"]["seconds"] = {"calibration": t1 - t0, "evaluation": time.time() - t1}
    res["meta"]["load_at_end"] = _uptime()
    head = (f"{path.name} | {args.windows} windows per domain | ctx {args.ctx} | n_eval "
            f"{args.n_eval} | {res['meta']['date']}")
    text = _tables(res, [r.name for r in recs], head)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(text)
    print(text)
    print(f"done after {time.time() - t0:.0f} s, load {_uptime()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
