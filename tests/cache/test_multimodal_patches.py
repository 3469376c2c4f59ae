"""The cache in two more multimodal checkpoints as users load them, on tiny random-weight models
with a text prompt and a prompt holding an image (``test_multimodal.py``'s checks), one position
per token (no multimodal RoPE): GOT-OCR2 (``GotOcr2ForConditionalGeneration``: a SAM-style vision
encoder whose features, downsampled by two strided convolutions, take the image tokens' places
in a Qwen2 decoder) and Fuyu (``FuyuForCausalLM``: the image's patches linearly embedded into a
Persimmon decoder, q/k LayerNorm before a partial rotary). The identity codec generates as
``DynamicCache``; attention over the codes (``qwen2`` and ``persimmon`` are in
``fast.FAMILIES``) as the same cache decoding its blocks; keys coded before RoPE are the model's
keys before RoPE (its k_proj's, its k_layernorm's), the image's tokens included."""

from __future__ import annotations

from functools import lru_cache

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo.cache import fast as fast_mod  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .test_multimodal import _TEXT, check_fast, check_identity, check_keys  # noqa: E402

NAMES = ["got_ocr2", "fuyu"]
_IMAGE = 90
#: The decoder family each checkpoint is served through.
DECODER = {"got_ocr2": "qwen2", "fuyu": "persimmon"}


@lru_cache(maxsize=None)
def _build(name: str):
    torch.manual_seed(0)
    t = transformers
    if name == "got_ocr2":  # 128-pixel images in 16-pixel patches: 8 x 8, then two stride-2 convolutions: 4 tokens
        cfg = t.GotOcr2Config(text_config=dict(_TEXT, model_type="qwen2"), vision_config=dict(
            hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2, image_size=128,
            patch_size=16, mlp_dim=64, window_size=4, global_attn_indexes=[1]), image_token_id=_IMAGE)
        m = t.GotOcr2ForConditionalGeneration(cfg).eval()
        # Its initialisation leaves the image's features near 1e-22: drawn again, so the image weighs.
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in [*m.model.vision_tower.parameters(), *m.model.multi_modal_projector.parameters()]:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        return m
    assert name == "fuyu"  # 4 patches of 4 x 4 pixels, each one token
    text = {k: v for k, v in _TEXT.items() if k not in ("num_key_value_heads", "head_dim")}
    cfg = t.FuyuConfig(text_config=text, patch_size=4, num_channels=3, image_token_id=_IMAGE)
    return t.FuyuForCausalLM(cfg).eval()


def _inputs(name: str, image: bool, seed: int = 1):
    """20 text tokens, or 6, the image's 4 tokens and 12 more."""
    g = torch.Generator().manual_seed(1)
    if not image:
        return {"input_ids": torch.randint(3, 80, (1, 20), generator=g)}
    ids = torch.cat([torch.randint(3, 80, (1, 6), generator=g), torch.full((1, 4), _IMAGE),
                     torch.randint(3, 80, (1, 12), generator=g)], dim=1)
    px = torch.Generator().manual_seed(seed)
    if name == "got_ocr2":
        return {"input_ids": ids, "pixel_values": torch.randn(1, 3, 128, 128, generator=px)}
    return {"input_ids": ids, "pixel_values": torch.randn(1, 4, 3 * 4 * 4, generator=px)}


@pytest.mark.parametrize("name", NAMES)
def test_served_through_the_decoder_s_family_and_the_image_weighs(name) -> None:
    """The layout is the decoder's (on the fast path, no multimodal rotation), and the image
    weighs on the logits (another image, other logits)."""
    m = _build(name)
    layout = describe(m)
    assert layout.model_type == DECODER[name] in fast_mod.FAMILIES
    assert not any(r.multimodal for r in layout.rope.layers if r is not None)
    with torch.no_grad():
        a = m(**_inputs(name, True)).logits
        b = m(**_inputs(name, True, seed=2)).logits
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("image", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_identity_codec_generates_as_dynamic_cache(name, image) -> None:
    check_identity(_build(name), _inputs(name, image), name)


@pytest.mark.parametrize("rope", ["after", "before"])
@pytest.mark.parametrize("image", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_attention_over_the_codes_as_decode_then_attend(name, image, rope) -> None:
    check_fast(_build(name), _inputs(name, image), rope, name)


@pytest.mark.parametrize("name", NAMES)
def test_keys_are_coded_without_rope(name) -> None:
    """Keys coded before RoPE are GOT-OCR2's k_proj outputs and Fuyu's k_layernorm outputs (its
    rotated first half turned back, the rest as it was), the image's tokens included."""
    m = _build(name)
    attn = m.model.language_model.layers[0].self_attn
    cache = check_keys(m, _inputs(name, True), 0, attn.k_proj if name == "got_ocr2" else attn.k_layernorm)
    assert cache._positions.grid is None
