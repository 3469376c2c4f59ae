"""A calibration that travels with the model: made once for a model, turned into the cache in
one call, refused for any other model."""

from __future__ import annotations

import pytest

from .conftest import KV_HEADS, LAYERS, VOCAB, build, generate, prompt, torch, transformers

from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import KakeyaCache  # noqa: E402
from kakeyaturbo.errors import CorruptDataError, InvalidParameterError, ModelMismatchError  # noqa: E402


@pytest.fixture(scope="module")
def cal_file(llama_calibration):
    return llama_calibration


def test_from_pretrained_equals_the_codec_built_by_hand(llama, cal_file) -> None:
    path, stats, sens = cal_file
    cache = KakeyaCache.from_pretrained(llama, "calibrated-4bit", calibration=path, block_size=16)
    assert cache.n_sink == 1 and cache.codec.pre_rope_keys
    rec = recipes.load("calibrated-4bit")
    by_hand = KakeyaCache(calibration.ModelCodec(stats, rec, sensitivity=sens), model=llama,
                          block_size=16, n_sink=1)
    a_seq, a_logits = generate(llama, prompt(t=40), cache, n=6)
    b_seq, b_logits = generate(llama, prompt(t=40), by_hand, n=6)
    assert torch.equal(a_seq, b_seq) and torch.equal(a_logits, b_logits)
    assert cache.layers[0].num_sealed() == 2
    for key in cache.codec.codecs:
        assert cache.codec.codecs[key].fingerprint == by_hand.codec.codecs[key].fingerprint


def test_a_recipe_may_point_at_the_file(llama, cal_file, tmp_path) -> None:
    path, _, _ = cal_file
    from kakeyaturbo.recipes import recipe as recipe_module

    text = (recipe_module.HERE / "calibrated-3bit.toml").read_text()
    rec = tmp_path / "mine.toml"
    rec.write_text(text.replace("[calibration]\n", f"[calibration]\npath = {str(path)!r}\n"))
    cache = KakeyaCache.from_pretrained(llama, rec, block_size=16)
    seq, _ = generate(llama, prompt(t=40), cache, n=4)
    assert seq.shape[1] == 44


def test_fingerprint_is_stable_across_dtypes_and_sees_any_change(llama) -> None:
    fp = calibration.fingerprint(llama)
    assert fp == calibration.fingerprint(build("llama"))  # the same weights, built again
    bf16 = build("llama").to(torch.bfloat16)
    assert calibration.fingerprint(bf16) == fp
    other = build("llama")
    with torch.no_grad():
        other.model.layers[1].self_attn.v_proj.weight[3, 5] += 0.5
    assert calibration.fingerprint(other) != fp


def test_a_file_for_another_model_is_refused(llama, qwen2, llama32, cal_file) -> None:
    path, _, _ = cal_file
    with pytest.raises(ModelMismatchError, match="made for a 'llama' model, not 'qwen2'"):
        KakeyaCache.from_pretrained(qwen2, "calibrated-4bit", calibration=path)
    with pytest.raises(ModelMismatchError, match=r"\(2, 2, 16\).*\(3, 2, 32\)|\(3, 2, 16\).*\(3, 2, 32\)"):
        KakeyaCache.from_pretrained(llama32, "calibrated-4bit", calibration=path)
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=LAYERS, num_attention_heads=4,
                                   num_key_value_heads=KV_HEADS, head_dim=16, max_position_embeddings=512)
    retrained = transformers.LlamaForCausalLM(cfg).eval()  # same shapes, other weights
    with pytest.raises(ModelMismatchError, match="llama.kkcal.*made for another model: fingerprint"):
        KakeyaCache.from_pretrained(retrained, "calibrated-4bit", calibration=path)


def test_missing_or_damaged_calibration(llama, cal_file, tmp_path) -> None:
    with pytest.raises(InvalidParameterError, match="is calibrated: pass calibration=FILE"):
        KakeyaCache.from_pretrained(llama, "calibrated-4bit")
    with pytest.raises(InvalidParameterError, match="per-block: it takes no calibration"):
        KakeyaCache.from_pretrained(llama, "balanced", calibration=cal_file[0])
    bad = tmp_path / "bad.safetensors"
    data = bytearray(cal_file[0].read_bytes())
    data[-3] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptDataError, match="bad.safetensors.*damaged"):
        KakeyaCache.from_pretrained(llama, "calibrated-4bit", calibration=bad)
    cache = KakeyaCache.from_pretrained(llama, "balanced", block_size=16)  # per-block: no file needed
    assert cache.n_sink == recipes.load("balanced").n_sink
