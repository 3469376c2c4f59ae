"""Undoing what the cache took: assisted and prompt-lookup decoding (transformers records the
past, verifies draft tokens, then crops the rejected ones), and crops that cannot be done
refused before anything changes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.errors import InvalidInputError, InvalidParameterError  # noqa: E402

from .conftest import fast_codec, fast_recipe, forward, generate, saved_and_loaded_go_on_alike  # noqa: E402
from .families import T_PROMPT, WINDOW, build, family_prompt  # noqa: E402

ASSISTED = {"prompt lookup": lambda name: dict(prompt_lookup_num_tokens=3),
            "assistant model": lambda name: dict(assistant_model=build(name))}


@pytest.mark.parametrize("how", sorted(ASSISTED))
@pytest.mark.parametrize("name", ["llama", "mistral"])  # full attention; sliding everywhere
def test_assisted_decoding_through_the_cache(name, how) -> None:
    """An exact codec gives DynamicCache's tokens and logits under assisted decoding, with blocks
    sealed on the way (the draft rows stay raw until transformers crops the rejected ones); a
    calibrated codec gives the same tokens through the codes as through decoded blocks (not
    always those of decoding without a draft: a verified draft attends to its own rows raw, as
    any call's tokens do, where one token at a time would read some of them sealed)."""
    model, ids = build(name), family_prompt()
    kw = ASSISTED[how](name)
    ref_seq, ref_logits = generate(model, ids, transformers.DynamicCache(config=model.config), n=12, **kw)
    for codec in (IdentityCodec(), IdentityCodec(pre_rope_keys=True)):
        cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
        seq, logits = generate(model, ids, cache, n=12, **kw)
        assert cache.is_croppable and cache.layers[0].num_sealed() > 0
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    codec = fast_codec(model, fast_recipe("before"), "before")
    runs = []
    for fast in (True, False):
        cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=fast)
        runs.append(generate(model, ids, cache, n=12, **kw)[0])
        assert cache.layers[0].num_sealed() > 0
    assert torch.equal(runs[0], runs[1])


def test_a_crop_refused_by_one_layer_changes_none() -> None:
    """A sliding layer that dropped rows refuses a crop; the full layers before it keep theirs,
    and so do the positions (the cache as it was)."""
    model = build("qwen2")  # a full layer, then sliding ones
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=model, block_size=4, n_sink=1)
    forward(model, family_prompt(t=T_PROMPT), cache)
    before = [layer.get_seq_length() for layer in cache.layers]
    keys = cache.layers[0].keys.clone()
    assert [None if w is None else int(w) for _, _, w in cache] == [None, WINDOW, WINDOW]
    with pytest.raises(RuntimeError, match="layer 1 is sliding-window"):
        cache.crop(-3)
    assert [layer.get_seq_length() for layer in cache.layers] == before
    assert torch.equal(cache.layers[0].keys, keys) and len(cache._positions) == T_PROMPT
    # Recording the past, the rows taken since can be removed, sliding layers included.
    cache.activate_past_recording()
    forward(model, family_prompt(t=5, seed=2), cache)
    cache.crop(-3)
    assert [layer.get_seq_length() for layer in cache.layers] == [T_PROMPT + 2] * 3
    with pytest.raises(RuntimeError, match="sliding-window"):
        cache.crop(-1)  # past the rows taken since the last crop


def _poisoned(model, layer: int):
    """A hook that makes the keys of ``layer`` NaN (the refusal of a later layer's rows)."""
    def hook(_mod, _inp, out):
        out = out.clone()
        out[..., 0] = float("nan")
        return out

    return model.model.layers[layer].self_attn.k_proj.register_forward_hook(hook)


@pytest.mark.parametrize("pre_rope", [False, True])
def test_a_call_a_later_layer_refuses_leaves_every_layer_as_it_was(pre_rope) -> None:
    """Layer 2 refuses NaN keys after layers 0 and 1 took the call's rows: all three are rolled
    back (and the positions), so the cache goes on exactly as a cache that never saw the call."""
    model = build("llama")
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=pre_rope), model=model, block_size=4, n_sink=1)
    clean = KakeyaCache(IdentityCodec(pre_rope_keys=pre_rope), model=model, block_size=4, n_sink=1)
    for c in (cache, clean):
        forward(model, family_prompt(t=9), c)
    handle = _poisoned(model, 2)
    with pytest.raises(InvalidInputError, match="layer 2: key or value rows hold NaN"):
        forward(model, family_prompt(t=7, seed=3), cache)  # crosses a block boundary
    handle.remove()
    assert [layer.get_seq_length() for layer in cache.layers] == [9, 9, 9]
    nxt = family_prompt(t=7, seed=4)
    torch.testing.assert_close(forward(model, nxt, cache), forward(model, nxt, clean), rtol=0, atol=0)
    assert [layer.num_sealed() for layer in cache.layers] == [layer.num_sealed() for layer in clean.layers]


