"""The cache in multimodal checkpoints' decoders, as users load them (``...ForConditionalGeneration``
of Gemma 3, Gemma 4 Unified, Emu3, Idefics3, SmolVLM, Mistral 3, Qwen2-VL, Qwen 2.5-VL, Qwen3-VL and
Qwen 3.5: a vision tower, Gemma 4 Unified's patch projection or Emu3's VQ tokenizer before the text
model), on tiny
random-weight models: text-only prompts, and prompts with an image for the Qwen models, whose
multimodal RoPE gives the image tokens positions of their own, the Gemma models, whose image
tokens attend to each other both ways (also in a call after sealed blocks), Emu3, whose image
becomes tokens of the decoder's vocabulary, and Idefics3 and SmolVLM, whose text model (as Emu3's)
lies under ``model.text_model``. The identity codec generates as
``DynamicCache`` (keys coded as cached and without RoPE), and attention over the codes as the
same cache decoding its blocks, with a calibrated codec of keys after and before RoPE; keys
coded before RoPE are the model's keys before its multimodal RoPE, and a saved prefix keeps the
image's positions."""

from __future__ import annotations

import struct
import zlib
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402

from kakeyaturbo.cache import IdentityCodec, KakeyaCache, compress_cache, persist  # noqa: E402
from kakeyaturbo.errors import CorruptDataError, InvalidInputError  # noqa: E402

from .conftest import damaged_loads_or_refuses, fast_codec, fast_recipe  # noqa: E402

VOCAB = 97
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2)
#: The Qwen models' special tokens, inside the tiny vocabulary.
_IDS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
#: Gemma 3's image tokens (its 4 soft tokens between the start and end of the image).
_GEMMA_IDS = dict(image_token_index=90, boi_token_index=92, eoi_token_index=93)


@lru_cache(maxsize=None)
def _build(name: str):
    torch.manual_seed(0)
    t = transformers
    if name == "gemma3":
        cfg = t.Gemma3Config(text_config=dict(_TEXT, sliding_window=8),
                             vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, image_size=28, patch_size=14),
                             mm_tokens_per_image=4, **_GEMMA_IDS)
        return t.Gemma3ForConditionalGeneration(cfg).eval()
    if name == "gemma4_unified":  # no vision tower: merged pixel patches projected into the decoder
        cfg = t.Gemma4UnifiedConfig(
            text_config=dict(_TEXT, sliding_window=8, per_layer_config={},
                             layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
            vision_config=dict(patch_size=2, pooling_kernel_size=1, mm_embed_dim=32, mm_posemb_size=16,
                               output_proj_dims=32),
            audio_config=None, image_token_id=90, video_token_id=91, boi_token_id=92, eoi_token_id=93, boa_token_id=94,
            eoa_token_index=95, audio_token_id=96)
        return t.Gemma4UnifiedForConditionalGeneration(cfg).eval()
    if name == "emu3":  # a VQ-VAE turns the image into tokens of the decoder's vocabulary
        vocab = {"<image>": 90, "<|extra_200|>": 91, **{f"<|visual token {i:06d}|>": 80 + i for i in range(8)}}
        cfg = t.Emu3Config(text_config=dict(_TEXT), vocabulary_map=vocab, vq_config=dict(
            codebook_size=8, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1, 1],
            num_res_blocks=1, attn_resolutions=[], hidden_size=32, num_attention_heads=1, temporal_downsample_factor=1))
        return t.Emu3ForConditionalGeneration(cfg).eval()
    if name in ("idefics3", "smolvlm"):  # a Llama under model.text_model
        config, model = ((t.Idefics3Config, t.Idefics3ForConditionalGeneration) if name == "idefics3"
                         else (t.SmolVLMConfig, t.SmolVLMForConditionalGeneration))
        cfg = config(text_config=dict(_TEXT, model_type="llama"), image_token_id=90, scale_factor=1,
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, image_size=28, patch_size=14))
        return model(cfg).eval()
    if name == "idefics2":  # a Mistral under model.text_model; a perceiver resamples the image to 4 tokens
        cfg = t.Idefics2Config(text_config=dict(_TEXT, model_type="mistral", sliding_window=8), image_token_id=90,
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=28, patch_size=14),
                               perceiver_config=dict(resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                                                     resampler_head_dim=16, num_key_value_heads=1))
        return t.Idefics2ForConditionalGeneration(cfg).eval()
    if name == "mistral3":
        cfg = t.Mistral3Config(text_config=dict(_TEXT, model_type="mistral", sliding_window=8),
                               vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                                                  image_size=28, patch_size=14))
        return t.Mistral3ForConditionalGeneration(cfg).eval()
    if name == "qwen2_vl":
        cfg = t.Qwen2VLConfig(text_config=dict(_TEXT, rope_parameters=_MROPE),
                              vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2), **_IDS)
        return t.Qwen2VLForConditionalGeneration(cfg).eval()
    if name == "qwen3_vl":  # interleaved multimodal RoPE sections, deepstack visual features
        cfg = t.Qwen3VLConfig(text_config=dict(_TEXT, rope_parameters=dict(_MROPE, mrope_interleaved=True)),
                              vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0], num_position_embeddings=64),
                              **_IDS)
        return t.Qwen3VLForConditionalGeneration(cfg).eval()
    if name == "qwen2_5_vl":
        cfg = t.Qwen2_5_VLConfig(text_config=dict(_TEXT, rope_parameters=_MROPE), vision_config=_QWEN_VISION, **_IDS)
        return t.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    assert name == "qwen3_5"
    text = dict(_TEXT, layer_types=["linear_attention", "full_attention", "linear_attention"],
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                rope_parameters=dict(_MROPE, partial_rotary_factor=1.0))
    return t.Qwen3_5ForConditionalGeneration(t.Qwen3_5Config(text_config=text, vision_config=_QWEN_VISION,
                                                             **_IDS)).eval()


