"""What :func:`kakeyaturbo.eval.model.load` refuses, and the tokenizer it gives a GGUF file: tiny
random-weight checkpoints and tiny GGUF files written here, no download."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")
from safetensors.torch import load_file, save_file  # noqa: E402

from kakeyaturbo import assets  # noqa: E402
from kakeyaturbo.errors import (CorruptDataError, ModelMismatchError,  # noqa: E402
                                UnsupportedModelError)
from kakeyaturbo.eval import model  # noqa: E402

SENTENCE = "hello world, these are some words of a test"


def _word_tokenizer(size: int):
    """A word-level tokenizer of ``size`` ids (every word it does not know is ``<unk>``)."""
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, size)}}
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")


def _checkpoint(out: Path, tie: bool = False, vocab: int = 97, tokenizer=None) -> Path:
    """A random-weight Llama (hidden size 32, 2 layers) and a tokenizer saved into ``out``."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=0, eos_token_id=1, tie_word_embeddings=tie)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    (tokenizer or _word_tokenizer(vocab)).save_pretrained(out)
    return out


def _rewrite_weights(ckpt: Path, edit) -> dict:
    """Replaces ``ckpt``'s safetensors by ``edit(its tensors)``; returns the original tensors."""
    f = ckpt / "model.safetensors"
    sd = load_file(str(f))
    save_file(edit(dict(sd)), str(f), metadata={"format": "pt"})
    return sd


def _write_gguf(path: Path, tokenizer_json: Path, arch: str = "llama", hidden: int = 48) -> Path:
    """A tiny float32 GGUF (2 layers, random weights, tied embeddings) whose byte-level BPE
    tokenizer is the one ``tokenizer_json`` describes."""
    tj = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    tokens = [""] * len(tj["model"]["vocab"])
    for t, i in tj["model"]["vocab"].items():
        tokens[i] = t
    special = {a["id"] for a in tj.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    n, heads, kv, ff = len(tokens), 4, 2, 64
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(n)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(n)])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    g = np.random.default_rng(0)

    def r(*shape: int) -> np.ndarray:
        return (g.standard_normal(shape) * 0.05).astype(np.float32)

    kvd = kv * hidden // heads
    w.add_tensor("token_embd.weight", r(n, hidden))
    for b in range(2):
        for name, t in (("attn_norm", np.ones(hidden, np.float32)), ("attn_q", r(hidden, hidden)),
                        ("attn_k", r(kvd, hidden)), ("attn_v", r(kvd, hidden)),
                        ("attn_output", r(hidden, hidden)),
                        ("ffn_norm", np.ones(hidden, np.float32)), ("ffn_gate", r(ff, hidden)),
                        ("ffn_up", r(ff, hidden)), ("ffn_down", r(hidden, ff))):
            w.add_tensor(f"blk.{b}.{name}.weight", t)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    """A tiny valid GGUF (320-token byte-level BPE vocabulary, hidden size 48), alone in a folder."""
    return _write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                       tiny_model_dir / "tokenizer.json")


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """Where :mod:`tempfile` makes folders during the test (to see that load leaves none)."""
    d = tmp_path / "private-tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _ids(tok) -> list:
    return tok.encode(SENTENCE, add_special_tokens=False)


# --- a GGUF's tokenizer and config come from the file alone -------------------------------------

def test_a_gguf_beside_another_models_files_is_read_with_its_own_tokenizer_and_config(
        tiny_gguf, tmp_path, private_tmp) -> None:
    crowded = _checkpoint(tmp_path / "crowded")  # config.json, tokenizer files, safetensors
    os.symlink(tiny_gguf, crowded / "tiny.gguf")
    foreign = transformers.AutoTokenizer.from_pretrained(crowded)
    m0, tok0 = model.load(tiny_gguf)
    m, tok = model.load(crowded / "tiny.gguf")
    assert _ids(foreign) != _ids(tok0)  # the folder's tokenizer would show
    assert _ids(tok) == _ids(tok0) and len(tok) == len(tok0)
    assert (m.config.vocab_size, m.config.hidden_size) == (320, 48)
    assert torch.equal(m.model.embed_tokens.weight, m0.model.embed_tokens.weight)
    assert tok.name_or_path == m.config.name_or_path == str(crowded / "tiny.gguf")
    assert not list(private_tmp.iterdir())  # the private folder is gone


@pytest.mark.slow
def test_the_default_gguf_beside_another_tokenizer_keeps_its_own(tiny_model_dir, tmp_path) -> None:
    p = assets.default_model()
    clean, crowded = tmp_path / "clean", tmp_path / "crowded"
    clean.mkdir()
    crowded.mkdir()
    os.symlink(p, clean / p.name)
    os.symlink(p, crowded / p.name)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (crowded / name).write_bytes((tiny_model_dir / name).read_bytes())
    own = transformers.AutoTokenizer.from_pretrained(clean, gguf_file=p.name)
    m, tok = model.load(crowded / p.name)
    assert len(tok) == len(own) == m.config.vocab_size == 49152
    assert _ids(tok) == _ids(own)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tiny_model_dir, tmp_path) -> None:
    big = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)  # 320 tokens
    ckpt = _checkpoint(tmp_path / "ckpt", vocab=97, tokenizer=big)
    with pytest.raises(ModelMismatchError, match=r"has 320 tokens, more than .* of 97"):
        model.load(ckpt)


