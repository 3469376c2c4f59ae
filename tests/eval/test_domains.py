"""The cross-domain matrix on a tiny random-weight model: methods calibrated on several corpora
(a file, a mixture), evaluated on the evaluation split of several domains, kept per domain and
resumed, and the tables and goals read from the results."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kakeyaturbo import assets, recipes  # noqa: E402
from kakeyaturbo.errors import InvalidParameterError  # noqa: E402
from kakeyaturbo.eval import domains as dom  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402
from kakeyaturbo.eval import model as model_mod  # noqa: E402

CTX, N_EVAL, WINDOWS = 48, 8, 2


def _small(name: str) -> recipes.Recipe:
    rec = recipes.load(name)
    if rec.mode != "calibrated":
        return rec
    return replace(rec, calibration=replace(rec.calibration, windows=2, window=64,
                                            sensitivity_windows=2, score=16))


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setattr(assets, "CACHE", cache)
    model, tok = model_mod.load(tiny_model_dir)
    text = str(tiny_model_dir / "text.txt")
    mix = "mixture:wiki-en=1,code=1"
    methods = dom.methods_for(model, tok, tiny_model_dir, [_small("calibrated-4bit"),
                                                           _small("balanced")],
                              [text, mix], ["identity", "turboquant3"])
    yield model, tok, text, mix, methods, cache
    mp.undo()


def test_methods_are_named_by_recipe_and_calibration(setup) -> None:
    model, tok, text, mix, methods, cache = setup
    assert [m.name for m in methods] == [
        "identity", "turboquant3", "kakeyaturbo:calibrated-4bit@text", "kakeyaturbo:balanced",
        f"kakeyaturbo:calibrated-4bit@{mix}"]
    # Each calibration corpus calibrates its own codecs; the mixture's per domain, cached so.
    a, b = methods[2].codec, methods[4].codec
    assert not np.allclose(a.codecs[("k", 0, 0)].roundtrip(np.ones((2, 16), np.float32))[0],
                           b.codecs[("k", 0, 0)].roundtrip(np.ones((2, 16), np.float32))[0])
    names = sorted(p.name for p in (cache / "calibration").glob("*.safetensors"))
    assert any(re.search(r"-text(-[0-9a-f]{8})?-2x64-", n) for n in names)  # (a hash of the file's bytes)
    assert any("summaries_en-us-1x64-" in n for n in names)  # wiki-en's share of 2 windows
    assert any("-code-" in n and "-1x64-" in n for n in names)


def test_matrix_on_two_domains_kept_and_resumed(setup, tmp_path) -> None:
    model, tok, text, mix, methods, cache = setup
    doms = [text, "wiki-en"]
    res = dom.run(model, tok, methods, doms, windows=WINDOWS, ctx=CTX, n_eval=N_EVAL,
                  out=tmp_path, meta={"model": "tiny"})
    assert list(res["domains"]) == doms and res["meta"]["ctx"] == CTX
    for d in doms:
        r = res["domains"][d]
        assert r["windows"] == WINDOWS and set(r["methods"]) == {m.name for m in methods}
        ident = r["methods"]["identity"]
        assert ident["dppl"] == 0.0 and ident["kl"] == 0.0 and ident["tokens"] == WINDOWS * N_EVAL
        assert r["methods"]["turboquant3"]["kl"] > 0
    saved = json.loads((tmp_path / "text.json").read_text())
    assert saved["methods"]["identity"] == res["domains"][text]["methods"]["identity"]
    assert (tmp_path / "wiki-en.json").is_file()

    # A repeated run keeps what is there: a method already run is not run again (this one
    # would fail), a new one runs on the same windows against the same reference.
    boom = harness.Method("turboquant3", lambda s, x: (_ for _ in ()).throw(AssertionError("ran")))
    extra = harness.baseline_methods(["fp8_e4m3"])[0]
    again = dom.run(model, tok, [boom, extra], doms, windows=WINDOWS, ctx=CTX, n_eval=N_EVAL,
                    out=tmp_path)
    for d in doms:
        got = again["domains"][d]
        assert got["methods"]["turboquant3"] == res["domains"][d]["methods"]["turboquant3"]
        assert got["ppl_ref"] == pytest.approx(res["domains"][d]["ppl_ref"])
        assert "fp8_e4m3" in got["methods"]
    # Other windows (another ctx): run afresh, not mixed with the old ones.
    with pytest.raises(AssertionError, match="ran"):
        dom.run(model, tok, [boom], doms[:1], windows=WINDOWS, ctx=CTX - 8, n_eval=N_EVAL,
                out=tmp_path)

    table = dom.matrix(again, "kakeyaturbo:calibrated-4bit@")
    lines = table.strip().splitlines()
    assert lines[0] == "| method | bits/elem | text | wiki-en |"
    assert len(lines) == 2 + 2 + 1  # header, rule, two calibrations, the reference row
    assert "(2)" in lines[-1]
    base = dom.matrix(again, "", exclude="kakeyaturbo:")
    assert "| identity | 16.00 | +0.00 / 100.0 / 0.0000 A | +0.00 / 100.0 / 0.0000 A |" in base
    assert "kakeyaturbo" not in base

    long = dom.long_table(again, "turboquant3")
    assert long.count("| turboquant3 |") == 2 and "| text | turboquant3 | 4.00 |" in long
    # Kept results read back and merged from several folders (same windows).
    other = tmp_path / "other"
    dom.run(model, tok, harness.baseline_methods(["int4"]), doms[:1], windows=WINDOWS, ctx=CTX,
            n_eval=N_EVAL, out=other)
    merged = dom.load([tmp_path, other], doms)
    assert set(merged["domains"][text]["methods"]) == set(again["domains"][text]["methods"]) | {"int4"}
    assert merged["domains"]["wiki-en"]["methods"] == again["domains"]["wiki-en"]["methods"]
    dom.run(model, tok, harness.baseline_methods(["int4"]), doms[:1], windows=1, ctx=CTX,
            n_eval=N_EVAL, out=tmp_path / "fewer")
    with pytest.raises(InvalidParameterError, match="other windows"):
        dom.load([tmp_path, tmp_path / "fewer"], doms)

    assert dom.goals(again, "identity")["met"]
    g = dom.goals(again, "turboquant3", top1_floor=1.01)
    assert not g["met"] and all(not v["met"] for v in g["domains"].values())
    assert not dom.goals(again, "nonesuch")["met"]


def test_results_of_another_model_text_or_method_are_not_resumed(setup, tmp_path) -> None:
    """A folder of results is reused only for the same model (fingerprint of the attention
    weights), the same text and the same method definitions; a damaged file is a typed error
    naming it."""
    import copy

    import torch

    from kakeyaturbo.errors import CorruptDataError

    model, tok, text, mix, methods, cache = setup
    base = harness.baseline_methods(["int4"])
    first = dom.run(model, tok, base, [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path)
    saved = json.loads((tmp_path / "text.json").read_text())
    assert saved["identity"]["model"]["fingerprint"] and saved["definitions"]["int4"]["kind"] == "baseline"
    boom = [harness.Method("int4", lambda s, x: (_ for _ in ()).throw(AssertionError("ran")))]
    # The same model, text and definition: resumed (the method is not run again).
    again = dom.run(model, tok, boom, [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path)
    assert again["domains"][text]["methods"]["int4"] == first["domains"][text]["methods"]["int4"]
    # Another model of the same shapes (one attention weight changed): run again.
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    with pytest.raises(AssertionError, match="ran"):
        dom.run(other, tok, boom, [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path)
    fresh = dom.run(other, tok, base, [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path)
    assert fresh["domains"][text]["ppl_ref"] != first["domains"][text]["ppl_ref"]
    dom.run(model, tok, base, [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path / "m1")
    with pytest.raises(InvalidParameterError, match="another model"):
        dom.load([tmp_path, tmp_path / "m1"], [text])
    # Another text of the same name: run again.
    moved = tmp_path / "b" / "text.txt"
    moved.parent.mkdir()
    moved.write_text(Path(text).read_text()[::-1])
    dom.run(model, tok, base, [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path / "t")
    with pytest.raises(AssertionError, match="ran"):
        dom.run(model, tok, boom, [str(moved)], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path / "t")
    # A method of the same name defined otherwise (a sink): run again, the others kept.
    sink = [replace(base[0], n_sink=1, quantise=boom[0].quantise)]
    with pytest.raises(AssertionError, match="ran"):
        dom.run(model, tok, sink, [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path / "t")
    # Damaged: CorruptDataError naming the file, for run and load alike.
    bad = tmp_path / "t" / "text.json"
    bad.write_text('{"windows_asked": 2, "ctx"')
    for call in (lambda: dom.run(model, tok, base, [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path / "t"),
                 lambda: dom.load([tmp_path / "t"], [text])):
        with pytest.raises(CorruptDataError, match="results file .*text.json.* is damaged"):
            call()


def test_kept_results_are_valid_json(setup, tmp_path) -> None:
    """NaN and infinities are written as null (JSON has no such numbers); no temporary file is
    left beside the results."""
    model, tok, text, mix, methods, cache = setup
    nan = harness.Method("nan", lambda s, x: (np.full_like(x, np.nan), 4 * x.size))
    dom.run(model, tok, [nan], [text], windows=1, ctx=CTX, n_eval=N_EVAL, out=tmp_path)
    raw = (tmp_path / "text.json").read_text()
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert [p.name for p in tmp_path.iterdir()] == ["text.json"]


def test_methods_of_a_multimodal_model_count_its_decoder_s_layers() -> None:
    # A multimodal model's config holds its decoder's layer count in its text config (it has
    # no num_hidden_layers of its own): a per-block recipe's boundary layers come from there.
    import torch
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14), mm_tokens_per_image=4)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    rec = replace(recipes.load("balanced"), boundary_layers=(0, -1))
    (method,) = dom.methods_for(model, None, None, [rec], ["same"], [])
    assert list(method.boundary) == [0, 3]