def _inputs(name: str, image):
    """A prompt of 20 text tokens, or (``image``) 6 text tokens, an image of 2 x 2 merged patches
    between its start and end tokens, and 12 more; ``image="batch"``: that prompt and a
    left-padded one with an image of its own elsewhere."""
    g = torch.Generator().manual_seed(1)
    if not image:
        return {"input_ids": torch.randint(3, 80, (1, 20), generator=g)}
    if name == "emu3":  # an 8 x 8 image: 4 x 4 codes and an end of line per row, 20 placeholders
        ids = torch.cat([torch.randint(3, 80, (1, 6), generator=g), torch.full((1, 20), 90),
                         torch.randint(3, 80, (1, 10), generator=g)], dim=1)
        return {"input_ids": ids, "pixel_values": torch.randn(1, 3, 8, 8, generator=g),
                "image_sizes": torch.tensor([[8, 8]])}
    if name in ("idefics2", "idefics3", "smolvlm"):  # a 28 x 28 image: 2 x 2 patches (or 4 latents), 4 placeholders
        ids = torch.cat([torch.randint(3, 80, (1, 6), generator=g), torch.full((1, 4), 90),
                         torch.randint(3, 80, (1, 10), generator=g)], dim=1)
        return {"input_ids": ids, "pixel_values": torch.randn(1, 1, 3, 28, 28, generator=g)}
    if name.startswith("gemma"):  # 4 image tokens, bidirectional among themselves by the model's mask
        ids = torch.cat([torch.randint(3, 80, (1, 6), generator=g), torch.tensor([[92, 90, 90, 90, 90, 93]]),
                         torch.randint(3, 80, (1, 12), generator=g)], dim=1)
        if name == "gemma3":  # a 28 x 28 image, its token types marking the image tokens
            return {"input_ids": ids, "pixel_values": torch.randn(1, 3, 28, 28, generator=g),
                    "token_type_ids": (ids == 90).long()}
        return {"input_ids": ids, "pixel_values": torch.randn(1, 4, 2 * 2 * 3, generator=g),  # 2 x 2 patches
                "image_position_ids": torch.tensor([[[0, 0], [1, 0], [0, 1], [1, 1]]])}
    if image == "batch":
        img = torch.tensor([92, 90, 90, 90, 90, 93])
        def text(n):
            return torch.randint(3, 80, (n,), generator=g)

        ids = torch.stack([torch.cat([text(6), img, text(12)]),
                           torch.cat([torch.zeros(3, dtype=torch.long), text(2), img, text(13)])])
        return {"input_ids": ids, "attention_mask": (torch.arange(24)[None] >= torch.tensor([[0], [3]])).long(),
                "pixel_values": torch.randn(32, 3 * 2 * 14 * 14, generator=g),
                "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]), "mm_token_type_ids": (ids == 90).int()}
    ids = torch.cat([torch.randint(3, 80, (1, 6), generator=g), torch.tensor([[92, 90, 90, 90, 90, 93]]),
                     torch.randint(3, 80, (1, 12), generator=g)], dim=1)
    # mm_token_type_ids marks the image tokens, as the processor does: without them the model
    # gives every token one position (no multimodal RoPE).
    return {"input_ids": ids, "pixel_values": torch.randn(16, 3 * 2 * 14 * 14, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]]), "mm_token_type_ids": (ids == 90).int()}