# --- weights a checkpoint lacks are not made up ----------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
def test_a_normal_checkpoint_loads_its_own_weights(tmp_path, tie) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", tie=tie)
    stored = load_file(str(ckpt / "model.safetensors"))
    assert ("lm_head.weight" in stored) is not tie
    m, _ = model.load(ckpt)
    assert torch.equal(m.model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert torch.equal(m.lm_head.weight, stored["lm_head.weight" if not tie
                                                else "model.embed_tokens.weight"])


@pytest.mark.parametrize("tie", [False, True])
def test_a_checkpoint_whose_weights_have_other_names_is_refused(tmp_path, tie) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", tie=tie)
    _rewrite_weights(ckpt, lambda sd: {f"backbone.{k}": v for k, v in sd.items()})
    with pytest.raises(CorruptDataError) as e:
        model.load(ckpt)
    msg = str(e.value)
    assert str(ckpt) in msg and "model.embed_tokens.weight" in msg and "backbone." in msg


def test_a_checkpoint_missing_one_weight_is_refused(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt", tie=True)
    _rewrite_weights(ckpt, lambda sd: {k: v for k, v in sd.items()
                                       if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(CorruptDataError, match=r"1 missing \(model\.layers\.1\.mlp\.up_proj"):
        model.load(ckpt)


def test_a_checkpoint_with_a_weight_of_another_shape_is_refused(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    _rewrite_weights(ckpt, lambda sd: {**sd, "model.layers.0.mlp.down_proj.weight":
                                       torch.zeros(3, 3)})
    with pytest.raises(CorruptDataError, match="shapes differ"):
        model.load(ckpt)


# --- a GGUF file that cannot be read, a model type that cannot be loaded --------------------------

def _damaged(blob: bytes) -> dict:
    """Damaged variants of the valid GGUF ``blob``."""
    g = np.random.default_rng(1)
    return {
        "empty": b"",
        "no-magic": blob[:3],
        "cut-in-header": blob[:10],
        "cut-in-metadata": blob[:200],
        "cut-in-tensor-data": blob[:len(blob) // 2],
        "one-byte-short": blob[:-1],
        "garbage-after-magic": b"GGUF" + g.bytes(4000),
        "garbage-after-header": b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + g.bytes(4000),
        "key-of-2^62-bytes": b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2 ** 62) + b"x" * 8,
    }


def test_a_damaged_gguf_is_corrupt_data_naming_the_file(tiny_gguf, tmp_path, private_tmp) -> None:
    for name, blob in _damaged(tiny_gguf.read_bytes()).items():
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(blob)
        with pytest.raises(CorruptDataError) as e:
            model.load(p)
        msg = str(e.value)
        assert msg.startswith(f"GGUF file '{p}' cannot be read: "), (name, msg)
        assert "\n" not in msg and len(msg) < 300 + len(str(p)), (name, msg)
        assert str(private_tmp) not in msg, (name, msg)
    assert not list(private_tmp.iterdir())


@pytest.mark.parametrize("arch, what", [("foobar", "foobar"), ("t5", "'t5'")])
def test_a_gguf_of_an_architecture_transformers_cannot_load_is_unsupported(
        tiny_model_dir, tmp_path, arch, what) -> None:
    p = _write_gguf(tmp_path / f"{arch}.gguf", tiny_model_dir / "tokenizer.json", arch=arch)
    with pytest.raises(UnsupportedModelError) as e:
        model.load(p)
    assert str(e.value).startswith(f"GGUF file '{p}' holds ") and what in str(e.value)


def test_a_non_causal_model_type_is_unsupported(tmp_path) -> None:
    ckpt = tmp_path / "t5"
    transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(ckpt)
    with pytest.raises(UnsupportedModelError) as e:
        model.load(ckpt)
    assert str(e.value) == (f"checkpoint '{ckpt}' holds a 't5' model, which is not a causal LM "
                            f"transformers can load")


def test_an_unknown_model_type_is_unsupported(tmp_path) -> None:
    ckpt = _checkpoint(tmp_path / "foobar")
    cfg = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    cfg.update(model_type="foobar", architectures=["FooForCausalLM"])
    (ckpt / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    with pytest.raises(UnsupportedModelError) as e:
        model.load(ckpt)
    assert str(e.value) == (f"checkpoint '{ckpt}' has model type 'foobar', which transformers "
                            f"does not know")


@pytest.mark.parametrize("exc", [MemoryError, KeyboardInterrupt])
def test_an_interrupt_or_out_of_memory_is_not_turned_into_a_data_error(
        tiny_gguf, monkeypatch, exc) -> None:
    def fail(*args, **kwargs):
        raise exc()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    with pytest.raises(exc):
        model.load(tiny_gguf)
