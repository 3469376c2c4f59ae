"""The GPU script (`benches/gpu_bench.py`, what `make gpu-bench` runs) in its dry run: a GPU is
lent to few sessions and for minutes, so the script must not first fail there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benches" / "gpu_bench.py"


def _dry_run(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_dry_run_writes_every_part(tmp_path: Path) -> None:
    r = _dry_run(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    md = (tmp_path / "gpu_bench.md").read_text()
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert md.count("**PASS**") == 4 and "**FAIL**" not in md
    assert "| impl | q/kv heads x D | T | bits | ms | graph ms | x SDPA | x SDPA (graph) |" in md
    assert "## Timing:" in md
    fz = res["attention"]["fuzz"]
    # The case count is the cases asked for, not the summary's count of those that passed.
    assert fz["cases"] == 2 and fz["run"] == 2 and fz["not_run"] == 0
    rows = res["attention"]["rows"]
    assert {r["impl"] for r in rows} >= {"triton attention over the codes",
                                         "triton attention over the codes, keys pre-RoPE"}
    assert all(r["graph_ms"] is None for r in rows)  # no CUDA graphs in a dry run
    gen = res["generation"]["rows"]
    assert "## Generation through the cache" in md and len(gen) == 2 and gen[1]["fast"]
    # 40 tokens of float32 in the dry run: the raw sink and staging rows weigh, still under half.
    assert gen[1]["same_tokens"] == res["generation"]["steps"] and 2 < gen[1]["bits"] < 16


def test_dry_run_of_the_attention_alone(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, "--parts", "attention")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    md = (tmp_path / "gpu_bench.md").read_text()
    assert "## Decode attention over the codes" in md
    assert "## Timing:" not in md and "## Parity with the Rust codec" not in md


def test_unknown_part_is_refused(tmp_path: Path) -> None:
    r = _dry_run(tmp_path, "--parts", "kernels")
    assert r.returncode == 2 and "--parts takes codec, attention and/or generation" in r.stderr



PROFILE = SCRIPT.with_name("gpu_profile.py")


def test_profile_script_dry_run() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(PROFILE), "--dry-run", "--heads", "2/1", "--dim", "16", "--steps", "2"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "plain: median" in r.stdout and "pre-RoPE: median" in r.stdout


def test_profile_script_refuses_bad_heads() -> None:
    r = subprocess.run([sys.executable, str(PROFILE), "--dry-run", "--heads", "9/2"], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 2 and "KV dividing Q" in r.stderr