def _generate(model, inputs, cache):
    out = model.generate(**inputs, cache=cache, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


CASES = [("gemma3", False), ("gemma3", True), ("gemma4_unified", False), ("gemma4_unified", True), ("emu3", False),
         ("emu3", True), ("idefics2", False), ("idefics2", True), ("idefics3", False), ("idefics3", True), ("smolvlm", False),
         ("smolvlm", True), ("mistral3", False), ("qwen2_vl", True), ("qwen2_vl", "batch"), ("qwen2_5_vl", False),
         ("qwen2_5_vl", True), ("qwen3_vl", True), ("qwen3_5", False), ("qwen3_5", True)]


def check_identity(m, inputs, name) -> None:
    """The identity codec (keys as cached, and without RoPE) generates as ``DynamicCache``."""
    seq, logits = _generate(m, inputs, transformers.DynamicCache(config=m.config))
    for pre in (False, True):
        s, lg = _generate(m, inputs, KakeyaCache(IdentityCodec(pre_rope_keys=pre), model=m, block_size=4, n_sink=1))
        assert torch.equal(s, seq), (name, pre)
        # keys without RoPE: taken off and put back at float32 rounding
        assert (lg - logits).abs().max().item() <= (0.0 if not pre else 1e-5), (name, pre)


def check_fast(m, inputs, rope, name) -> None:
    """Attention over the codes of a calibrated codec (keys coded ``rope`` RoPE) as the same
    cache decoding its blocks: the same tokens, logits within 1e-5, blocks sealed."""
    codec = fast_codec(m, fast_recipe(rope), rope)
    fast = KakeyaCache(codec, model=m, block_size=4, n_sink=1, synthesis="f32")
    slow = KakeyaCache(codec, model=m, block_size=4, n_sink=1, fast=False)
    assert fast.fast, fast.fast_reason
    s_f, l_f = _generate(m, inputs, fast)
    s_s, l_s = _generate(m, inputs, slow)
    assert torch.equal(s_f, s_s), name
    assert (l_f - l_s).abs().max().item() <= 1e-5, name
    assert any(layer.num_sealed() for layer in fast.layers if hasattr(layer, "num_sealed"))


@pytest.mark.parametrize("name, image", CASES)
def test_identity_codec_generates_as_dynamic_cache(name, image) -> None:
    check_identity(_build(name), _inputs(name, image), name)


@pytest.mark.parametrize("rope", ["after", "before"])
@pytest.mark.parametrize("name, image", CASES)
def test_attention_over_the_codes_as_decode_then_attend(name, image, rope) -> None:
    check_fast(_build(name), _inputs(name, image), rope, name)


class _Recorder(IdentityCodec):
    """The identity codec (keys without RoPE), keeping the key rows of one (layer, kv-head) it codes."""

    def __init__(self, layer: int) -> None:
        super().__init__(pre_rope_keys=True)
        self.layer, self.rows = layer, []

    def encode(self, stream, layer, head, x):
        if stream == "k" and layer == self.layer and head == 0:
            self.rows.append(np.array(x))
        return super().encode(stream, layer, head, x)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_keys_are_coded_without_multimodal_rope(name) -> None:
    """With an image, keys coded before RoPE are the model's keys before RoPE: the image tokens'
    three positions and the text's after the image (behind the token's index) are taken off, at
    prefill and at every generated token."""
    m = _build(name)
    layers = m.model.language_model.layers
    i = next(j for j, layer in enumerate(layers) if hasattr(layer, "self_attn"))
    attn = layers[i].self_attn
    cache = check_keys(m, _inputs(name, True), i, getattr(attn, "k_norm", None) or attn.k_proj)
    # the 2 x 2 image tokens' (temporal, height, width): three of the four differ
    assert cache._positions.grid is not None and len(cache._positions.triples) == 3


def coded_keys(m, inputs, layer: int, module=None):
    """Generates with an identity codec of keys before RoPE: the key rows of (``layer``, kv-head
    0) the codec was handed, the outputs (kv-head 0, head_dim 16) of ``module`` (none where
    None), and the cache."""
    seen = []
    hook = None if module is None else module.register_forward_hook(
        lambda _m, _a, out: seen.append(out.detach().reshape(out.shape[0], out.shape[1], -1, 16)[0, :, 0]))
    codec = _Recorder(layer)
    cache = KakeyaCache(codec, model=m, block_size=4, n_sink=1)
    try:
        _generate(m, inputs, cache)
    finally:
        if hook is not None:
            hook.remove()
    return np.concatenate(codec.rows), seen, cache


def check_keys(m, inputs, layer: int, module):
    """The key rows coded before RoPE are ``module``'s outputs (the model's keys before RoPE),
    the prompt's image and the tokens after it included; returns the cache."""
    got, seen, cache = coded_keys(m, inputs, layer, module)
    want = torch.cat(seen).numpy()
    assert len(got) >= 24  # the prompt's image and the tokens after it were coded
    # the sink row (position 0) is held raw; the coded rows follow it
    np.testing.assert_allclose(got, want[1:1 + len(got)], rtol=0, atol=1e-5)
    return cache


def test_saved_prefix_keeps_the_multimodal_positions(tmp_path) -> None:
    """A cache holding an image's multimodal positions saves them (a version-2 file) and loads
    as it was: the same positions and keys; a file that claims them in version 1, or whose
    three rows do not begin with the positions, is damage."""
    m = _build("qwen2_vl")
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m, block_size=4, n_sink=1)
    _generate(m, _inputs("qwen2_vl", True), cache)
    path = cache.save(tmp_path / "image.kkpfx")
    header, _ = persist.read_header(path)
    assert header["grid"] == header["positions"] == cache.get_seq_length()
    loaded = KakeyaCache.load(path, m)
    a, b = cache._positions, loaded._positions
    assert torch.equal(a.pos, b.pos) and torch.equal(a.grid, b.grid) and torch.equal(a.extra, b.extra)
    assert a.triples == b.triples
    for x, y in zip(cache.layers, loaded.layers):
        for s, t in zip(x.materialize(), y.materialize()):
            assert torch.equal(s, t)

    def damaged(data: bytes, name: str):
        data = bytearray(data)
        struct.pack_into("<I", data, len(data) - 4, zlib.crc32(bytes(data[:-4])))
        (tmp_path / name).write_bytes(bytes(data))
        return tmp_path / name

    data = path.read_bytes()
    old = bytearray(data)
    struct.pack_into("<H", old, 4, 1)
    with pytest.raises(CorruptDataError, match="version 1 holds no multimodal"):
        KakeyaCache.load(damaged(old, "v1.kkpfx"), m)
    t = cache.get_seq_length()
    off = bytearray(data)  # the grid closes the file: its temporal row is the first of three
    struct.pack_into("<i", off, len(data) - 4 - 4 * 3 * t, 5)
    with pytest.raises(CorruptDataError, match="multimodal positions"):
        KakeyaCache.load(damaged(off, "grid.kkpfx"), m)


