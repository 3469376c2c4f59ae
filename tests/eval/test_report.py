"""Results written as JSON, a Markdown table (sorted by bits) and a PNG plot."""

from __future__ import annotations

import json

import pytest

from kakeyaturbo.eval import report


def _result(name_bits):
    methods = {}
    for i, (name, bits) in enumerate(name_bits):
        methods[name] = dict(bits_per_element=bits, ratio_vs_bf16=16 / bits, dppl=0.001 * i,
                             dppl_ci=(-0.002, 0.004 * i), top1=0.97 - 0.01 * i,
                             top1_ci=(0.95, 0.99), kl=0.0012 * i, verdict="ACCEPT",
                             kind="codec" if name.startswith("kakeyaturbo") else "baseline")
    return {"meta": {"model": "m.gguf", "text": "t.json", "windows": 4, "ctx": 512, "n_eval": 64,
                     "ppl_ref": 12.3456, "date": "2026-12-03", "layers": 2}, "methods": methods}


def test_markdown_rows_are_sorted_by_bits_and_formatted() -> None:
    res = _result([("kakeyaturbo:x", 3.9), ("identity", 16.0), ("int4", 4.25)])
    lines = report.markdown(res).splitlines()
    assert lines[0] == ("m.gguf | 4 windows | ctx 512 | n_eval 64 | reference PPL 12.3456 | "
                        "2026-12-03")
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| identity", "| int4", "| kakeyaturbo:x"]
    assert rows[0] == ("| identity | 16.00 | 1.00 | +0.10 (-0.20, +0.40) | 96.0 (95.0, 99.0) | "
                       "0.0012 | ACCEPT |")


def test_write_makes_three_files(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    res = _result([("identity", 16.0), ("kakeyaturbo:x", 3.9)])
    paths = report.write(res, tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(res))
    assert paths["md"].read_text() == report.markdown(res)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
