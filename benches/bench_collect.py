"""What a calibration costs: the statistics (attention-weighted and uniform) and the sensitivity
against a plain forward pass over the same calibration windows (and one that skips the LM head, as
the statistics pass does), in one process, best of
``--repeats`` (wall and CPU seconds; on a shared machine the CPU seconds of a one-thread run are
the steadier figure). ``--legacy`` also times the collection as it was before issue 13 (forward
hooks on q/k/v projections, eager attention with ``output_attentions``; kept in
``tests/calibration/legacy_collect.py`` as the reference of the equivalence test).

    THREADS=1 .venv/bin/python benches/bench_collect.py [--model hard-case] [--windows 2]
        [--window 1024] [--repeats 3] [--legacy]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch

from kakeyaturbo import assets, calibration
from kakeyaturbo.eval import model as model_mod

ROOT = Path(__file__).resolve().parent.parent


def _legacy() -> Any:
    spec = importlib.util.spec_from_file_location(
        "legacy_collect", ROOT / "tests" / "calibration" / "legacy_collect.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def main(argv: "List[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file, or 'hard-case' (default: the embedded model)")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--score", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--legacy", action="store_true", help="also time the collection before issue 13")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("THREADS", torch.get_num_threads())))
    path = assets.hard_case_model() if args.model == "hard-case" else Path(args.model or assets.default_model())
    model, tok = model_mod.load(path)
    wins = calibration.calibration_windows(tok, assets.default_text(), args.windows, args.window)

    def forward(**kw: Any) -> None:
        with torch.no_grad():
            for w in wins:
                model(input_ids=torch.tensor([list(w)]), use_cache=False, **kw)

    jobs: List[Tuple[str, Callable[[], Any]]] = [
        ("forward", forward),
        # what the statistics pass runs: no logits
        ("forward without the LM head", lambda: forward(logits_to_keep=1)),
        ("statistics (attention)", lambda: calibration.collect(model, wins, weighting="attention")),
        ("statistics (uniform)", lambda: calibration.collect(model, wins, weighting="uniform")),
        ("sensitivity", lambda: calibration.collect_sensitivity(model, wins, score=args.score)),
    ]
    if args.legacy:
        old = _legacy()
        jobs += [("legacy statistics (attention)", lambda: old.collect(model, wins, weighting="attention")),
                 ("legacy statistics (uniform)", lambda: old.collect(model, wins, weighting="uniform")),
                 ("legacy sensitivity", lambda: old.collect_sensitivity(model, wins, score=args.score))]
    best: Dict[str, Tuple[float, float]] = {}
    for _ in range(args.repeats):
        for name, fn in jobs:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            b = best.get(name)
            best[name] = (min(wall, b[0]), min(cpu, b[1])) if b else (wall, cpu)
    fwd = best["forward"][1]
    print(f"{path.name} | {args.windows} windows x {args.window} tokens | {torch.get_num_threads()} threads "
          f"| best of {args.repeats}\n")
    print("| job | wall s | cpu s | cpu / forward |\n|---|---|---|---|")
    for name, (wall, cpu) in best.items():
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {cpu / fwd:.2f} |")
    print(json.dumps({k: {"wall": v[0], "cpu": v[1]} for k, v in best.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
