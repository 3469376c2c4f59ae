"""Results written as JSON, a Markdown table (sorted by bits) and a PNG plot."""

from __future__ import annotations

import json

import numpy as np
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
    assert rows[0] == ("| identity | numpy | 16.00 | 1.00 | +0.10 (-0.20, +0.40) | 96.0 (95.0, 99.0) | "
                       "0.0012 | ACCEPT |")
    assert rows[2].startswith("| kakeyaturbo:x | kakeyaturbo | 3.90 |")


def test_rows_say_what_ran_them() -> None:
    res = _result([("quanto-int4", 5.0), ("int4+sink", 4.25), ("kakeyaturbo:x", 3.9)])
    res["methods"]["quanto-int4"].update(kind="peer", impl="transformers 5.24.0 + optimum-quanto 0.2.7")
    text = report.markdown(res)
    assert "| quanto-int4 | transformers 5.24.0 + optimum-quanto 0.2.7 | 5.00 |" in text
    assert "| int4+sink | numpy | 4.25 |" in text
    assert "numpy = re-implemented here from the method's published formula" in text


def test_plot_labels_do_not_overlap(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    g = np.random.default_rng(3)
    names = [(f"m{i}", float(b)) for i, b in enumerate(g.uniform(2.5, 5.0, 18))] + [("identity", 16.0)]
    res = _result(names)
    for i, r in enumerate(res["methods"].values()):
        # three beyond the clip at nearby bits: drawn at the edge with their values, which must
        # not run into each other (as "12: +995 %8: +5 %" once did)
        r["dppl"] = float(g.normal(0, 0.01)) if i not in (3, 4, 5) else 0.8 * i
        r["kl"] = float(10 ** g.uniform(-3.5, -1.5))
    for i, b in ((3, 3.0), (4, 3.4), (5, 3.2)):
        list(res["methods"].values())[i]["bits_per_element"] = b
    boxes = report.plot(res, tmp_path / "p.png")
    for key in ("kl", "dppl"):
        b = boxes[key]
        assert len(b) == len(names)
        gap = [(x0 - 2, y0 - 2, x1 + 2, y1 + 2) for x0, y0, x1, y1 in b]
        clashes = [(i, j) for i in range(len(b)) for j in range(i) if report._overlaps(gap[i], gap[j])]
        assert not clashes, f"{key}: labels {clashes} overlap"
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_write_makes_three_files(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    res = _result([("identity", 16.0), ("kakeyaturbo:x", 3.9)])
    paths = report.write(res, tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(res))
    assert paths["md"].read_text() == report.markdown(res)
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_is_all_or_nothing_and_valid_json(tmp_path, monkeypatch) -> None:
    """A failure while writing (here the plot) leaves the old three files as they were and no
    temporary file; the JSON written has null where a figure is NaN or infinite."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    old = report.write(_result([("identity", 16.0)]), out)
    before = {p: p.read_bytes() for p in old.values()}
    res = _result([("identity", 16.0), ("kakeyaturbo:x", 3.9)])
    res["meta"]["ppl_ref"] = float("nan")
    res["methods"]["kakeyaturbo:x"].update(kl=float("inf"), dppl_ci=(float("nan"), 0.1))

    def broken(*_a):
        raise RuntimeError("no room for the plot")

    monkeypatch.setattr(report, "plot", broken)
    with pytest.raises(RuntimeError, match="no room"):
        report.write(res, out)
    assert {p: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()
    paths = report.write(res, out)
    got = json.loads(paths["json"].read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert got["meta"]["ppl_ref"] is None and got["methods"]["kakeyaturbo:x"]["kl"] is None
    assert got["methods"]["kakeyaturbo:x"]["dppl_ci"] == [None, 0.1]
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md", "results.png"]
