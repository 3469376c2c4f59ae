"""The cache in more multimodal checkpoints with multimodal RoPE, as users load them
(``...ForConditionalGeneration``: a vision tower before the text model): GLM-4V, GLM-4V-MoE,
GLM-OCR, GLM-Image, ERNIE 4.5 VL MoE and PaddleOCR-VL, on tiny random-weight models with a prompt
that holds one image, as the processor gives it (image tokens between the start and end tokens,
the image's grid, and ``mm_token_type_ids``, without which these models give every token one
position). Their text models call the rotary module with ``[3, batch, T]`` positions (temporal,
height, width; the ``[4, batch, T]`` that ``generate`` passes loses its text row first), which
differ for the image tokens; GLM-Image also generates an image, whose tokens get positions of
their own at every decoding step.

As in ``test_multimodal.py``: the cache holds the positions the rotary module was called with
(and they differ: the prompt exercises multimodal RoPE); the identity codec generates as
``DynamicCache``; attention over the codes as the same cache decoding its blocks (keys coded after
and before RoPE; these text models are in ``fast.FAMILIES``); keys coded
before RoPE are the model's keys before RoPE; a saved prefix keeps the multimodal positions and
generation goes on from it."""

from __future__ import annotations

from functools import lru_cache

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.cache import fast as fast_mod  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .test_multimodal import _generate, check_fast, check_identity, check_keys  # noqa: E402

_TEXT = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             initializer_range=0.06)
#: The special tokens inside the tiny vocabulary: image, video, image start and end, video start and end.
_IDS = dict(image_token_id=90, video_token_id=91, image_start_token_id=92, image_end_token_id=93,
            video_start_token_id=94, video_end_token_id=95)
_GLM_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, image_size=28)
#: GLM-Image: its generated image's tokens come from a vision vocabulary (below 80), its image
#: start and end tokens among them.
_IMAGE_START, _IMAGE_END, _VISION_VOCAB = 78, 79, 80

NAMES = ["glm4v", "glm4v_moe", "glm_ocr", "glm_image", "ernie4_5_vl_moe", "paddleocr_vl"]
#: Each family's image prompt; a left-padded batch for one family of each ``get_rope_index``, and
#: GLM-Image from text alone (the first positions that differ are those of a generated token).
CASES = ([(n, "image") for n in NAMES] + [(n, "batch") for n in ("glm4v", "ernie4_5_vl_moe", "paddleocr_vl")]
         + [("glm_image", "text")])


def _rope(section, partial: float = 1.0) -> dict:
    return {"rope_type": "default", "rope_theta": 100.0, "mrope_section": section,
            "partial_rotary_factor": partial}


@lru_cache(maxsize=None)
def _build(name: str):
    torch.manual_seed(0)
    t = transformers
    if name == "glm4v":  # partial rotary (half the head), interleaved pairs
        cfg = t.Glm4vConfig(text_config=dict(_TEXT, rope_parameters=_rope([1, 1, 2], 0.5)),
                            vision_config=_GLM_VISION, **_IDS)
        return t.Glm4vForConditionalGeneration(cfg).eval()
    if name == "glm4v_moe":  # partial rotary, rotate_half pairs, a dense layer then a MoE one
        text = dict(_TEXT, rope_parameters=_rope([1, 1, 2], 0.5), head_dim=16, moe_intermediate_size=32,
                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
        return t.Glm4vMoeForConditionalGeneration(t.Glm4vMoeConfig(text_config=text, vision_config=_GLM_VISION,
                                                                   **_IDS)).eval()
    if name == "glm_ocr":
        cfg = t.GlmOcrConfig(text_config=dict(_TEXT, rope_parameters=_rope([2, 3, 3])), vision_config=_GLM_VISION,
                             **_IDS)
        return t.GlmOcrForConditionalGeneration(cfg).eval()
    if name == "glm_image":  # a vision tower and a VQ model turn the source image into tokens
        text = dict(_TEXT, rope_parameters=_rope([2, 3, 3]), vision_vocab_size=_VISION_VOCAB, eos_token_id=_IMAGE_END)
        cfg = t.GlmImageConfig(text_config=text,
                               vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                  patch_size=14, image_size=56, spatial_merge_size=1),
                               vq_config=dict(embed_dim=16, num_embeddings=70, latent_channels=32),
                               image_token_id=90, image_start_token_id=_IMAGE_START, image_end_token_id=_IMAGE_END)
        return t.GlmImageForConditionalGeneration(cfg).eval()
    if name == "ernie4_5_vl_moe":  # sections rotated (height, width, temporal), a dense layer then a MoE one
        text = dict(_TEXT, rope_parameters=_rope([2, 2, 4]), head_dim=16, moe_intermediate_size=[32, 32],
                    moe_num_experts=4, moe_k=2, moe_num_shared_experts=1)
        cfg = t.Ernie4_5_VLMoeConfig(text_config=text,
                                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                        patch_size=14, spatial_merge_size=2, temporal_merge_size=2),
                                     **_IDS)
        return t.Ernie4_5_VLMoeForConditionalGeneration(cfg).eval()
    assert name == "paddleocr_vl"
    cfg = t.PaddleOCRVLConfig(text_config=dict(_TEXT, rope_parameters=_rope([2, 3, 3]), head_dim=16),
                              vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14,
                                                 spatial_merge_size=2),
                              image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
    return t.PaddleOCRVLForConditionalGeneration(cfg).eval()


