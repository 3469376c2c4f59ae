"""Hybrid models' caches under transformers 5.25, whose linear layers (recurrent and convolution
states) record the past for assisted decoding, count their tokens and are croppable: what the
cache does around them compared with ``DynamicCache``."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.cache_utils import LinearAttentionCacheLayerMixin  # noqa: E402

from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402

from .conftest import forward  # noqa: E402
from .families import build, family_prompt  # noqa: E402


def _cache(model, pre: bool = False) -> KakeyaCache:
    return KakeyaCache(IdentityCodec(pre_rope_keys=pre), model=model, block_size=4, n_sink=1)


def _linear(cache):
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _lengths(cache):
    return [int(layer.get_seq_length()) for layer in cache.layers]


def _greedy(model, ids, cache, n, **kw):
    return model.generate(ids, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def _lookup_prompt():
    ids = family_prompt(1, 21)
    return torch.cat([ids, ids[:, :10]], 1)  # a repetition, for prompt-lookup drafts


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "falcon_h1", "inkling_text"])
def test_a_new_turn_after_assisted_decoding(name, tmp_path) -> None:
    """Prompt-lookup decoding, a plain continuation, then a new turn of several tokens: the cache
    ends the linear layers' recording with its own, and their convolution states, which grew by
    every token recorded, go back to the kernel's width (the new turn's call copied into the wider
    state: a RuntimeError of mismatched sizes; a save then wrote states the load refused)."""
    model = build(name)
    outs = []
    for cache in (transformers.DynamicCache(config=model.config), _cache(model)):
        first = _greedy(model, _lookup_prompt(), cache, 8, prompt_lookup_num_tokens=3)
        more = _greedy(model, first, cache, 3)
        turn = torch.cat([more, torch.tensor([[5, 6, 7]])], 1)
        held = copy.deepcopy(cache)
        outs.append(_greedy(model, turn, cache, 4))
        if isinstance(cache, KakeyaCache):
            assert not any(layer.record_past for layer in _linear(cache))
            loaded = KakeyaCache.load(held.save(tmp_path / "p.kkc"), model, IdentityCodec())
            assert torch.equal(_greedy(model, turn, loaded, 4), outs[0])
    assert torch.equal(outs[1], outs[0])


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "falcon_h1"])
def test_reset_gives_fresh_linear_layers(name) -> None:
    """``reset()`` after assisted decoding, then a batch of another size: transformers' reset
    zeroes the linear layers' states in place, so they kept recording (each convolution state
    grew by every later token, the recurrent history by a copy per call) and kept their batch
    (Falcon-H1's mixer failed on two rows, and the cache then refused calls until a reset)."""
    model = build(name)
    cache = _cache(model)
    _greedy(model, _lookup_prompt(), cache, 8, prompt_lookup_num_tokens=3)
    cache.reset()
    ids = family_prompt(2, 21)
    got = _greedy(model, ids, cache, 12)
    assert torch.equal(got, _greedy(model, ids, transformers.DynamicCache(config=model.config), 12))
    for layer in _linear(cache):
        assert not layer.record_past
        assert layer.conv_states[0].shape[-1] == layer.conv_kernel_size[0]
        assert not any(getattr(layer, "recurrent_states_history", {}).values())


@pytest.mark.parametrize("name", ["falcon_h1", "qwen3_next"])
def test_a_crop_the_states_cannot_follow_changes_nothing(name) -> None:
    """A crop outside past recording, or past what the linear layers recorded, is a RuntimeError
    before any layer changes (Falcon-H1's K/V rows were cropped, then its states refused; past
    the recorded history an IndexError after some layers were cropped); a crop within it is
    DynamicCache's."""
    model = build(name)
    ids = family_prompt(1, 21)
    ref = transformers.DynamicCache(config=model.config)
    cache = _cache(model, pre=True)
    for c in (ref, cache):
        forward(model, ids, c)
    with pytest.raises(RuntimeError, match="only while recording the past"):
        cache.crop(-2)
    assert _lengths(cache) == [21] * 3
    for c in (ref, cache):
        c.activate_past_recording(recurrent_states_to_keep=2)
        forward(model, torch.tensor([[5, 6, 7]]), c)
    with pytest.raises(RuntimeError, match="cannot remove 3"):
        cache.crop(-3)
    assert _lengths(cache) == [24] * 3
    for c in (ref, cache):
        c.crop(-2)
    assert _lengths(cache) == [22] * 3 and int(cache.get_seq_length()) == 22
    x = torch.tensor([[8]])
    assert torch.allclose(forward(model, x, cache), forward(model, x, ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1"])
def test_batch_operations_select_the_states(name) -> None:
    """``batch_select_indices`` and ``batch_repeat_interleave`` on a hybrid: transformers' linear
    layers have neither (AttributeError), Falcon-H1's states kept their batch (the next call
    failed in the mixer); now the states follow the rows, as ``reorder_cache`` moves them."""
    model = build(name)
    ids = family_prompt(2, 21)
    cache = _cache(model, pre=True)
    ref = transformers.DynamicCache(config=model.config)
    for c in (ref, cache):
        forward(model, ids, c)
    for op, arg, rows in (("batch_select_indices", torch.tensor([1]), [1]),
                          ("batch_repeat_interleave", 2, [0, 0, 1, 1])):
        mine, theirs = copy.deepcopy(cache), copy.deepcopy(ref)
        getattr(mine, op)(arg)
        theirs.reorder_cache(torch.tensor(rows))
        x = torch.arange(5, 5 + len(rows))[:, None]
        assert torch.allclose(forward(model, x, mine), forward(model, x, theirs), atol=1e-5, rtol=0)
        assert _lengths(mine) == [22] * 3
    with pytest.raises(Exception, match="do not select rows of 2"):
        cache.batch_select_indices(torch.tensor([2]))
    assert all(t.shape[0] == 2 for layer in _linear(cache) for t in layer.conv_states.values())


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1"])
def test_a_cache_of_no_token_is_saved_and_loaded(name, tmp_path) -> None:
    """A hybrid cache that holds no token, new or after ``reset()``, saves and loads: its linear
    layers' flags (and, after a reset, their zeroed states) were written, and the load refused
    them (CorruptDataError: the model's layer holds none)."""
    model = build(name)
    ids = family_prompt(1, 21)
    ref = _greedy(model, ids, transformers.DynamicCache(config=model.config), 6)
    cache = _cache(model)
    for i in range(2):
        if i:
            forward(model, ids, cache)
            cache.reset()
        loaded = KakeyaCache.load(cache.save(tmp_path / f"{i}.kkc"), model, IdentityCodec())
        assert int(loaded.get_seq_length()) == 0
        assert torch.equal(_greedy(model, ids, loaded, 6), ref)
