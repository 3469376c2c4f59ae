"""The calibration cache: an entry's name identifies what made it (a text file by its content, a
checkpoint directory by its weights), entries are written atomically, and an entry that cannot
be read is collected again (with a warning) rather than failing every later run."""

from __future__ import annotations

import pathlib
import shutil
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import assets, recipes  # noqa: E402
from kakeyaturbo.calibration import AttentionStats, corpus, gather  # noqa: E402


def _settings() -> recipes.CalibrationSettings:
    return replace(recipes.CalibrationSettings().checked(), windows=2, window=32)


def _fake_stats() -> AttentionStats:
    z = np.zeros((1, 1, 2, 2))
    return AttentionStats(meta={"windows": 1}, q2=z, k_mean=z[..., 0], k_cov=z, v_mean=z[..., 0], v_cov=z,
                          o_gram=z, k_samples=np.zeros((1, 1, 1, 2), np.float32),
                          v_samples=np.zeros((1, 1, 1, 2), np.float32))


# --- keys ------------------------------------------------------------------------------------


def test_text_files_of_one_name_but_other_content_have_other_keys(tmp_path) -> None:
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    a, b, c = tmp_path / "A" / "text.txt", tmp_path / "B" / "text.txt", tmp_path / "text.txt"
    a.write_text("one text\n\nof two paragraphs\n", encoding="utf-8")
    b.write_text("quite another\n\ntext\n", encoding="utf-8")
    c.write_bytes(a.read_bytes())
    ka, kb, kc = corpus.key(str(a)), corpus.key(str(b)), corpus.key(str(c))
    assert ka != kb and ka == kc and ka.startswith("text-")
    st = _settings()
    assert gather.stats_path("m.gguf", a, st) != gather.stats_path("m.gguf", b, st)
    assert corpus.meta(str(a))["corpus_key"] == ka
    # Rewritten in place: a new key.
    a.write_text("edited\n", encoding="utf-8")
    assert corpus.key(str(a)) != ka


def test_named_domains_and_the_shipped_text_keep_their_keys() -> None:
    assert corpus.key("wiki-en") == "summaries_en-us"
    try:
        from kakeyaturbo.calibration import sources

        shipped = sources.wiki_path("wiki-en")
    except Exception as e:  # the data package is not installed
        pytest.skip(f"no shipped text here: {e}")
    assert corpus.key(str(shipped)) == "summaries_en-us"  # the default text's cache stays valid


def _checkpoint(path: pathlib.Path, seed: int) -> pathlib.Path:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_checkpoint_directories_of_one_name_but_other_weights_have_other_keys(tmp_path) -> None:
    m1 = _checkpoint(tmp_path / "m1" / "model", 0)
    m2 = _checkpoint(tmp_path / "m2" / "model", 1)  # same name, same shapes, other weights
    st = _settings()
    p1, p2 = gather.stats_path(m1, "wiki-en", st), gather.stats_path(m2, "wiki-en", st)
    assert p1 != p2 and p1.name.startswith("model-d") and p2.name.startswith("model-d")
    assert gather.stats_path(m1, "wiki-en", st) == p1  # stable
    assert gather.sensitivity_path(m1, "wiki-en", st, 1) != gather.sensitivity_path(m2, "wiki-en", st, 1)
    # Weights rewritten in place: a new key.
    shutil.copyfile(m2 / "model.safetensors", m1 / "model.safetensors")
    assert gather.stats_path(m1, "wiki-en", st) != p1
    # A model file keeps the key it always had: stem and size.
    f = tmp_path / "small.gguf"
    f.write_bytes(b"x" * 10)
    assert gather.stats_path(f, "wiki-en", st).name.startswith("small-10-summaries_en-us-2x32-")


# --- writes ----------------------------------------------------------------------------------


def test_an_interrupted_save_leaves_no_half_entry(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c" / "s.safetensors"
    orig = pathlib.Path.write_text

    def interrupted(self, *a, **k):
        if self.suffix == ".json":  # the sidecar's temporary file
            raise KeyboardInterrupt
        return orig(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _fake_stats().save(path)
    assert list(path.parent.iterdir()) == []  # neither file, no temporary left
    monkeypatch.setattr(pathlib.Path, "write_text", orig)
    _fake_stats().save(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["s.safetensors", "s.safetensors.json"]
    # An interrupted rewrite keeps the entry that was there.
    monkeypatch.setattr(pathlib.Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        AttentionStats(meta={"windows": 2}, **{k: getattr(_fake_stats(), k) for k in AttentionStats.ARRAYS}).save(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["s.safetensors", "s.safetensors.json"]
    assert AttentionStats.load(path).meta == {"windows": 1}


# --- unreadable entries ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    return model, tok, tiny_model_dir, tiny_model_dir / "text.txt"


@pytest.mark.parametrize("damage", ["no sidecar", "truncated", "garbage sidecar", "another model"])
def test_an_unreadable_cache_entry_is_collected_again(tiny, tmp_path, monkeypatch, damage) -> None:
    model, tok, model_dir, text = tiny
    monkeypatch.setattr(assets, "CACHE", tmp_path)
    st = _settings()
    rec = recipes.load("calibrated-4bit")
    rec = replace(rec, calibration=replace(st, sensitivity_windows=1, score=8, corpus=str(text)))
    path = gather.stats_path(model_dir, text, st)
    side = path.with_name(path.name + ".json")
    _fake_stats().save(path)
    if damage == "another model":  # a key shared with another model's entry (same name and size)
        AttentionStats(meta={"fingerprint": "0" * 32}, **{k: getattr(_fake_stats(), k)
                                                          for k in AttentionStats.ARRAYS}).save(path)
    elif damage == "no sidecar":
        side.unlink()
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    else:
        side.write_text("{not json", encoding="utf-8")
    assert ("statistics", str(text), 2) in gather.missing(rec, model, tok, model_dir)
    with pytest.warns(UserWarning, match="(cannot be read|made for another model).*collecting it again"):
        got = gather.cached_stats(model, tok, model_dir, text, st, samples=8)
    assert got.meta["windows"] == 2 and got.num_layers == 2
    back = AttentionStats.load(path)  # rewritten, readable
    np.testing.assert_array_equal(back.k_cov, got.k_cov)