def _inputs(name: str, prompt: str = "image") -> dict:
    """``prompt="image"``: 6 text tokens, an image of 2 x 2 merged patches (4 x 4 patches of 14
    pixels) between its start and end tokens, and 12 more, as the family's processor gives it;
    ``"batch"``: that prompt and a left-padded one with an image of its own elsewhere. GLM-Image
    (image to image): 6 text tokens, a source image of 4 x 4 tokens, 5 more, and the start of the
    3 x 3 image to generate (the last grid of ``image_grid_thw``); ``"text"``: text to image, 20
    text tokens and the start of the image (no token of the prompt has positions that differ)."""
    g = torch.Generator().manual_seed(1)

    def text(n: int, top: int = 80) -> torch.Tensor:
        return torch.randint(3, top, (n,), generator=g)

    if name == "glm_image" and prompt == "text":
        ids = torch.cat([text(20, 70), torch.tensor([_IMAGE_START])])[None]
        return {"input_ids": ids, "image_grid_thw": torch.tensor([[1, 3, 3]]), "images_per_sample": torch.tensor([1])}
    if name == "glm_image":
        ids = torch.cat([text(6, 70), torch.tensor([_IMAGE_START] + [90] * 16 + [_IMAGE_END]), text(5, 70),
                         torch.tensor([_IMAGE_START])])[None]
        return {"input_ids": ids, "pixel_values": torch.randn(16, 3 * 14 * 14, generator=g),
                "image_grid_thw": torch.tensor([[1, 4, 4], [1, 3, 3]]), "images_per_sample": torch.tensor([2])}
    batch = prompt == "batch"
    img = torch.tensor([92, 90, 90, 90, 90, 93])
    rows = [torch.cat([text(6), img, text(12)])]
    if batch:
        rows.append(torch.cat([torch.zeros(3, dtype=torch.long), text(2), img, text(13)]))
    ids = torch.stack(rows)
    # the patches of each image: 16 rows, of 14 x 14 pixels, two frames for the GLM families
    patch = {"ernie4_5_vl_moe": (3 * 14 * 14,), "paddleocr_vl": (3, 14, 14)}.get(name, (3 * 2 * 14 * 14,))
    out = {"input_ids": ids, "pixel_values": torch.randn(16 * len(rows), *patch, generator=g),
           "image_grid_thw": torch.tensor([[1, 4, 4]] * len(rows)), "mm_token_type_ids": (ids == 90).int()}
    if batch:
        out["attention_mask"] = (torch.arange(24)[None] >= torch.tensor([[0], [3]])).long()
    if name == "ernie4_5_vl_moe":  # its MoE routes image tokens to experts of their own
        out["moe_mm_token_type_ids"] = out["mm_token_type_ids"]
    return out