def test_compress_cache_takes_the_multimodal_positions() -> None:
    """``compress_cache`` of a filled ``DynamicCache`` given the ``[3, batch, T]`` positions the
    model rotated by (its ``get_rope_index``) codes the keys before RoPE; ``[3, ...]`` positions
    for a rotation without multimodal sections are refused before anything changes."""
    m = _build("qwen2_vl")
    inputs = _inputs("qwen2_vl", True)
    seen = []
    hook = m.model.language_model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda _m, _a, out: seen.append(out.detach().reshape(1, out.shape[1], -1, 16)[0, :, 0]))
    cache = transformers.DynamicCache(config=m.config)
    try:
        with torch.no_grad():
            m(**inputs, cache=cache, use_cache=True)
    finally:
        hook.remove()
    grid, _ = m.model.get_rope_index(inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
                                     mm_token_type_ids=inputs["mm_token_type_ids"])
    codec = _Recorder(0)
    compress_cache(cache, codec, positions=grid, model=m)
    np.testing.assert_allclose(codec.rows[0], seen[0].numpy(), rtol=0, atol=1e-5)
    flat = _build("gemma3")
    g = transformers.DynamicCache(config=flat.config)
    with torch.no_grad():
        flat(**_inputs("gemma3", False), cache=g, use_cache=True)
    before = g.layers[0].keys.clone()
    with pytest.raises(InvalidInputError, match=r"positions must be \[T\] or \[batch=1, T\] with"):
        compress_cache(g, IdentityCodec(pre_rope_keys=True), positions=torch.arange(20)[None, None].expand(3, 1, 20),
                       model=flat)
    assert torch.equal(g.layers[0].keys, before)


