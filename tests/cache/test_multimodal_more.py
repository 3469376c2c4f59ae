"""The cache in more multimodal checkpoints' decoders (``test_multimodal.py``'s checks), on tiny
random-weight models with a vision tower and a prompt with one image as the processor lays it
out: Qwen3-VL-MoE, Qwen3.5-MoE (a hybrid), the thinkers of Qwen2.5-Omni and Qwen3-Omni-MoE
(image input only), Cosmos3-Edge, HunYuan-VL and HY-V4-VL.

Each model's rotary module is called with multimodal positions for the image (checked first).
The identity codec generates as ``DynamicCache``; attention over the codes as the same cache
decoding its blocks (every one in ``fast.FAMILIES``); keys coded
before RoPE are the model's keys before RoPE; a saved prefix keeps the positions.

Two families take part differently. HunYuan-VL's multimodal sections (three or four: position,
width, height, image index) split each pair of channels between two positions, so an image
token's map is no rotation and its keys, normalised after it, have no RoPE-free form: the cache
takes the key norm's weight off (as HunYuan's: ``families.keynorm``; the tests draw the norms'
weights, 1 at initialisation) and rotates each token back by its index (``LayerRope.multimodal``
is False), which the identity codec undoes exactly; a text token's keys come out normalised
before RoPE. HY-V4-VL caches a latent row without RoPE and the rotated key part as values, coded
as cached: no positions to take off."""

from __future__ import annotations

from functools import lru_cache

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402

from kakeyaturbo.cache import IdentityCodec, KakeyaCache, persist  # noqa: E402
from kakeyaturbo.cache import fast as fast_mod  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402
from kakeyaturbo.families.layout import model_type  # noqa: E402

from .test_multimodal import (_IDS, _MROPE, _QWEN_VISION, _TEXT, _generate, check_fast, check_identity,  # noqa: E402
                              check_keys, coded_keys)

_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
_AUDIO = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
              output_dim=64)
_QWEN3_VISION = dict(_QWEN_VISION, deepstack_visual_indexes=[0], num_position_embeddings=64)
#: Vision towers of 14-pixel patches on a 4 x 4 grid of them (one image of 56 x 56 pixels).
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14)
_LATENT = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
               v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, index_head_dim=16,
               index_n_heads=4, index_topk=8, indexer_types=["full", "shared", "full"], hc_mult=2,
               learnable_sink_init=1.0)
_OMNI_IDS = dict(video_token_index=91, audio_token_index=94, audio_start_token_id=95, audio_end_token_id=96)


def _rope(sections, **kw):
    return dict(rope_type="default", rope_theta=10000.0, mrope_section=sections, **kw)


def _omni(cfg):
    cfg.vision_start_token_id, cfg.vision_end_token_id = 92, 93  # read by get_rope_index, not in the config class
    return cfg


@lru_cache(maxsize=None)
def _build(name: str):
    torch.manual_seed(0)
    t = transformers
    if name == "qwen3_vl_moe":
        cfg = t.Qwen3VLMoeConfig(text_config=dict(_TEXT, **_MOE, rope_parameters=dict(_MROPE, mrope_interleaved=True)),
                                 vision_config=_QWEN3_VISION, **_IDS)
        return t.Qwen3VLMoeForConditionalGeneration(cfg).eval()
    if name == "qwen3_5_moe":
        text = dict(_TEXT, **_MOE, layer_types=["linear_attention", "full_attention", "linear_attention"],
                    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    shared_expert_intermediate_size=32, rope_parameters=dict(_MROPE, partial_rotary_factor=1.0))
        return t.Qwen3_5MoeForConditionalGeneration(t.Qwen3_5MoeConfig(text_config=text, vision_config=_QWEN_VISION,
                                                                       **_IDS)).eval()
    if name == "qwen2_5_omni":
        cfg = _omni(t.Qwen2_5OmniThinkerConfig(text_config=dict(_TEXT, rope_parameters=_MROPE), audio_config=_AUDIO,
                                               vision_config=dict(_QWEN_VISION, fullatt_block_indexes=[0],
                                                                  window_size=56),
                                               image_token_index=90, **_OMNI_IDS))
        return t.Qwen2_5OmniThinkerForConditionalGeneration(cfg).eval()
    if name == "qwen3_omni_moe":
        cfg = _omni(t.Qwen3OmniMoeThinkerConfig(
            text_config=dict(_TEXT, **_MOE, rope_parameters=dict(_MROPE, mrope_interleaved=True)),
            vision_config=_QWEN3_VISION, audio_config=dict(_AUDIO, downsample_hidden_size=16), image_token_id=90,
            video_token_id=91, audio_token_id=94, audio_start_token_id=95))
        return t.Qwen3OmniMoeThinkerForConditionalGeneration(cfg).eval()
    if name == "cosmos3_edge":
        cfg = t.Cosmos3EdgeConfig(text_config=dict(_TEXT, rope_parameters=_MROPE),
                                  vision_config=dict(_VISION, num_patches=16), projector_hidden_size=64, **_IDS)
        return t.Cosmos3EdgeForConditionalGeneration(cfg).eval()
    if name.startswith("hunyuan_vl"):  # four sections as HunyuanOCR (position, width, height, image index), or three
        sections = [3, 3, 2] if name == "hunyuan_vl3" else [2, 2, 2, 2]
        cfg = t.HunYuanVLConfig(text_config=dict(_TEXT, rope_parameters=_rope(sections)),
                                vision_config=dict(_VISION, max_image_size=56, out_hidden_size=64),
                                image_token_id=90, im_start_id=92, im_end_id=93, im_newline_id=94)
        m = t.HunYuanVLForConditionalGeneration(cfg).eval()
        with torch.no_grad():  # its q/k norms' weights after RoPE (1 at initialisation) drawn in 0.5 .. 1.5
            for layer in m.model.language_model.layers:
                for norm in (layer.self_attn.query_layernorm, layer.self_attn.key_layernorm):
                    norm.weight.copy_(torch.rand(norm.weight.shape) + 0.5)
        return m
    assert name == "hy_v4_vl"
    text = dict({k: v for k, v in _TEXT.items() if k != "head_dim"}, **_LATENT, rope_parameters=_rope([2, 1, 1]))
    cfg = t.HYV4VLConfig(text_config=text, vision_config=dict(_VISION, max_image_size=56, out_hidden_size=64),
                         image_token_id=90, video_token_id=91)
    return t.HYV4VLForConditionalGeneration(cfg).eval()


