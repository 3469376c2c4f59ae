"""Cross-attention layers (Llama 3.2 Vision, ``mllama``): a tiny random-weight
``MllamaForConditionalGeneration`` whose layer 1 attends over an image's K/V rows, 34 of them (2
tiles of 4 x 4 patches and a class token each), more than the prompt's 21 tokens. The layout marks
the layer ``"cross"`` (no RoPE, no statistics: text-only forwards skip it); the cache holds its
rows beside the tokens' (raw for a calibrated codec, coded by a per-block one) and hands them back
as the model reads them at every step, without a sink or positions of their own."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import recipes  # noqa: E402
from kakeyaturbo.calibration import ModelCodec  # noqa: E402
from kakeyaturbo.cache import BlockCodec, IdentityCodec, KakeyaCache, compress_cache  # noqa: E402
from kakeyaturbo.errors import UnsupportedModelError  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .conftest import fast_codec, fast_recipe, saved_and_loaded_go_on_alike  # noqa: E402
from .family_base import _COMMON  # noqa: E402

T_TEXT, IMAGE_ROWS, CROSS = 21, 34, 1


def _build():
    torch.manual_seed(0)
    text = dict(_COMMON, num_key_value_heads=2, cross_attention_layers=[CROSS])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=56, patch_size=14, max_num_tiles=2, vision_output_dim=64,
                  intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1], [1, 2]])
    cfg = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=96)
    return transformers.MllamaForConditionalGeneration(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return _build()


def _inputs(batch: int = 1, image: bool = True):
    """``batch`` prompts of 21 tokens, an image token third, each with an image of two tiles that
    the tokens from the image token on attend to (a left-padded second row: 3 padding tokens)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (batch, T_TEXT), generator=g)
    mask = torch.ones(batch, T_TEXT, dtype=torch.long)
    if batch > 1:
        ids[1, :3], mask[1, :3] = 0, 0
    if not image:
        return {"input_ids": ids, "attention_mask": mask}
    ids[:, 3] = 96
    cross = torch.zeros(batch, T_TEXT, 1, 2, dtype=torch.long)
    cross[:, 3:] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "pixel_values": torch.randn(batch, 1, 2, 3, 56, 56, generator=g),
            "aspect_ratio_ids": torch.full((batch, 1), 2),
            "aspect_ratio_mask": torch.ones(batch, 1, 2, dtype=torch.long), "cross_attention_mask": cross}


def _generate(model, inputs, cache, n: int = 8):
    out = model.generate(**inputs, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


@pytest.fixture(scope="module")
def reference(model):
    return {b: _generate(model, _inputs(b), transformers.DynamicCache(config=model.config)) for b in (1, 2)}


@pytest.fixture(scope="module")
def codec(model):
    """A calibrated codec (keys before RoPE) fitted on text alone, as every calibration is."""
    return fast_codec(model, fast_recipe("before"), "before")


def test_layout_marks_the_cross_attention_layer(model) -> None:
    layout = describe(model)
    assert [s.kind for s in layout.layers] == ["full", "cross", "full"]
    assert layout.kv_layers == (0, 2)
    assert layout.rope.layer(CROSS) is None and layout.rope.layer(0) is not None
    assert (layout.layers[CROSS].kv_heads, layout.layers[CROSS].head_dim) == (2, 16)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("pre_rope", [False, True])
def test_identity_codec_generates_as_dynamic_cache(model, reference, batch, pre_rope) -> None:
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=pre_rope), model=model, block_size=4, n_sink=1)
    seq, logits = _generate(model, _inputs(batch), cache)
    assert torch.equal(seq, reference[batch][0])
    assert (logits - reference[batch][1]).abs().max().item() <= 1e-5
    layer = cache.layers[CROSS]
    assert layer.get_seq_length() == IMAGE_ROWS and layer.num_sealed() == IMAGE_ROWS // 4
    assert layer.rope is None and layer.positions is None and not layer.pre_rope


@pytest.mark.parametrize("batch", [1, 2])
def test_calibrated_codec_holds_the_image_rows_raw(model, codec, batch) -> None:
    """Fitted on text, the codec has no statistics of the cross layer: its rows stay raw and are
    counted; attention over the codes (the other layers) gives decode-then-attend's tokens."""
    fast = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32")
    slow = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=False)
    assert fast.fast, fast.fast_reason
    (s_f, l_f), (s_s, l_s) = _generate(model, _inputs(batch), fast), _generate(model, _inputs(batch), slow)
    assert torch.equal(s_f, s_s)
    assert (l_f - l_s).abs().max().item() <= 1e-5
    cross = fast.layers[CROSS]
    assert cross.streams == () and not cross.fast
    raw = 2 * batch * 2 * IMAGE_ROWS * 16 * 4  # K and V, kv-heads, rows, head_dim, float32
    assert cross.memory() == {"blobs": 0, "sink": 0, "staging": raw, "decoded": 0}
    assert cross.nbytes_uncompressed() == raw
    assert fast.layers[0].num_sealed() and fast.layers[2].num_sealed()