def test_only_the_model_s_rotary_calls_are_recorded() -> None:
    """Inside a forward call of the cache's, the multimodal positions the model calls its rotary
    module with are kept for the layers' updates; the cache's own calls of that module (taking
    RoPE off sealed rows, building tables: an empty tensor first) are not."""
    m = _build("qwen2_vl")
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m, block_size=4, n_sink=1)
    grid = torch.tensor([[[7]], [[7]], [[8]]])
    cache._undo = ()  # as between the cache's hooks around a forward call
    cache.rope.layers[0](grid)
    assert cache._positions.pending_grid is None
    m.model.language_model.rotary_emb(torch.zeros(1, 1, 16), grid)
    assert cache._positions.pending_grid is grid
    cache._undo = None  # outside any call of the cache's: nothing is taken
    cache._positions.expect(None)
    m.model.language_model.rotary_emb(torch.zeros(1, 1, 16), grid)
    assert cache._positions.pending_grid is None


@lru_cache(maxsize=None)
def _image_prefix(tmp: str) -> bytes:
    m = _build("qwen2_vl")
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m, block_size=4, n_sink=1)
    _generate(m, _inputs("qwen2_vl", True), cache)
    return cache.save(f"{tmp}/image.kkpfx").read_bytes()


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_damage_to_a_saved_image_prefix_is_a_kakeya_error(tmp_path_factory, data) -> None:
    """A version-2 file (multimodal positions at its end) damaged anywhere, the checksum
    recomputed: it loads, or it is refused with a KakeyaError; nothing else escapes."""
    raw = _image_prefix(str(tmp_path_factory.getbasetemp()))
    tail = data.draw(st.booleans())  # the positions and the three rows, or anywhere
    where = st.integers(len(raw) - 4 - 16 * 31 if tail else 0, len(raw) - 5)
    damaged_loads_or_refuses(raw, data, where, st.integers(0, 255), tmp_path_factory.mktemp("fuzz") / "f.kkpfx",
                             lambda p: KakeyaCache.load(p, _build("qwen2_vl")))


@pytest.mark.parametrize("name", ["gemma3", "gemma4_unified"])
def test_an_image_after_sealed_blocks(name) -> None:
    """A prompt fed in two calls, the image (its tokens attending to each other both ways) in the
    second, after blocks of the first were sealed: through the codes as through decoded blocks,
    and an exact codec as ``DynamicCache``."""
    m, inputs = _build(name), _inputs(name, True)
    ids = inputs["input_ids"]
    rest = {k: v for k, v in inputs.items() if k != "input_ids"}
    if "token_type_ids" in rest:
        rest["token_type_ids"] = rest["token_type_ids"][:, 5:]

    def run(cache):
        with torch.no_grad():
            m(input_ids=ids[:, :5], cache=cache, use_cache=True)
            return m(input_ids=ids[:, 5:], cache=cache, use_cache=True, **rest).logits

    ref = run(transformers.DynamicCache(config=m.config))
    assert torch.equal(run(KakeyaCache(IdentityCodec(), model=m, block_size=4, n_sink=1)), ref)
    codec = fast_codec(m, fast_recipe("after"), "after")
    fast = KakeyaCache(codec, model=m, block_size=4, n_sink=1, synthesis="f32")
    got = run(fast)
    assert fast.fast and fast.layers[0].num_sealed() >= 1
    want = run(KakeyaCache(codec, model=m, block_size=4, n_sink=1, fast=False))
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