#: Image tokens for the 4 x 4 patches merged 2 x 2: HunYuan-VL and HY-V4-VL end each row of
#: merged patches with a newline token, HunYuan-VL's span holds the image's begin and end too.
_IMAGE_TOKENS = {"hunyuan_vl": 8, "hunyuan_vl3": 8, "hy_v4_vl": 6}


def _inputs(name: str):
    """6 text tokens, an image between its start and end tokens, 12 more; ``mm_token_type_ids``
    marks the image tokens as the processor does (the Omni thinkers find them by id)."""
    g = torch.Generator().manual_seed(1)
    n = _IMAGE_TOKENS.get(name, 4)
    ids = torch.cat([torch.randint(3, 80, (1, 6), generator=g), torch.tensor([[92] + [90] * n + [93]]),
                     torch.randint(3, 80, (1, 12), generator=g)], dim=1)
    per_patch = 3 * 14 * 14 * (2 if name.startswith("qwen") else 1)  # the Qwen towers' 2 frames per patch
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "image_grid_thw": torch.tensor([[1, 4, 4]]),
           "pixel_values": torch.randn(16, per_patch, generator=g)}
    if "omni" not in name:
        out["mm_token_type_ids"] = (ids == 90).int()
    return out


def _text_model(m):
    return getattr(m.model, "language_model", m.model)


NAMES = ["qwen3_vl_moe", "qwen3_5_moe", "qwen2_5_omni", "qwen3_omni_moe", "cosmos3_edge", "hunyuan_vl", "hunyuan_vl3",
         "hy_v4_vl"]
#: Those whose keys the cache takes RoPE off with the image tokens' own positions.
TRIPLES = ["qwen3_vl_moe", "qwen3_5_moe", "qwen2_5_omni", "qwen3_omni_moe", "cosmos3_edge"]


@pytest.mark.parametrize("name", NAMES)
def test_the_image_takes_multimodal_positions(name) -> None:
    """The prompt exercises multimodal RoPE: the rotary module is called with one row of
    positions per section, differing at image tokens (only); the layers' rotation reads as
    multimodal where each channel pair keeps one angle (not HunYuan-VL's; HY-V4-VL's latent has none)."""
    m = _build(name)
    inputs = _inputs(name)
    calls = []

    def hook(_m, args, kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs["position_ids"])

    h = _text_model(m).rotary_emb.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            m(**inputs, cache=transformers.DynamicCache(config=m.config), use_cache=True)
    finally:
        h.remove()
    p = calls[0]
    assert p.shape == (4 if name == "hunyuan_vl" else 3, 1, inputs["input_ids"].shape[1]), name
    odd = (p != p[:1]).any(dim=0)[0]
    assert odd.any() and bool((inputs["input_ids"][0][odd] == 90).all()), name
    ropes = [r for r in describe(m).rope.layers if r is not None]
    assert [r.multimodal for r in ropes] == [name in TRIPLES] * len(ropes) and (ropes or name == "hy_v4_vl")


@pytest.mark.parametrize("name", NAMES)
def test_identity_codec_generates_as_dynamic_cache(name) -> None:
    """HunYuan-VL with three sections: keys that RoPE were taken off with the image tokens'
    three positions (no rotation there) came back changed."""
    check_identity(_build(name), _inputs(name), name)


@pytest.mark.parametrize("rope", ["after", "before"])
@pytest.mark.parametrize("name", NAMES)
def test_attention_over_the_codes_as_decode_then_attend(name, rope) -> None:
    """Fast = slow (every family here is in ``fast.FAMILIES``, HY-V4-VL's latent attention in
    ``fast.LATENT``); HunYuan-VL's keys, normalised after RoPE, calibrated before RoPE since
    2026-12-08 (the key norm's weight taken off first: ``families.keynorm``)."""
    m = _build(name)
    mt = model_type(m)
    assert mt in fast_mod.FAMILIES and (name != "hy_v4_vl" or mt in fast_mod.LATENT)
    check_fast(m, _inputs(name), rope, name)


