"""The command line end to end on a tiny saved random-weight model (no download): calibrate,
then eval with per-block and calibrated recipes and baselines; argument errors."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kakeyaturbo import assets, cli  # noqa: E402


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "CACHE", tmp_path / "cache")
    return tmp_path / "cache"


def test_bad_arguments_exit_with_status_2(capsys) -> None:
    for argv in (["eval", "--windows", "four"], ["calibrate", "--weighting", "magic"], ["nosuch"], []):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    assert "invalid" in capsys.readouterr().err


def test_calibrate_then_eval(tiny_model_dir, tmp_path, cache_dir) -> None:
    text = tiny_model_dir / "text.txt"
    stats = tmp_path / "stats.safetensors"
    assert cli.main(["calibrate", "--model", str(tiny_model_dir), "--text", str(text),
                     "--windows", "2", "--window", "96", "--sensitivity-windows", "2",
                     "--score", "16", "--samples", "20", "--out", str(stats)]) == 0
    sens = tmp_path / "stats-sensitivity.safetensors"
    assert stats.exists() and sens.exists() and (tmp_path / "stats.safetensors.json").exists()
    recipe = tmp_path / "cal.toml"
    recipe.write_text('name = "cal"\nmode = "calibrated"\nn_sink = 1\n'
                      '[calibration]\npath = "stats.safetensors"\n'
                      'sensitivity_path = "stats-sensitivity.safetensors"\nscore = 16\n'
                      '[k]\nbits = 3.9\nwhiten = "fisher"\nallocation = "sensitivity"\n'
                      '[v]\nbits = 3.9\nwhiten = "fisher"\ncenter = false\nallocation = "sensitivity"\n')
    out = tmp_path / "eval-out"
    assert cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(text), "--windows", "2",
                     "--ctx", "64", "--n-eval", "8", "--recipes", f"balanced,{recipe}",
                     "--baselines", "identity,fp8_e4m3", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["methods"]) == {"identity", "fp8_e4m3", "kakeyaturbo:balanced", "kakeyaturbo:cal"}
    ident = res["methods"]["identity"]
    assert ident["dppl"] == 0.0 and ident["top1"] == 1.0 and ident["tokens"] == 16
    cal = res["methods"]["kakeyaturbo:cal"]
    assert cal["bits_per_element"] < 5 and cal["model_bytes"] > 0
    assert res["meta"]["windows"] == 2 and res["meta"]["ctx"] == 64
    assert (out / "results.md").read_text().count("\n| ") >= 5
    assert not cache_dir.exists()  # the recipe named its statistics: nothing was gathered
