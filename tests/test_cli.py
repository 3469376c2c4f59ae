"""The command line end to end on a tiny saved random-weight model (no download): calibrate,
then eval with per-block and calibrated recipes and baselines; argument errors."""

from __future__ import annotations

import json
import shutil

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


def test_calibrate_then_eval(tiny_model_dir, tmp_path, cache_dir, capsys) -> None:
    """calibrate --out writes ONE file; a recipe pointing at it, and eval --calibration, use it
    without gathering anything; eval --calibration takes the codec file of --codec-out too."""
    text = tiny_model_dir / "text.txt"
    cal = tmp_path / "cal.safetensors"
    assert cli.main(["calibrate", "--model", str(tiny_model_dir), "--text", str(text),
                     "--windows", "2", "--window", "96", "--sensitivity-windows", "2",
                     "--score", "16", "--samples", "20", "--out", str(cal),
                     "--codec", "calibrated-4bit", "--codec-out", str(tmp_path / "c4.kkcodec")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c4.kkcodec", "cal.safetensors"]
    # The codecs fitted with it: what the calibration file gives that recipe (the same fingerprints).
    from kakeyaturbo import recipes
    from kakeyaturbo.calibration import Calibration, ModelCodec

    loaded = ModelCodec.load(tmp_path / "c4.kkcodec")
    stats, sens = Calibration.load(cal).parts(recipes.load("calibrated-4bit"))
    fitted = ModelCodec(stats, recipes.load("calibrated-4bit"), sensitivity=sens)
    assert {k: c.fingerprint for k, c in loaded.codecs.items()} == \
        {k: c.fingerprint for k, c in fitted.codecs.items()}
    from kakeyaturbo import InvalidParameterError
    from kakeyaturbo.eval import harness

    with pytest.raises(InvalidParameterError, match="fitted for it"):
        harness.codec_method(recipes.load("calibrated-3bit"), 2, codec=loaded)
    # eval takes the codec file for the recipe it was fitted for, with the calibration file's figures.
    evals = {}
    for name, source in (("codec", tmp_path / "c4.kkcodec"), ("statistics", cal)):
        evals[name] = tmp_path / f"eval-{name}"
        assert cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(text), "--windows", "2",
                         "--ctx", "64", "--n-eval", "8", "--recipes", "calibrated-4bit", "--baselines", "",
                         "--peers", "", "--calibration", str(source), "--out", str(evals[name])]) == 0
    rows = [json.loads((evals[n] / "results.json").read_text())["methods"]["kakeyaturbo:calibrated-4bit"]
            for n in ("codec", "statistics")]
    assert rows[0]["kl"] == rows[1]["kl"] and rows[0]["bits_per_element"] == rows[1]["bits_per_element"]
    # Each run records where the recipe's calibration came from (no calibration text: the file's).
    metas = {n: json.loads((evals[n] / "results.json").read_text())["meta"] for n in evals}
    assert metas["codec"]["calibration"] == {"calibrated-4bit": f"codec file {tmp_path / 'c4.kkcodec'}"}
    assert metas["statistics"]["calibration"] == {"calibrated-4bit": f"calibration file {cal} (text {text})"}
    assert metas["statistics"]["calibration_text"] is None
    capsys.readouterr()
    assert cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(text), "--windows", "2",
                     "--ctx", "64", "--n-eval", "8", "--recipes", "calibrated-3bit", "--baselines", "",
                     "--peers", "", "--calibration", str(tmp_path / "c4.kkcodec"), "--out", str(tmp_path / "x")]) == 1
    assert "fitted for recipe 'calibrated-4bit', not 'calibrated-3bit'" in capsys.readouterr().err
    (tmp_path / "c4.kkcodec").unlink()
    for p in evals.values():
        shutil.rmtree(p)
    recipe = tmp_path / "cal.toml"
    recipe.write_text('name = "cal"\nmode = "calibrated"\nn_sink = 1\n'
                      '[calibration]\npath = "cal.safetensors"\nscore = 16\n'
                      '[k]\nbits = 3.9\nwhiten = "fisher"\nallocation = "sensitivity"\n'
                      '[v]\nbits = 3.9\nwhiten = "fisher"\ncenter = false\nallocation = "sensitivity"\n')
    out = tmp_path / "eval-out"
    assert cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(text), "--calibration-text", "same", "--windows", "2",
                     "--ctx", "64", "--n-eval", "8", "--recipes", f"balanced,{recipe}",
                     "--baselines", "identity,fp8_e4m3,fp8_e4m3+sink", "--peers", "",
                     "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert set(res["methods"]) == {"identity", "fp8_e4m3", "fp8_e4m3+sink", "kakeyaturbo:balanced",
                                   "kakeyaturbo:cal"}
    ident = res["methods"]["identity"]
    assert ident["dppl"] == 0.0 and ident["top1"] == 1.0 and ident["tokens"] == 16
    cal_row = res["methods"]["kakeyaturbo:cal"]
    assert cal_row["bits_per_element"] < 5 and cal_row["model_bytes"] > 0
    assert cal_row["kind"] == "codec" and res["methods"]["fp8_e4m3"]["kind"] == "baseline"
    assert res["meta"]["windows"] == 2 and res["meta"]["ctx"] == 64
    assert (out / "results.md").read_text().count("\n| ") >= 5
    # The same file through --calibration, for a shipped recipe: the same codec, the same figures.
    out2 = tmp_path / "eval-2"
    shipped = tmp_path / "shipped.toml"
    shipped.write_text(recipe.read_text().replace('name = "cal"', 'name = "cal"')
                       .replace('path = "cal.safetensors"\n', ""))
    assert cli.main(["eval", "--model", str(tiny_model_dir), "--text", str(text), "--windows", "2",
                     "--ctx", "64", "--n-eval", "8", "--recipes", str(shipped), "--baselines", "",
                     "--peers", "", "--calibration", str(cal), "--out", str(out2)]) == 0
    res2 = json.loads((out2 / "results.json").read_text())
    assert res2["methods"]["kakeyaturbo:cal"]["kl"] == cal_row["kl"]
    assert not cache_dir.exists()  # the recipe named its calibration: nothing was gathered


