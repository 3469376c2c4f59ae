"""The cache in multimodal checkpoints whose decoder is Qwen3 with one position per token
(LLaVA-OneVision-1.5, Ovis2.5: a vision tower whose features take the image tokens' places, no
multimodal RoPE), on tiny random-weight models (``...ForConditionalGeneration``), with a text
prompt and a prompt holding an image as the processor lays it out (``test_multimodal.py``'s
checks): the identity codec generates as ``DynamicCache``; attention over the codes (``qwen3``
is in ``fast.FAMILIES``) as the same cache decoding its blocks; keys coded before RoPE are the
model's keys before RoPE, the image's tokens included."""

from __future__ import annotations

from functools import lru_cache

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo.cache import fast as fast_mod  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .test_multimodal import _TEXT, check_fast, check_identity, check_keys  # noqa: E402

NAMES = ["llava_onevision1_5", "ovis2_5"]
#: The image's tokens (placeholders between its start and end tokens) in the tiny vocabulary.
_IMAGE, _START, _END = 90, 92, 93


@lru_cache(maxsize=None)
def _build(name: str):
    torch.manual_seed(0)
    t = transformers
    text = dict(_TEXT, model_type="qwen3")
    if name == "llava_onevision1_5":  # RICE-ViT: 14-pixel patches, 2 x 2 merged, a class token per frame
        cfg = t.LlavaOnevision15Config(text_config=text, vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
            spatial_merge_size=2), image_token_id=_IMAGE, video_token_id=91, vision_start_token_id=_START,
            vision_end_token_id=_END)
        return t.LlavaOnevision15ForConditionalGeneration(cfg).eval()
    assert name == "ovis2_5"  # visual tokens from a visual vocabulary; the start and end tokens its indicators
    cfg = t.Ovis2_5Config(text_config=text, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
        image_size=56, window_size=56, vocab_size=16), image_token_id=_IMAGE, video_token_id=91,
        image_start_token_id=_START, image_end_token_id=_END, video_start_token_id=94, video_end_token_id=95)
    return t.Ovis2_5ForConditionalGeneration(cfg).eval()


def _inputs(image: bool, seed: int = 1):
    """20 text tokens, or 6, an image of 4 x 4 patches merged 2 x 2 (4 tokens) between its start
    and end tokens, and 12 more."""
    g = torch.Generator().manual_seed(1)
    if not image:
        return {"input_ids": torch.randint(3, 80, (1, 20), generator=g)}
    ids = torch.cat([torch.randint(3, 80, (1, 6), generator=g), torch.tensor([[_START] + [_IMAGE] * 4 + [_END]]),
                     torch.randint(3, 80, (1, 12), generator=g)], dim=1)
    pixels = torch.randn(16, 3 * 14 * 14, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 4, 4]]),
            "mm_token_type_ids": (ids == _IMAGE).int()}


@pytest.mark.parametrize("name", NAMES)
def test_the_image_is_seen_at_one_position_per_token(name) -> None:
    """The decoder is ``qwen3`` (on the fast path), its rotary module called with the tokens'
    indices (no multimodal positions, no multimodal rotation read), and the image weighs on the
    logits (another image, other logits)."""
    m = _build(name)
    assert describe(m).model_type == "qwen3" and "qwen3" in fast_mod.FAMILIES
    assert not any(r.multimodal for r in describe(m).rope.layers)
    calls = []
    h = m.model.language_model.rotary_emb.register_forward_pre_hook(
        lambda _m, args, kwargs: calls.append(args[1] if len(args) > 1 else kwargs["position_ids"]), with_kwargs=True)
    try:
        with torch.no_grad():
            a = m(**_inputs(True)).logits
            b = m(**_inputs(True, seed=2)).logits
    finally:
        h.remove()
    assert torch.equal(calls[0], torch.arange(24)[None])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("image", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_identity_codec_generates_as_dynamic_cache(name, image) -> None:
    check_identity(_build(name), _inputs(image), name)


@pytest.mark.parametrize("rope", ["after", "before"])
@pytest.mark.parametrize("image", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_attention_over_the_codes_as_decode_then_attend(name, image, rope) -> None:
    check_fast(_build(name), _inputs(image), rope, name)


@pytest.mark.parametrize("name", NAMES)
def test_keys_are_coded_without_rope(name) -> None:
    """Keys coded before RoPE are the k_norm's outputs, the image's tokens included; no
    multimodal positions held."""
    m = _build(name)
    cache = check_keys(m, _inputs(True), 0, m.model.language_model.layers[0].self_attn.k_norm)
    assert cache._positions.grid is None