def _first_attention(m) -> int:
    return next(j for j, layer in enumerate(_text_model(m).layers) if hasattr(layer, "self_attn"))


@pytest.mark.parametrize("name", TRIPLES)
def test_keys_are_coded_without_multimodal_rope(name) -> None:
    """Keys coded before RoPE are the model's keys before RoPE (its k_norm's or k_proj's), the
    image tokens' positions taken off, at prefill and at every generated token."""
    m = _build(name)
    i = _first_attention(m)
    attn = _text_model(m).layers[i].self_attn
    cache = check_keys(m, _inputs(name), i, getattr(attn, "k_norm", None) or attn.k_proj)
    assert cache._positions.grid is not None and len(cache._positions.triples) == 3


@pytest.mark.parametrize("name", ["hunyuan_vl", "hunyuan_vl3"])
def test_hunyuan_vl_keys_are_rotated_back_by_the_token_index(name) -> None:
    """HunYuan-VL's keys as it caches them (normalised after its RoPE), divided by the key norm's
    weight and turned back by the plain rotation of each token's index: no multimodal positions
    held."""
    m = _build(name)
    i = _first_attention(m)
    got, _, cache = coded_keys(m, _inputs(name), i)
    ref = transformers.DynamicCache(config=m.config)
    _generate(m, _inputs(name), ref)
    k = ref.layers[i].keys[0, 0] / _text_model(m).layers[i].self_attn.key_layernorm.weight.detach()
    cos, sin = _text_model(m).rotary_emb(k, torch.arange(k.shape[0])[None])
    half = k.shape[-1] // 2
    back = k * cos[0] - torch.cat((-k[:, half:], k[:, :half]), dim=-1) * sin[0]
    assert len(got) >= 24 and cache._positions.grid is None
    np.testing.assert_allclose(got, back[1:1 + len(got)].numpy(), rtol=0, atol=1e-5)


class _Both(IdentityCodec):
    """The identity codec keeping the rows of both streams of layer 0 it codes."""

    def __init__(self) -> None:
        super().__init__(pre_rope_keys=True)
        self.rows = {"k": [], "v": []}

    def encode(self, stream, layer, head, x):
        if layer == 0:
            self.rows[stream].append(np.array(x))
        return super().encode(stream, layer, head, x)


def test_hy_v4_vl_codes_the_latent_as_cached() -> None:
    """HY-V4-VL's latent rows (keys) carry no RoPE and its rotated key part (values, turned by the
    image's positions) is coded as cached: the rows coded are the DynamicCache's."""
    m = _build("hy_v4_vl")
    layout = describe(m)
    assert layout.latent and set(layout.rope.layers) == {None}
    codec = _Both()
    cache = KakeyaCache(codec, model=m, block_size=4, n_sink=1)
    _generate(m, _inputs("hy_v4_vl"), cache)
    ref = transformers.DynamicCache(config=m.config)
    _generate(m, _inputs("hy_v4_vl"), ref)
    for stream, held in (("k", ref.layers[0].keys), ("v", ref.layers[0].values)):
        got = np.concatenate(codec.rows[stream])
        assert len(got) >= 24
        np.testing.assert_array_equal(got, held[0, 0, 1:1 + len(got)].numpy())
    assert cache._positions is None or cache._positions.grid is None


@pytest.mark.parametrize("name", ["qwen3_vl_moe", "qwen2_5_omni", "qwen3_omni_moe", "cosmos3_edge", "hunyuan_vl",
                                  "qwen3_5_moe", "hy_v4_vl"])
def test_saved_prefix_keeps_the_positions(name, tmp_path) -> None:
    """A saved cache loads with its positions (the image's three per token where held) and rows
    (the hybrid Qwen3.5-MoE's states and HY-V4-VL's indexer's keys too)."""
    m = _build(name)
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m, block_size=4, n_sink=1)
    _generate(m, _inputs(name), cache)
    path = cache.save(tmp_path / "image.kkpfx")
    header, _ = persist.read_header(path)
    loaded = KakeyaCache.load(path, m)
    a, b = cache._positions, loaded._positions
    if name in TRIPLES:
        assert header["grid"] == header["positions"] == cache.get_seq_length()
        assert torch.equal(a.grid, b.grid) and torch.equal(a.extra, b.extra) and a.triples == b.triples
    else:  # HunYuan-VL: the token indices, not stored
        assert not header.get("grid") and a.grid is None and b.grid is None
    assert torch.equal(a.pos, b.pos)
    for x, y in zip(cache.layers, loaded.layers):
        if not hasattr(x, "materialize"):  # Qwen3.5-MoE's linear-attention layers: their states
            assert all(torch.equal(x.recurrent_states[i], y.recurrent_states[i]) for i in x.recurrent_states)
            continue
        for s, t in zip(x.materialize(), y.materialize()):
            assert torch.equal(s, t)
