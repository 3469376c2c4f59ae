"""Multi-token-prediction (MTP) speculative decoding through the cache: ``generate(use_mtp=True)``
(transformers 5.25) drafts tokens with the model's MTP layers (their own ``MtpCache``) and checks
them with the main model, whose cache records the past and is cropped as in assisted decoding."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.modeling_layers import MtpModel  # noqa: E402

from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.errors import InvalidInputError  # noqa: E402

from .conftest import fast_codec, fast_recipe, generate, saved_and_loaded_go_on_alike  # noqa: E402
from .families import build, family_prompt  # noqa: E402
from .family_base import _COMMON, WINDOW  # noqa: E402


@pytest.fixture(autouse=True)
def mtp_layers(monkeypatch):
    """The MTP layers of a tiny model, which has no checkpoint to load them from: MtpModel built
    on the main model (its embedding, head and RoPE) with each layer passing on the main model's
    last hidden state (eh_proj takes that half, the block's weights are zero: a residual), so
    that every draft repeats the token just generated. Drafts are then accepted where the main
    model repeats a token and rejected elsewhere."""

    def from_pretrained(cls, main_model, device_map=None, **kwargs):
        mtp = cls(main_model, main_model.config.get_text_config().num_mtp_layers).eval()
        h = mtp.config.hidden_size
        eye, zero = torch.eye(h), torch.zeros(h, h)
        halves = [eye, zero] if getattr(mtp.config, "mtp_hidden_states_first", False) else [zero, eye]
        with torch.no_grad():
            for layer in mtp.layers:
                for p in layer.mtp_block.parameters():
                    p.zero_()
                layer.eh_proj.weight.copy_(torch.cat(halves, dim=1))
        return mtp

    monkeypatch.setattr(MtpModel, "from_pretrained", classmethod(from_pretrained))


def _model(name: str, mtp: int):
    model = build(name)
    model.config.num_mtp_layers = mtp  # read by transformers' get_mtp_config
    return model


def _crops(cache) -> list:
    """The counts transformers crops ``cache`` by (recorded on the instance)."""
    seen, crop = [], cache.crop

    def recorded(n):
        seen.append(n)
        return crop(n)

    cache.crop = recorded
    return seen


#: family -> (MTP layers, prompt seed, new tokens): the drafts checked include ones all accepted
#: and all rejected (and one in part, for GLM-4-MoE's two layers).
CASES = {"glm4_moe": (2, 7, 16),  # q/k norm, partial rotary; two drafts a step
         "deepseek_v3": (1, 4, 12),  # multi-head latent attention
         "inkling_text": (1, 4, 10)}  # sliding layers, convolution states beside the rows


@pytest.mark.parametrize("name", sorted(CASES))
def test_mtp_decoding_through_the_cache(name) -> None:
    """An exact codec gives DynamicCache's tokens and logits under MTP decoding, with blocks
    sealed on the way (the drafts' rows stay raw until transformers crops the rejected ones)."""
    mtp, seed, n = CASES[name]
    model, ids = _model(name, mtp), family_prompt(seed=seed)
    ref_seq, ref_logits = generate(model, ids, transformers.DynamicCache(config=model.config), n=n, use_mtp=True)
    for codec in (IdentityCodec(), IdentityCodec(pre_rope_keys=True)):
        cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
        crops = _crops(cache)
        seq, logits = generate(model, ids, cache, n=n, use_mtp=True)
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
        assert cache.is_croppable and all(layer.num_sealed() > 0 for layer in cache.layers)
        drafts = crops[1:]  # (the first answers the prompt's call, no draft)
        assert 0 in drafts and -mtp in drafts, crops
        if mtp > 1:
            assert any(-mtp < c < 0 for c in drafts), crops


def test_mtp_decoding_through_the_codes() -> None:
    """A calibrated codec gives the same tokens through the codes as through decoded blocks."""
    model, ids = _model("glm4_moe", 2), family_prompt(seed=7)
    codec = fast_codec(model, fast_recipe("before"), "before")
    runs = []
    for fast in (True, False):
        cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=fast)
        runs.append(generate(model, ids, cache, n=16, use_mtp=True)[0])
        assert cache.fast == fast and all(layer.num_sealed() > 0 for layer in cache.layers)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("name", ["glm4_moe", "inkling_text"])
def test_a_cache_after_mtp_decoding_saves_and_seals_again(name, tmp_path) -> None:
    """After MTP decoding the cache is saved (which ends the recording) and loaded, and the two
    continue alike; a second, ordinary generate on a cache MTP decoding left seals blocks again
    (no raw rows held past a block) and ends the recording."""
    mtp, seed, _ = CASES[name]
    model, ids = _model(name, mtp), family_prompt(seed=seed)
    codec = fast_codec(model, fast_recipe("before"), "before") if name == "glm4_moe" else IdentityCodec()
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    seq, _ = generate(model, ids, cache, n=6, use_mtp=True)
    assert all(layer.record_past for layer in cache.layers)
    more = torch.cat([seq, family_prompt(t=3, seed=8)], dim=1)
    loaded = saved_and_loaded_go_on_alike(model, codec, cache, more, tmp_path / "prefix.kkp", n=10)
    again = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    generate(model, ids, again, n=6, use_mtp=True)
    sealed = [layer.num_sealed() for layer in again.layers]
    generate(model, more, again, n=10)
    assert not any(layer.record_past for layer in again.layers)
    for c in (cache, loaded, again):
        assert all(st.staging.shape[-2] < 4 for layer in c.layers for st in layer._s.values())
    full = [i for i, layer in enumerate(again.layers) if layer.window is None]
    assert full and all(again.layers[i].num_sealed() > sealed[i] for i in full)


def test_mtp_decoding_on_a_cache_that_holds_tokens_is_refused(tmp_path) -> None:
    """transformers 5.25's first call of MTP (and prompt-lookup) decoding feeds the whole sequence
    again, the tokens a cache already holds included (DynamicCache then holds them twice and goes
    on from the wrong rows): refused, on a loaded cache too (which refused it before as ids that
    do not continue the prefix), and the cache is left as it was (it continues as one that never
    saw the refused generate, as DynamicCache without it). Before 2026-12-07 a cache in use took
    the tokens again, as DynamicCache does."""
    model, ids = _model("glm4_moe", 2), family_prompt(seed=7)
    codec = IdentityCodec(pre_rope_keys=True)
    ref = transformers.DynamicCache(config=model.config)
    seq, _ = generate(model, ids, ref, n=4)
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    generate(model, ids, cache, n=4)
    loaded = KakeyaCache.load(cache.save(tmp_path / "prefix.kkp"), model, codec)
    more = torch.cat([seq, family_prompt(t=3, seed=8)], dim=1)
    held = cache.get_seq_length()
    twice = copy.deepcopy(ref)
    generate(model, more, twice, n=1, use_mtp=True)
    assert twice.get_seq_length() == held + more.shape[1]  # DynamicCache: the held tokens again
    for c in (cache, loaded):
        for kw in (dict(use_mtp=True), dict(prompt_lookup_num_tokens=3)):
            with pytest.raises(InvalidInputError, match=f"feeds the whole sequence again.*the {held} tokens"):
                generate(model, more, c, n=4, **kw)
            assert c.get_seq_length() == held and not any(layer.record_past for layer in c.layers)
    ref_seq, ref_logits = generate(model, more, ref, n=6)
    for c in (cache, loaded):
        seq, logits = generate(model, more, c, n=6)
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)


