"""No behaviour change across refactorings: today's build writes the same bytes for every
shipped recipe and mode, and evaluates to the same figures, as the commit recorded in
`tests/golden/behaviour.json` (made by `tools/behaviour.py`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
RECORDED = json.loads((ROOT / "tests" / "golden" / "behaviour.json").read_text())["fingerprint"]


def _tool():
    spec = importlib.util.spec_from_file_location("behaviour", ROOT / "tools" / "behaviour.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tool():
    return _tool()


def test_per_block_bytes_unchanged(tool) -> None:
    assert tool.per_block_bytes() == RECORDED["per_block"]


def test_every_recipe_writes_the_recorded_bytes(tool) -> None:
    now = tool.codec_bytes()
    assert sorted(now) == sorted(RECORDED["recipes"])
    for name, want in RECORDED["recipes"].items():
        got = now[name]
        assert sorted(got) == sorted(want), name
        errors: dict = {}
        for key, w in want.items():
            if isinstance(w, list) and len(w) == 4:  # calibrated: the fit is CPU-dependent in its last bits (tool.RTOL)
                assert got[key][0] == w[0], f"recipe {name!r} {key}: length changed"
                assert got[key][3] == pytest.approx(w[3], rel=tool.RTOL_HEAD), f"recipe {name!r} {key}"
                errors.setdefault(key[0], []).append((got[key][3], w[3]))
            else:
                assert got[key] == w, f"recipe {name!r} {key} changed its bytes"
        for stream, pairs in errors.items():
            mean_got, mean_want = (sum(p[i] for p in pairs) / len(pairs) for i in (0, 1))
            assert mean_got == pytest.approx(mean_want, rel=tool.RTOL_MEAN), f"recipe {name!r} stream {stream}"


def test_eval_figures_unchanged(tool) -> None:
    now = tool.eval_figures()
    assert sorted(now) == sorted(RECORDED["eval"])
    for name, want in RECORDED["eval"].items():
        # The codec's own methods fit bases whose last bits depend on the CPU (tool.RTOL);
        # every figure rests on a torch forward pass, which does too (tool.RTOL_FORWARD).
        rel = tool.RTOL if name.startswith("kakeyaturbo:") else tool.RTOL_FORWARD
        for k, v in want.items():
            got = now[name][k]
            if isinstance(v, str) or k in ("top1", "bits_per_element"):
                assert got == v, (name, k)
            elif k == "dppl":
                assert 1 + got == pytest.approx(1 + v, rel=rel, abs=0), (name, k)
            else:
                assert got == pytest.approx(v, rel=rel, abs=1e-12), (name, k)