def test_the_model_reads_the_held_rows_without_a_copy(model, codec) -> None:
    """The model reads a raw cross layer's rows at every step: they are its staging tensors."""
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    _generate(model, _inputs(), cache, n=2)
    layer = cache.layers[CROSS]
    assert layer.keys.data_ptr() == layer.raw_rows()[2].data_ptr()
    assert layer.values.data_ptr() == layer.raw_rows()[3].data_ptr()


def test_a_per_block_recipe_codes_the_image_rows(model, reference) -> None:
    cache = KakeyaCache.from_recipe(recipes.load("balanced"), model=model, block_size=8)
    _generate(model, _inputs(), cache)
    dyn = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(**_inputs(), cache=dyn)
    layer = cache.layers[CROSS]
    assert layer.num_sealed() == IMAGE_ROWS // 8 and layer.memory()["blobs"] > 0
    for got, want in ((layer.keys, dyn.layers[CROSS].keys), (layer.values, dyn.layers[CROSS].values)):
        assert got.shape == want.shape
        assert float((got - want).norm() / want.norm()) < 0.2


def test_text_alone_leaves_the_cross_layer_empty(model, codec) -> None:
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    want = _generate(model, _inputs(image=False), transformers.DynamicCache(config=model.config))
    got = _generate(model, _inputs(image=False), cache)
    assert torch.equal(got[0], want[0])
    assert not cache.layers[CROSS].is_initialized


@pytest.mark.parametrize("per_block", [False, True])
def test_a_saved_prefix_with_an_image_goes_on_alike(model, codec, tmp_path, per_block) -> None:
    """The image rows saved raw (a calibrated codec) or as sealed blocks (a per-block recipe)."""
    if per_block:
        codec = BlockCodec(recipes.load("balanced"), pre_rope_keys=True)
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    inputs = _inputs()
    with torch.no_grad():
        model(**inputs, cache=cache)
    more = torch.cat([inputs["input_ids"], torch.tensor([[5, 6, 7]])], dim=1)
    loaded = saved_and_loaded_go_on_alike(model, codec, cache, more, tmp_path / "p.kkc", n=4)
    assert np.array_equal(loaded.layers[CROSS].keys.numpy(), cache.layers[CROSS].keys.numpy())
    assert loaded.layers[CROSS].num_sealed() == (IMAGE_ROWS // 4 if per_block else 0)


def test_compress_cache_codes_the_image_rows_without_a_sink(model, codec) -> None:
    """As the cache holds them: a per-block codec (here the exact identity) codes every image row,
    no sink kept; a calibrated codec leaves them raw, bit for bit, and counts them."""
    sinks = 2 * 2 * 2 * 16  # the two self-attention layers' first rows, K and V, two kv-heads
    image = 2 * 2 * IMAGE_ROWS * 16
    for c, raw in ((IdentityCodec(), sinks), (codec, sinks + image)):
        dyn = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(**_inputs(), cache=dyn)
        before = dyn.layers[CROSS].keys.clone()
        out = compress_cache(dyn, c, n_sink=1, model=model)
        assert out["raw_elements"] == raw and out["elements"] == 2 * 2 * 2 * T_TEXT * 16 + image
        assert torch.equal(dyn.layers[CROSS].keys, before)


def test_cross_layers_past_the_last_layer_are_refused() -> None:
    text = dict(_COMMON, num_key_value_heads=2, cross_attention_layers=[1, 7])
    m = transformers.MllamaForCausalLM(transformers.MllamaTextConfig(**text)).eval()
    with pytest.raises(UnsupportedModelError, match=r"cross_attention_layers \[1, 7\] are not layer indices below 3"):
        describe(m)


def test_a_codec_fitted_on_the_text_model_serves_the_composite(model, tmp_path) -> None:
    """`kakeyaturbo calibrate` loads a checkpoint as a causal LM: Llama 3.2 Vision's then loads
    as MllamaForCausalLM, without the vision tower. A codec saved from it (its attention
    weights' fingerprint recorded) serves the composite, image and all."""
    model.save_pretrained(tmp_path / "ckpt")
    text = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    assert type(text).__name__ == "MllamaForCausalLM"
    path = fast_codec(text, fast_recipe("before"), "before").save(tmp_path / "c.kkcodec", model=text)
    codec = ModelCodec.load(path).check_model(model)
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    seq, _ = _generate(model, _inputs(), cache)
    assert cache.fast and seq.shape[1] == T_TEXT + 8 and cache.layers[CROSS].get_seq_length() == IMAGE_ROWS