def _assistant(model, unified: bool = False):
    """A tiny random-weight Gemma 4 assistant (``Gemma4AssistantForCausalLM``, or Gemma 4
    Unified's) for ``model``: two layers sharing the main model's last sliding and full K/V,
    three drafts a step."""
    kw = dict(_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_hidden_layers=2,
              num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"], per_layer_config={})
    torch.manual_seed(0)
    if unified:
        config = transformers.Gemma4UnifiedAssistantConfig(text_config=kw,
                                                           backbone_hidden_size=model.config.hidden_size)
        assistant = transformers.Gemma4UnifiedAssistantForCausalLM(config).eval()
    else:
        text = transformers.Gemma4TextConfig(**kw, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
        config = transformers.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=model.config.hidden_size)
        assistant = transformers.Gemma4AssistantForCausalLM(config).eval()
    assistant.generation_config.num_assistant_tokens = 3
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return assistant


def _drafting_from(assistant) -> list:
    """The K/V row counts (per layer type) the assistant is handed at each draft."""
    seen, forward = [], assistant.forward

    def recorded(*a, **kw):
        seen.append({k: tuple(t.shape[2] for t in v) for k, v in kw["shared_kv_states"].items()})
        return forward(*a, **kw)

    assistant.forward = recorded
    return seen


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4_unified_text"])
def test_gemma4_assistant_drafts_from_every_held_row(name) -> None:
    """Assisted decoding with Gemma 4's (and Gemma 4 Unified's) assistant, which drafts from the main
    model's last sliding and full K/V (``shared_kv_states``): an exact codec gives DynamicCache's tokens; through the
    codes the assistant is handed each layer's held rows (every row of the full layer, as
    decode-then-attend hands it; the sliding layer's last ``window - 1``), not only the call's own
    (it was). The tokens of the two paths may differ: other drafts accepted, other rows raw when
    read."""
    model, ids = build(name), family_prompt(t=30)
    assistant = _assistant(model, unified=name == "gemma4_unified_text")
    kw = dict(assistant_model=assistant, max_new_tokens=10, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, cache=transformers.DynamicCache(config=model.config), **kw)
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=4, n_sink=1)
    assert torch.equal(model.generate(ids, cache=cache, **kw), ref)
    codec = fast_codec(model, fast_recipe("before"), "before")
    handed = {}
    for fast in (True, False):
        handed[fast] = _drafting_from(assistant)
        cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=fast)
        out = model.generate(ids, cache=cache, **kw)
        del assistant.forward
        assert cache.fast == fast and any(getattr(layer, "num_sealed", lambda: 0)() for layer in cache.layers)
        # Each draft starts from every token so far: the full layer's rows (keys, values).
        assert [d["full_attention"] for d in handed[fast]][0] == (ids.shape[1], ids.shape[1])
        assert all(d["full_attention"][0] >= ids.shape[1] for d in handed[fast])
        assert all(d["sliding_attention"][0] >= model.config.sliding_window - 1 for d in handed[fast])
        assert out.shape[1] > ids.shape[1]
