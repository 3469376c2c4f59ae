"""Needle retrieval through the compressed cache (issue 14, EVAL.md "Long contexts"): a key
phrase hidden at several depths of a long haystack (the evaluation split of the ``prose``
domain), retrieved by greedy decoding, for the uncompressed cache, the shipped calibrated recipes
(calibrated once, on the mixture unless ``--calibration-text`` says otherwise) and baselines, all
on the same prompts in the same run (:mod:`kakeyaturbo.eval.needle`).

    .venv/bin/python benches/bench_needle.py [--model PATH|hard-case] [--lengths 2048,4096,8192]
        [--depths 0.1,0.5,0.9] [--trials 2] [--recipes calibrated-3bit,calibrated-4bit]
        [--baselines turboquant3+sink,kivi2+sink] [--calibration-text mixture] [--out DIR]

Writes ``OUT/records.jsonl`` as each prompt finishes (a repeated run resumes: prompts and
methods already there are not run again), then ``OUT/results.json`` (summary, records, meta)
and ``OUT/results.md`` (the tables), and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from kakeyaturbo import assets, recipes
from kakeyaturbo.calibration import corpus, for_recipe
from kakeyaturbo.eval import harness, needle
from kakeyaturbo.eval import model as model_mod


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _records(log: Path) -> Dict[Tuple[int, float, int], Dict[str, Any]]:
    """The records kept in a ``records.jsonl``, the last line of each prompt winning."""
    done: Dict[Tuple[int, float, int], Dict[str, Any]] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[(r["length"], r["depth"], r["trial"])] = r
    return done


def main(argv: "List[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file, or 'hard-case'")
    ap.add_argument("--lengths", default=",".join(map(str, needle.LENGTHS)))
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--recipes", default="calibrated-3bit,calibrated-4bit")
    ap.add_argument("--baselines", default="turboquant3+sink,kivi2+sink")
    ap.add_argument("--calibration-text", default=None,
                    help="calibration corpus of the recipes (default: each recipe's, the mixture)")
    ap.add_argument("--haystack", default="prose", help="a domain or file (its evaluation split)")
    ap.add_argument("--dtype", choices=model_mod.DTYPES, default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/needle")
    ap.add_argument("--prefill-cache", default=None,
                    help="keep each prompt's prefilled cache here (default OUT/prefill; '' for "
                         "none): a later run adding methods prefills nothing again")
    ap.add_argument("--report", metavar="DIRS",
                    help="run nothing: print the tables of the records kept in these "
                         "comma-separated folders, merged by prompt")
    args = ap.parse_args(argv)
    if args.report:
        runs = []
        for d in args.report.split(","):
            if d:
                runs.append(_records(Path(d) / "records.jsonl").values())
        records = needle.merge(*runs)
        print(needle.markdown(records, "merged from " + args.report))
        print(json.dumps(needle.summary(records), indent=1))
        return 0

    path = assets.hard_case_model() if args.model == "hard-case" else Path(args.model or assets.default_model())
    cal = None if args.calibration_text is None else corpus.check_spec(args.calibration_text)
    recs = [recipes.load(r) for r in args.recipes.split(",") if r]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"start {datetime.datetime.now().isoformat(timespec='seconds')} load {_load()}",
          file=sys.stderr, flush=True)
    model, tok = model_mod.load(path, args.dtype)
    layers = model.config.num_hidden_layers
    methods = harness.baseline_methods([b for b in args.baselines.split(",") if b])
    got: Dict[Any, Tuple[Any, Any]] = {}
    for rec in recs:
        key = (rec.calibration, max(rec.n_sink, 1), rec.needs_sensitivity, rec.key_rope)
        if key not in got:
            got[key] = for_recipe(rec, model, tok, path, cal)
        stats, sens = got[key]
        methods.append(harness.codec_method(rec, layers, stats=stats, sensitivity=sens))
    t1 = time.time()
    print(f"methods ready after {t1 - t0:.0f} s: {', '.join(m.name for m in methods)}",
          file=sys.stderr, flush=True)
    plist = needle.prompts(tok, _ints(args.lengths), _floats(args.depths), args.trials,
                           args.haystack, args.seed)
    log = out / "records.jsonl"
    done = _records(log)

    def save(rec: Dict[str, Any]) -> None:
        hits = {n: int(m["retrieved"]) for n, m in rec["methods"].items()}
        print(f"{rec['length']} @ {rec['depth']:g} trial {rec['trial']}: {hits} "
              f"({rec.get('seconds', {}).get('total', 0):.0f} s, load {_load()})",
              file=sys.stderr, flush=True)
        with log.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    # Shortest prompts first: a run cut short still holds every length it reached.
    plist.sort(key=lambda p: (p.length, p.trial, p.depth))
    pre = out / "prefill" if args.prefill_cache is None else (Path(args.prefill_cache) if args.prefill_cache else None)
    records = needle.run(model, tok, plist, methods, done=done, on_prompt=save, prefill_dir=pre)
    meta = {"model": path.name, "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared",
            "threads": os.environ.get("OMP_NUM_THREADS", "default"),
            "calibration_text": cal or "each recipe's (mixture)", "haystack": args.haystack,
            "lengths": _ints(args.lengths), "depths": _floats(args.depths),
            "trials": args.trials, "seconds": {"setup": t1 - t0, "run": time.time() - t1},
            "load_at_end": _load(),
            "command": "benches/bench_needle.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    summary = needle.summary(records)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                  "records": records}, indent=1))
    title = (f"{path.name} | needle in {args.haystack} | {args.trials} trial(s) per cell | "
             f"{meta['date']} | {meta['machine']}")
    text = needle.markdown(records, title)
    (out / "results.md").write_text(text)
    print(text)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