def test_a_refused_call_leaves_a_hybrids_cache_refusing_until_reset() -> None:
    """A hybrid model's recurrent states change in place: after a refused call the cache says
    so at the next call instead of running on states that took the refused tokens."""
    model = build("qwen3_next")
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=4, n_sink=1)
    forward(model, family_prompt(t=9), cache)
    attn = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer, "self_attn"))
    handle = _poisoned(model, attn)
    with pytest.raises(InvalidInputError, match="NaN"):
        forward(model, family_prompt(t=2, seed=3), cache)
    handle.remove()
    states = r"may have advanced the recurrent or convolution states of layers \[0, 2\].*reset\(\)"
    with pytest.raises(InvalidInputError, match=states):
        forward(model, family_prompt(t=2, seed=3), cache)
    cache.reset()
    forward(model, family_prompt(t=9), cache)


def test_a_loaded_prefix_is_guarded_until_a_call_goes_through(tmp_path) -> None:
    """The first call on a loaded prefix must continue it; a first call refused for another
    reason (a batch of three on a batch-one prefix) leaves that check in place."""
    model = build("llama")
    codec = IdentityCodec(pre_rope_keys=True)
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    ids = family_prompt(t=13)
    forward(model, ids, cache)
    path = cache.save(tmp_path / "prefix.kkp")
    loaded = KakeyaCache.load(path, model, codec)
    with pytest.raises(InvalidInputError, match="rows of shape"):
        forward(model, family_prompt(batch=3, t=2, seed=4), loaded)
    assert loaded.get_seq_length() == 13
    with pytest.raises(InvalidInputError, match="do not continue the 13 tokens"):
        generate(model, ids[:, :10], loaded, n=4)
    longer = torch.cat([ids, family_prompt(t=2, seed=5)], dim=1)  # the prefix's own ids, and on
    seq, _ = generate(model, longer, loaded, n=4)
    assert seq.shape[1] == 19


@pytest.mark.parametrize("name", ["llama", "mistral"])  # full attention; sliding everywhere
def test_a_cache_reused_after_assisted_decoding_seals_again(name, tmp_path) -> None:
    """transformers turns recording the past on for a generate that checks drafts and never off:
    the cache ends it at the first call no crop answered, so that a second, ordinary generate
    seals (and a sliding layer drops) as it goes; before, no block was sealed again. A save ends
    it too (the file does not hold it), so that the saved cache and the loaded one go on alike;
    a save while a draft's rows are unanswered is refused."""
    model, ids = build(name), family_prompt()
    codec = fast_codec(model, fast_recipe("before"), "before")
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    seq, _ = generate(model, ids, cache, n=6, prompt_lookup_num_tokens=3)
    assert all(layer.record_past for layer in cache.layers)
    more = torch.cat([seq, family_prompt(t=3, seed=7)], dim=1)
    loaded = saved_and_loaded_go_on_alike(model, codec, cache, more, tmp_path / "prefix.kkp", n=16)
    for c in (cache, loaded):
        assert all(st.staging.shape[-2] < 4 for layer in c.layers for st in layer._s.values())
    # Without a save, the recording ends at the second call of the next generate.
    again = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    generate(model, ids, again, n=6, prompt_lookup_num_tokens=3)
    generate(model, more, again, n=16)
    assert not any(layer.record_past for layer in again.layers)
    assert all(st.staging.shape[-2] < 4 for layer in again.layers for st in layer._s.values())
    again.activate_past_recording()
    forward(model, family_prompt(t=2, seed=8), again)
    with pytest.raises(InvalidParameterError, match="checks a draft"):
        again.save(tmp_path / "draft.kkp")


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1"])  # transformers' linear layers; KakeyaStateLayer
def test_assisted_decoding_of_a_hybrid_then_a_save(name, tmp_path) -> None:
    """A hybrid's recurrent states are cropped too (transformers 5.25 keeps a copy of them per
    call while it records the past): prompt lookup and an assistant model through the cache give
    DynamicCache's tokens and logits. The linear layers never end their recording by themselves;
    the cache ends it with its own layers' at the first call no crop answered and at a save (it
    refused a save after assisted decoding before), and the histories go with it. The saved and
    the loaded cache then go on alike, and a later generate keeps no history."""
    model, ids = build(name), family_prompt()
    for kw in (ASSISTED["prompt lookup"](name), ASSISTED["assistant model"](name)):
        ref_seq, ref_logits = generate(model, ids, transformers.DynamicCache(config=model.config), n=8, **kw)
        cache = KakeyaCache(IdentityCodec(), model=model, block_size=4, n_sink=1)
        seq, logits = generate(model, ids, cache, n=8, **kw)
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    linear = [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]
    assert linear and all(layer.record_past for layer in linear)
    more = torch.cat([seq, family_prompt(t=3, seed=7)], dim=1)
    saved_and_loaded_go_on_alike(model, IdentityCodec(), cache, more, tmp_path / "prefix.kkp", n=6)
    assert not any(h for layer in linear for h in getattr(layer, "recurrent_states_history", {}).values())
    again = KakeyaCache(IdentityCodec(), model=model, block_size=4, n_sink=1)
    generate(model, ids, again, n=6, prompt_lookup_num_tokens=3)
    generate(model, more, again, n=6)
    assert not any(getattr(layer, "record_past", False) for layer in again.layers)
    assert not any(h for layer in again.layers for h in getattr(layer, "recurrent_states_history", {}).values())