@pytest.mark.parametrize("name, prompt", CASES)
def test_the_cache_holds_the_positions_the_rotary_module_was_called_with(name, prompt) -> None:
    """The prompt runs the text model's rotary module with ``[3, batch, T]`` positions that differ
    for the image tokens (GLM-Image: and for the generated image's); the cache holds every
    token's three positions as the module was called with them."""
    m = _build(name)
    rotary = m.model.language_model.rotary_emb
    seen = []

    def hook(_m, args, kw) -> None:
        if args[0].numel():  # the model's call (the cache's own hand the module an empty tensor)
            seen.append((args[1] if len(args) > 1 else kw["position_ids"]).detach().clone())

    hook = rotary.register_forward_pre_hook(hook, with_kwargs=True)
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m, block_size=4, n_sink=1)
    inputs = _inputs(name, prompt)
    try:
        _generate(m, inputs, cache)
    finally:
        hook.remove()
    assert all(p.ndim == 3 and p.shape[0] == 3 for p in seen), [tuple(p.shape) for p in seen]
    grid = torch.cat(seen, dim=2)
    assert bool((grid[0] != grid[1]).any() and (grid[1] != grid[2]).any())  # multimodal positions in use
    held = cache._positions
    assert held.grid is not None and torch.equal(held.grid, grid[:, :, :cache.get_seq_length()].int())
    odd = ((grid[0] != grid[1]) | (grid[1] != grid[2]))[:, :cache.get_seq_length()]
    assert torch.equal(held.extra >= 0, odd)
    t = inputs["input_ids"].shape[1]
    assert bool(odd[:, :t].any()) == (prompt != "text")  # the image's tokens
    assert bool(odd[:, t:].any()) == (name == "glm_image")  # the generated image's


@pytest.mark.parametrize("name, prompt", CASES)
def test_identity_codec_generates_as_dynamic_cache(name, prompt) -> None:
    check_identity(_build(name), _inputs(name, prompt), name)


@pytest.mark.parametrize("rope", ["after", "before"])
@pytest.mark.parametrize("name, prompt", CASES)
def test_attention_over_the_codes_as_decode_then_attend(name, prompt, rope) -> None:
    m = _build(name)
    assert describe(m).model_type in fast_mod.FAMILIES
    check_fast(m, _inputs(name, prompt), rope, name)


@pytest.mark.parametrize("name", NAMES)
def test_keys_are_coded_without_multimodal_rope(name) -> None:
    """Keys coded before RoPE are the model's keys before RoPE (its ``k_proj``'s output): the image
    tokens' three positions and the text's after the image (behind the token's index) are taken
    off, at prefill and at every generated token."""
    m = _build(name)
    cache = check_keys(m, _inputs(name), 1, m.model.language_model.layers[1].self_attn.k_proj)
    assert cache._positions.grid is not None and len(cache._positions.triples) >= 3


@pytest.mark.parametrize("name", NAMES)
def test_saved_prefix_keeps_the_multimodal_positions(name, tmp_path) -> None:
    """A saved cache loads with the same positions (the image's three) and keys, and generation
    goes on from it as from the cache it was saved from (GLM-Image's model cannot go on past the
    image it generated, whatever the cache)."""
    m = _build(name)
    inputs = _inputs(name)
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m, block_size=4, n_sink=1)
    seq, _ = _generate(m, inputs, cache)
    loaded = KakeyaCache.load(cache.save(tmp_path / f"{name}.kkpfx"), m)
    a, b = cache._positions, loaded._positions
    assert torch.equal(a.pos, b.pos) and torch.equal(a.grid, b.grid) and torch.equal(a.extra, b.extra)
    assert a.triples == b.triples
    for x, y in zip(cache.layers, loaded.layers):
        for s, t in zip(x.materialize(), y.materialize()):
            assert torch.equal(s, t)
    if name == "glm_image":
        return
    # the prompt and the tokens generated (the image already seen: no pixels, text tokens after it)
    more = {k: v for k, v in inputs.items() if k != "pixel_values"}
    more["input_ids"] = seq
    pad = torch.zeros((1, seq.shape[1] - inputs["input_ids"].shape[1]), dtype=torch.int)
    for key in ("mm_token_type_ids", "moe_mm_token_type_ids"):
        if key in more:
            more[key] = torch.cat([more[key], pad], dim=1)
    s_l, l_l = _generate(m, more, loaded)
    s_c, l_c = _generate(m, more, cache)
    assert torch.equal(s_l, s_c) and torch.equal(l_l, l_c)
    assert loaded._positions.grid.shape[2] == loaded.get_seq_length() == seq.shape[1] + 7
