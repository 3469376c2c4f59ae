"""A/B of builds of the attention kernel's example, fair to each: one core, turns reversed.

    cargo build --release -p kakeyaturbo --example attention_speed   # at each commit, copied aside
    .venv/bin/python benches/ab_builds.py --build old=/tmp/as-old --build new=/tmp/as-new \\
        --rounds 10 --out bench-out/ab -- 8192 9 3 64 4 best 40 rope i16

Each round runs every build once (`RAYON_NUM_THREADS=1`, pinned with `taskset -c CPU`), in the
given order in odd rounds and reversed in even ones; the first build is the baseline. Per build:
the median of its runs' medians (the example's own figure, ms) and the median over rounds of its
time over the baseline's in that round, with quartiles. Why: on the 2-core VMs this project is
measured on, a core's speed moves by a third from minute to minute and the two cores at times
differ by as much, and a build always run first came out slower than itself run second
(docs/decode-attention.md, "Tried and reverted"); ratios within a round on one core cancel both.
Prints a table, writes ``ab_builds.json`` and ``ab_builds.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics as st
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Tuple

MEDIAN = re.compile(r"median ([0-9.]+) ms")


def run(path: str, cpu: int, args: List[str]) -> float:
    """The example's median (ms) for one run of ``path`` pinned to ``cpu``."""
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    out = subprocess.run(["taskset", "-c", str(cpu), path, *args], capture_output=True, text=True,
                         env=env, check=True).stdout
    m = MEDIAN.search(out)
    if m is None:
        raise SystemExit(f"{path}: no 'median ... ms' in its output: {out[-500:]!r}")
    return float(m.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="append", required=True, metavar="NAME=PATH",
                   help="a build of the example (two or more; the first is the baseline)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--cpu", type=int, default=0, help="the core every run is pinned to")
    p.add_argument("--out", type=Path, default=Path("bench-out/ab"))
    p.add_argument("args", nargs="+", help="the example's arguments (after --)")
    a = p.parse_args()
    builds: List[Tuple[str, str]] = [tuple(b.split("=", 1)) for b in a.build]  # type: ignore[misc]
    if len(builds) < 2 or any(len(b) != 2 for b in builds):
        p.error("give two or more --build NAME=PATH")
    times: Dict[str, List[float]] = {n: [] for n, _ in builds}
    for r in range(a.rounds):
        order = builds if r % 2 == 0 else builds[::-1]
        for name, path in order:
            times[name].append(run(path, a.cpu, a.args))
    base = builds[0][0]
    rows = []
    for name, path in builds:
        ratios = [t / b for t, b in zip(times[name], times[base])]
        q1, _, q3 = st.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        rows.append({"build": name, "path": path, "median_ms": st.median(times[name]),
                     "ratio_to_baseline": st.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
                     "runs_ms": times[name]})
    head = (f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC | attention_speed {' '.join(a.args)} | "
            f"{a.rounds} rounds, core {a.cpu}, turns reversed every round | baseline {base}")
    table = ["| build | median ms | time / baseline's (median of rounds) | quartiles |", "|---|---|---|---|"]
    table += [f"| {r['build']} | {r['median_ms']:.3f} | {r['ratio_to_baseline']:.3f} | "
              f"{r['ratio_q1']:.3f} to {r['ratio_q3']:.3f} |" for r in rows]
    text = "\n".join([head, "", *table])
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "ab_builds.md").write_text(text + "\n")
    (a.out / "ab_builds.json").write_text(json.dumps(
        {"date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "args": a.args, "rounds": a.rounds,
         "cpu": a.cpu, "baseline": base, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