@pytest.fixture(scope="module")
def gemma3_bf16_dir(tiny_model_dir, tmp_path_factory):
    """A tiny random-weight Gemma 3 text model (q/k norm, MQA, sliding-window layers of 16 tokens
    between global ones) saved in bfloat16 with the tiny tokenizer."""
    import torch
    import transformers

    return _checkpoint(tiny_model_dir, tmp_path_factory.mktemp("tiny-gemma3"), transformers.Gemma3TextConfig,
                       transformers.Gemma3ForCausalLM, torch.bfloat16, num_key_value_heads=1, head_dim=32,
                       sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _checkpoint(tiny_model_dir, out, config_cls, model_cls, dtype=None, **config):
    """A tiny random-weight model of 3 layers (64 wide, 4 query heads) saved to ``out`` with the
    tiny tokenizer, in ``dtype`` (None: float32)."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=4, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                     pad_token_id=1, **config)
    model = model_cls(cfg)
    (model if dtype is None else model.to(dtype)).save_pretrained(out)
    return out


def test_sliding_qk_norm_model_in_its_stored_dtype(gemma3_bf16_dir, tiny_model_dir, tmp_path,
                                                   cache_dir) -> None:
    """A checkpoint directory of another family, loaded as stored (bfloat16, --dtype auto):
    calibrate, then eval with a calibrated and a per-block recipe; the identity method is exact
    across the sliding windows (ctx 64 > window 16)."""
    text = tiny_model_dir / "text.txt"
    stats = tmp_path / "g.safetensors"
    assert cli.main(["calibrate", "--model", str(gemma3_bf16_dir), "--text", str(text), "--calibration-text", "same", "--dtype", "auto",
                     "--windows", "2", "--window", "96", "--sensitivity-windows", "2", "--score", "16",
                     "--samples", "20", "--out", str(stats)]) == 0
    recipe = tmp_path / "cal.toml"
    recipe.write_text('name = "cal"\nmode = "calibrated"\nn_sink = 1\n'
                      '[calibration]\npath = "g.safetensors"\n'
                      '[k]\nbits = 3.9\nwhiten = "fisher"\nallocation = "sensitivity"\n'
                      '[v]\nbits = 3.9\nwhiten = "fisher"\ncenter = false\nallocation = "sensitivity"\n')
    out = tmp_path / "eval-out"
    assert cli.main(["eval", "--model", str(gemma3_bf16_dir), "--text", str(text), "--calibration-text", "same", "--dtype", "auto",
                     "--windows", "2", "--ctx", "64", "--n-eval", "8", "--recipes", f"balanced,{recipe}",
                     "--baselines", "identity,fp8_e4m3", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["dtype"] == "bfloat16"
    assert "quanto-int4" not in res["methods"]  # QuantizedCache takes full-attention models only
    ident = res["methods"]["identity"]
    assert ident["dppl"] == 0.0 and ident["top1"] == 1.0 and ident["kl"] == 0.0
    cal = res["methods"]["kakeyaturbo:cal"]
    assert cal["bits_per_element"] < 6 and cal["model_bytes"] > 0 and cal["kl"] > 0
    assert not cache_dir.exists()
    out32 = tmp_path / "eval-32"
    assert cli.main(["eval", "--model", str(gemma3_bf16_dir), "--text", str(text), "--calibration-text", "same", "--windows", "1",
                     "--ctx", "32", "--n-eval", "4", "--recipes", "", "--baselines", "identity",
                     "--peers", "", "--out", str(out32)]) == 0
    assert json.loads((out32 / "results.json").read_text())["meta"]["dtype"] == "float32"


def test_hybrid_model_directory(tiny_model_dir, tmp_path, cache_dir) -> None:
    """A hybrid checkpoint (Qwen3.5's text model: Gated DeltaNet layers around an attention
    layer) through the commands: calibrate (statistics of its one K/V layer), eval with the
    calibrated recipe (the identity exact, QuantizedCache skipped), then a cache from the file."""
    import torch
    import transformers

    from kakeyaturbo.cache import KakeyaCache
    from kakeyaturbo.calibration import Calibration

    model_dir = _checkpoint(tiny_model_dir, tmp_path / "tiny-qwen3_5", transformers.Qwen3_5TextConfig,
                            transformers.Qwen3_5ForCausalLM, num_key_value_heads=2, head_dim=16,
                            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                            linear_value_head_dim=16,
                            layer_types=["linear_attention", "full_attention", "linear_attention"])
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    cal = tmp_path / "h.kkcal"
    res = _calibrate_then_eval(model_dir, tiny_model_dir, tmp_path, cal, window=64, samples=20, ctx=48,
                               baselines="identity")
    assert "quanto-int4" not in res  # QuantizedCache takes full-attention layers only
    assert (res["identity"]["dppl"], res["identity"]["kl"]) == (0.0, 0.0)
    row = res["kakeyaturbo:calibrated-4bit"]
    assert 3.0 < row["bits_per_element"] < 6.0 and 0 < row["kl"] < 1.0
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert Calibration.load(cal).stats.layer_index == (1,)
    cache = KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration=cal, block_size=16)
    ids = torch.randint(3, len(tok), (1, 40), generator=torch.Generator().manual_seed(0))
    seq = model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    assert cache.fast and seq.shape[1] == 44 and cache.layers[1].num_sealed() == 2
    assert cache.memory()["state"] > 0
    assert not cache_dir.exists()


def test_keys_normalised_after_rope_model_directory(tiny_model_dir, tmp_path, cache_dir) -> None:
    """A HunYuan checkpoint (q/k RMSNorm with learnt weights after RoPE; NTK-alpha RoPE labelled
    ``dynamic`` as its checkpoints label it) through the commands with the shipped recipe, which
    codes keys before RoPE (refused before 2026-12-08): calibrate, eval, then a cache from the
    file generating over the codes."""
    import torch
    import transformers

    from kakeyaturbo.cache import KakeyaCache

    model_dir = _checkpoint(tiny_model_dir, tmp_path / "tiny-hunyuan", transformers.HunYuanDenseV1Config,
                            transformers.HunYuanDenseV1ForCausalLM, num_key_value_heads=2, head_dim=16,
                            rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                             "rope_theta": 10000.0})
    cal = tmp_path / "hy.kkcal"
    res = _calibrate_then_eval(model_dir, tiny_model_dir, tmp_path, cal, window=64, samples=20, ctx=48,
                               baselines="identity")
    assert (res["identity"]["dppl"], res["identity"]["kl"]) == (0.0, 0.0)
    row = res["kakeyaturbo:calibrated-4bit"]
    assert 3.0 < row["bits_per_element"] < 6.0 and 0 < row["kl"] < 1.0
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cache = KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration=cal, block_size=16)
    assert all(r.key_norm is not None for r in cache.rope.layers)
    n = len(transformers.AutoTokenizer.from_pretrained(model_dir))
    ids = torch.randint(3, n, (1, 40), generator=torch.Generator().manual_seed(0))
    seq = model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    assert cache.fast and seq.shape[1] == 44 and cache.layers[0].num_sealed() == 2
    assert not cache_dir.exists()


def test_dynamic_rope_model_directory(tiny_model_dir, tmp_path, cache_dir) -> None:
    """A Llama checkpoint with a ``dynamic`` rope type (max_position_embeddings 512) through the
    commands with the shipped recipe (keys coded before RoPE, refused before 2026-12-08): calibrate
    and eval below the limit, then a cache from the file generating over the codes; a call reaching
    the limit refused by name."""
    import torch
    import transformers

    from kakeyaturbo.cache import KakeyaCache
    from kakeyaturbo.errors import UnsupportedModelError

    model_dir = _checkpoint(tiny_model_dir, tmp_path / "tiny-dynamic", transformers.LlamaConfig,
                            transformers.LlamaForCausalLM, num_key_value_heads=2, head_dim=16,
                            rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    cal = tmp_path / "dyn.kkcal"
    res = _calibrate_then_eval(model_dir, tiny_model_dir, tmp_path, cal, window=64, samples=20, ctx=48,
                               baselines="identity")
    row = res["kakeyaturbo:calibrated-4bit"]
    assert 3.0 < row["bits_per_element"] < 6.0 and 0 < row["kl"] < 1.0
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cache = KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration=cal, block_size=16)
    n = len(transformers.AutoTokenizer.from_pretrained(model_dir))
    ids = torch.randint(3, n, (1, 40), generator=torch.Generator().manual_seed(0))
    seq = model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    assert cache.fast and seq.shape[1] == 44 and cache.layers[0].num_sealed() == 2
    with pytest.raises(UnsupportedModelError, match=r"max_position_embeddings \(512\)"):
        model(input_ids=torch.randint(3, n, (1, 470), generator=torch.Generator().manual_seed(1)), cache=cache)
    assert cache.get_seq_length() == 43 and not cache_dir.exists()


def _calibrate_then_eval(model_dir, tiny_model_dir, tmp_path, cal, *, window, samples, ctx, baselines):
    """``kakeyaturbo calibrate`` of a checkpoint on the tiny text (2 windows of ``window`` tokens,
    the sensitivity of 2 scoring 16) into ``cal``, then ``eval`` of calibrated-4bit from it (2
    windows, ``ctx``, 8 scored) beside ``baselines``: the methods of its results."""
    text = tiny_model_dir / "text.txt"
    assert cli.main(["calibrate", "--model", str(model_dir), "--text", str(text), "--calibration-text", "same",
                     "--windows", "2", "--window", str(window), "--sensitivity-windows", "2", "--score", "16",
                     "--samples", str(samples), "--out", str(cal)]) == 0
    out = tmp_path / "eval-out"
    assert cli.main(["eval", "--model", str(model_dir), "--text", str(text),
                     "--windows", "2", "--ctx", str(ctx), "--n-eval", "8", "--recipes", "calibrated-4bit",
                     "--calibration", str(cal), "--baselines", baselines, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())["methods"]


def _two_head_sizes(tiny_model_dir, tmp_path):
    """A tiny Gemma 4 checkpoint whose full layers have another head size than its sliding one,
    and its vocabulary size."""
    import transformers

    n = len(transformers.AutoTokenizer.from_pretrained(tiny_model_dir))
    wide = {"head_dim": 32, "num_key_value_heads": 1}
    return _checkpoint(tiny_model_dir, tmp_path / "tiny-gemma4", transformers.Gemma4TextConfig,
                       transformers.Gemma4ForCausalLM, num_key_value_heads=2, head_dim=16, sliding_window=16,
                       layer_types=["sliding_attention", "full_attention", "full_attention"],
                       per_layer_config={"01": wide, "02": wide}, hidden_size_per_layer_input=16,
                       vocab_size_per_layer_input=n), n


def test_layers_of_two_head_sizes_calibrated_by_group(tiny_model_dir, tmp_path, cache_dir) -> None:
    """Gemma 4 (full layers of another head size than its sliding one): `calibrate` collects each
    group of layers of one shape and writes them in one file, which serves every layer."""
    import torch
    import transformers

    from kakeyaturbo.cache import KakeyaCache
    from kakeyaturbo.calibration import Calibration

    model_dir, n = _two_head_sizes(tiny_model_dir, tmp_path)
    cal = tmp_path / "g4.kkcal"
    assert cli.main(["calibrate", "--model", str(model_dir), "--text", str(tiny_model_dir / "text.txt"),
                     "--calibration-text", "same", "--windows", "2", "--window", "64", "--sensitivity-windows", "2",
                     "--score", "16", "--samples", "20", "--out", str(cal)]) == 0
    assert [st.layer_index for st, _ in Calibration.load(cal).pairs()] == [(1, 2), (0,)]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cache = KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration=cal, block_size=8)
    ids = torch.randint(3, n, (1, 30), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    assert cache.codec.layers == (0, 1, 2) and all(layer.num_sealed() for layer in cache.layers)
    assert not cache_dir.exists()


def test_eval_gathers_every_group_of_layers(tiny_model_dir, tmp_path, cache_dir, capsys) -> None:
    """`eval` with a recipe's own calibration (no file named) gathers statistics for every group of
    K/V layers of one shape (in one pass over the windows), each cached apart: all layers are coded
    (none left raw at 16 bits), and `calibrate` fills the same cache."""
    import transformers

    from dataclasses import replace

    from kakeyaturbo import recipes
    from kakeyaturbo.calibration import Calibration, gather
    from kakeyaturbo.recipes import recipe

    model_dir, n = _two_head_sizes(tiny_model_dir, tmp_path)
    text = tiny_model_dir / "text.txt"
    small = (recipe.HERE / "calibrated-4bit.toml").read_text()
    for a, b in (('"calibrated-4bit"', '"small-4bit"'), ("windows = 16\nwindow = 1024", "windows = 2\nwindow = 64"),
                 ("sensitivity_windows = 16\nscore = 256", "sensitivity_windows = 2\nscore = 16")):
        assert a in small
        small = small.replace(a, b)
    rec_path = tmp_path / "small-4bit.toml"
    rec_path.write_text(small)
    rec = recipes.load(rec_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    # Before anything is cached: the windows of the statistics and the sensitivity, once.
    todo = gather.missing(rec, model, tok, model_dir, str(text), all_groups=True)
    assert [(w, c) for w, _, c in todo] == [("statistics", 2), ("sensitivity", 2)]
    assert gather.missing(rec, model, tok, model_dir, str(text)) == todo

    def run(out: str) -> dict:
        assert cli.main(["eval", "--model", str(model_dir), "--text", str(text), "--calibration-text", "same",
                         "--windows", "2", "--ctx", "48", "--n-eval", "8", "--recipes", str(rec_path),
                         "--baselines", "", "--peers", "", "--out", str(tmp_path / out)]) == 0
        return json.loads((tmp_path / out / "results.json").read_text())["methods"]["kakeyaturbo:small-4bit"]

    capsys.readouterr()
    first = run("eval-1")
    err = capsys.readouterr().err
    assert "statistics on 2 windows" in err and "sensitivity on 2 windows" in err  # both groups in one pass
    # Every layer coded: a raw sliding layer would hold a third of the elements at 16 bits.
    assert first["bits_per_element"] < 5.0 and 0 < first["kl"] < 1.0
    assert len(list((cache_dir / "calibration").glob("*layers1x*.safetensors"))) == 2  # the sliding group's pair
    again = run("eval-2")  # from the cache: nothing gathered, the same figures
    assert "calibrating once" not in capsys.readouterr().err
    assert (again["bits_per_element"], again["kl"]) == (first["bits_per_element"], first["kl"])
    pairs = gather.for_recipe_groups(rec, model, tok, model_dir, str(text))
    assert [st.layer_index for st, _ in pairs] == [(1, 2), (0,)]
    assert gather.for_recipe(rec, model, tok, model_dir, str(text))[0].layer_index == (1, 2)
    # `calibrate` (no --out) writes those same cache files for every group.
    shutil.rmtree(cache_dir)
    assert cli.main(["calibrate", "--model", str(model_dir), "--text", str(text), "--calibration-text", "same",
                     "--windows", "2", "--window", "64", "--sensitivity-windows", "2", "--score", "16"]) == 0
    assert gather.missing(rec, model, tok, model_dir, str(text), all_groups=True) == []
    # A recipe naming a calibration file of both groups gives both; one naming a statistics file, one.
    cal = Calibration.for_model(model, *pairs[0], groups=pairs[1:]).save(tmp_path / "g.kkcal")
    named = replace(rec, calibration=replace(rec.calibration, path=str(cal)))
    assert len(gather.for_recipe_groups(named, model, tok, model_dir)) == 2
    pairs[0][0].save(tmp_path / "s.safetensors")
    pairs[0][1].save(tmp_path / "z.safetensors")
    files = replace(rec, calibration=replace(rec.calibration, path=str(tmp_path / "s.safetensors"),
                                             sensitivity_path=str(tmp_path / "z.safetensors")))
    assert [st.layer_index for st, _ in gather.for_recipe_groups(files, model, tok, model_dir)] == [(1, 2)]


def test_latent_attention_model_directory(tiny_model_dir, tmp_path, cache_dir) -> None:
    """A DeepSeek V3 checkpoint (multi-head latent attention): calibrate on the rows its cache
    holds, eval with the calibration file (identity exact), and a cache from the file."""
    import torch
    import transformers

    from kakeyaturbo.cache import KakeyaCache
    from kakeyaturbo.calibration import Calibration

    model_dir = _checkpoint(tiny_model_dir, tmp_path / "tiny-deepseek", transformers.DeepseekV3Config,
                            transformers.DeepseekV3ForCausalLM, num_key_value_heads=4, kv_lora_rank=32,
                            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            first_k_dense_replace=1, n_group=1, topk_group=1)
    text = tiny_model_dir / "text.txt"
    cal = tmp_path / "d.kkcal"
    assert cli.main(["calibrate", "--model", str(model_dir), "--text", str(text), "--calibration-text", "same",
                     "--windows", "2", "--window", "64", "--sensitivity-windows", "2", "--score", "16",
                     "--samples", "20", "--out", str(cal)]) == 0
    assert Calibration.load(cal).stats.dims == (32, 8)
    out = tmp_path / "eval-out"
    assert cli.main(["eval", "--model", str(model_dir), "--text", str(text),
                     "--windows", "2", "--ctx", "48", "--n-eval", "8", "--recipes", "calibrated-4bit",
                     "--calibration", str(cal), "--baselines", "identity", "--peers", "", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["methods"]
    assert (res["identity"]["dppl"], res["identity"]["kl"]) == (0.0, 0.0)
    row = res["kakeyaturbo:calibrated-4bit"]
    assert 3.0 < row["bits_per_element"] < 6.0 and 0 <= row["kl"] < 1.0
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cache = KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration=cal, block_size=16)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    assert all(layer.num_sealed() == 2 for layer in cache.layers)
    assert not cache_dir.exists()


def test_dtype_choices() -> None:
    from kakeyaturbo.eval import model

    with pytest.raises(SystemExit):
        cli.main(["eval", "--dtype", "int8"])
    assert model.resolve_dtype("bfloat16", "nowhere") == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        model.resolve_dtype("half", "nowhere")


def test_recipes_on_both_sides_of_rope_get_their_own_statistics(tiny_model_dir, tmp_path,
                                                                 cache_dir) -> None:
    """Two calibrated recipes with the same [calibration] but keys on either side of RoPE must
    not share statistics (they did: the second was refused for the first's statistics)."""
    text = tiny_model_dir / "text.txt"
    common = ["--model", str(tiny_model_dir), "--text", str(text), "--calibration-text", "same"]
    recipes_ = []
    for side in ("before", "after"):
        body = (f'name = "{side}"\nmode = "calibrated"\nn_sink = 1\n[calibration]\nwindows = 2\n'
                f'window = 96\n[k]\nbits = 3.9\nrope = "{side}"\n[v]\nbits = 3.9\n')
        (tmp_path / f"{side}.toml").write_text(body)
        recipes_.append(str(tmp_path / f"{side}.toml"))
    out = tmp_path / "out"
    assert cli.main(["eval", *common, "--windows", "1", "--ctx", "64", "--n-eval", "8",
                     "--recipes", ",".join(recipes_), "--baselines", "identity",
                     "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())["methods"]
    assert {"kakeyaturbo:before", "kakeyaturbo:after"} <= set(res)
    made = sorted(p.name for p in (cache_dir / "calibration").glob("*.safetensors"))
    assert len(made) == 2 and sum("ropeafter" in n for n in made) == 1, made


def test_calibrate_on_a_text_of_fewer_windows_says_so_and_records_them(tiny_model_dir, tmp_path, cache_dir,
                                                                       capsys) -> None:
    """--windows beyond what the text's calibration split holds: a warning, the estimate and the
    file's record count the windows used."""
    from kakeyaturbo.calibration import Calibration

    short = tmp_path / "short.txt"
    short.write_text("\n\n".join((tiny_model_dir / "text.txt").read_text().split("\n\n")[:40]) + "\n")
    cal = tmp_path / "c.kkcal"
    assert cli.main(["calibrate", "--model", str(tiny_model_dir), "--text", str(short), "--windows", "500",
                     "--window", "96", "--sensitivity-windows", "0", "--samples", "20", "--out", str(cal)]) == 0
    err = capsys.readouterr().err
    used = Calibration.load(cal).settings["windows"]
    assert 0 < used < 500
    assert f"holds only {used} windows of 96 tokens: the statistics use {used}, not the 500 of --windows" in err
    assert f"statistics on {used} windows" in err and "500 windows" not in err.replace("the 500 of", "")
    settings = Calibration.load(cal).settings  # --score is unused without sensitivity windows
    assert settings["sensitivity_windows"] == 0 and settings["score"] is None


def test_eval_says_what_it_ignores_and_records_where_calibrations_came_from(
        tiny_model_dir, gemma3_bf16_dir, tmp_path, cache_dir, capsys) -> None:
    """Options that would do nothing are warned of (--calibration without a calibrated recipe,
    --attribute without a recipe, one window's intervals); nothing to run after the peers are
    skipped is an error that leaves earlier results alone; results record each recipe's
    calibration."""
    text = tiny_model_dir / "text.txt"
    common = ["--model", str(tiny_model_dir), "--text", str(text), "--ctx", "16", "--n-eval", "4", "--peers", ""]
    out = tmp_path / "o"
    assert cli.main(["eval", *common, "--windows", "1", "--recipes", "balanced", "--baselines", "identity",
                     "--calibration", str(text), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"warning: --calibration {text} is unused: no calibrated recipe among --recipes" in err
    assert "warning: one window: the 95 % intervals" in err
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["calibration"] == {} and meta["calibration_text"] is None
    assert cli.main(["eval", *common, "--windows", "2", "--recipes", "", "--baselines", "identity",
                     "--attribute", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: --attribute is unused" in err and "one window" not in err
    # Every method skipped (QuantizedCache takes full-attention models only): an error, before
    # any pass, the results of the run before untouched.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert cli.main(["eval", "--model", str(gemma3_bf16_dir), "--text", str(text), "--ctx", "16", "--n-eval", "4",
                     "--recipes", "", "--baselines", "", "--peers", "quanto-int4", "--out", str(out)]) == 1
    assert "error: nothing to evaluate: every method asked for was skipped" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_calibrate_out_is_written_where_the_cache_cannot_be(tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    """With --out, a mixture's per-domain statistics are cached only where the cache can be
    written: an unusable cache folder is a warning, not the loss of the statistics gathered."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setattr(assets, "CACHE", blocker)
    out = tmp_path / "cal.safetensors"
    assert cli.main(["calibrate", "--model", str(tiny_model_dir), "--calibration-text", "mixture:wiki-en=1,code=1",
                     "--windows", "2", "--window", "64", "--sensitivity-windows", "0", "--samples", "20",
                     "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert out.is_file() and "warning: statistics of wiki-en not cached (cannot make the folder" in err
    assert blocker.read_text() == "a file where the cache folder would be"


def test_compressed_attention_model_directory(tiny_model_dir, tmp_path, cache_dir) -> None:
    """A DeepSeek V4 checkpoint (compressed attention: an HCA, a CSA and a sliding layer) through
    the commands: calibrate (statistics of its compressor's entries), eval with the calibrated
    recipe and a baseline (the identity exact, QuantizedCache skipped)."""
    import transformers

    model_dir = _checkpoint(tiny_model_dir, tmp_path / "tiny-v4", transformers.DeepseekV4Config,
                            transformers.DeepseekV4ForCausalLM, num_key_value_heads=1, head_dim=32,
                            qk_rope_head_dim=8, q_lora_rank=32, o_lora_rank=16, o_groups=2,
                            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2,
                            index_head_dim=16, index_topk=3, sliding_window=8, hc_mult=2,
                            num_nextn_predict_layers=0,
                            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                            layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                         "sliding_attention"])
    res = _calibrate_then_eval(model_dir, tiny_model_dir, tmp_path, tmp_path / "v4.kkcal", window=96, samples=8,
                               ctx=80, baselines="identity,fp8_e4m3")
    assert "quanto-int4" not in res  # QuantizedCache lacks the compressor's state
    assert res["identity"]["kl"] == 0.0
    # The windows' rows stay raw (16 bits): more than the entries' 4, fewer than all raw.
    assert 4 < res["kakeyaturbo:calibrated-4bit"]["bits_per_element"] < 16
    assert res["kakeyaturbo:calibrated-4bit"]["kl"] > 0 and res["fp8_e4m3"]["kl"] > 0
