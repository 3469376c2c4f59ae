"""``longrope`` (Phi-3.5, Phi-4-mini, Phi-3.5-MoE, Phi-4-multimodal): a forward call whose largest position reaches
``original_max_position_embeddings`` (16 in the tiny models here) rotates every token it computes
by the long factors, any other call by the short ones, so a cached key's rotation depends on the
call that computed it. The cache records which tokens a long call computed
(``Positions.long``), takes RoPE off and puts it back by each token's own factors, and the kernel
reads the short factors' rows appended to the long table. Calls are made one by one here (as a
serving loop makes them): transformers' ``generate`` drops whatever cache it was given at the
call that crosses the limit and recomputes the sequence (a ``DynamicCache`` as well)."""

from __future__ import annotations

import json
import struct
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import calibration  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache, compress_cache  # noqa: E402
from kakeyaturbo.errors import CorruptDataError  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .conftest import Spy, damaged_loads_or_refuses, fast_recipe  # noqa: E402
from .family_base import VOCAB  # noqa: E402
from .test_persist import _with_header  # noqa: E402

LIMIT = 16
#: Positions of the calls: a 12-token prompt (short), one token at a time to 15 (short), then on
#: past the limit (long); and a 20-token prompt (one long call) then two tokens.
CROSSING = [12] + [1] * 12
LONG_PROMPT = [20, 1, 1]


def build(name: str = "phi3"):
    """A tiny Phi-3 (or Phi-3.5-MoE, ``phimoe``: its own mscale per set of factors; or
    Phi-4-multimodal) whose longrope switches at position 16."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [3.0] * 8,
            "original_max_position_embeddings": LIMIT}
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=LIMIT, pad_token_id=0)
    torch.manual_seed(0)
    if name == "phi4_multimodal":  # Phi-4-multimodal's decoder (a text prompt; tiny vision and audio towers)
        cfg = transformers.Phi4MultimodalConfig(
            rope_parameters=rope, **kw, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                           num_attention_heads=2, image_size=28, patch_size=14),
            audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2))
        return transformers.Phi4MultimodalForCausalLM(cfg).eval()
    if name == "phimoe":
        cfg = transformers.PhimoeConfig(rope_parameters=dict(rope, short_mscale=1.0, long_mscale=1.2),
                                        num_local_experts=2, num_experts_per_tok=1, **kw)
        return transformers.PhimoeForCausalLM(cfg).eval()
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(rope_parameters=rope, **kw)).eval()


@pytest.fixture(scope="module", params=["phi3", "phimoe", "phi4_multimodal"])
def model(request):
    return build(request.param)


def _feed(model, cache, calls, seed: int = 1):
    """The calls' tokens fed one call after another; the logits of every call's last token."""
    ids = torch.from_numpy(np.random.default_rng(seed).integers(3, VOCAB, (1, sum(calls))))
    out, at = [], 0
    with torch.no_grad():
        for n in calls:
            out.append(model(input_ids=ids[:, at:at + n], cache=cache, use_cache=True).logits[:, -1])
            at += n
    return torch.cat(out)


def _pre_rope_keys(model, calls):
    """Layer 0's keys before RoPE as its key projection (Phi-3's fused one) computes them:
    ``[hkv, T, d]``."""
    got = []
    attn = model.model.layers[0].self_attn
    d, hq, hkv = attn.head_dim, model.config.num_attention_heads, model.config.num_key_value_heads
    fused = getattr(attn, "qkv_proj", None)
    handle = (fused.register_forward_hook(lambda m, a, y: got.append(y[0, :, hq * d:(hq + hkv) * d])) if fused
              else attn.k_proj.register_forward_hook(lambda m, a, y: got.append(y[0])))
    try:
        _feed(model, transformers.DynamicCache(config=model.config), calls)
    finally:
        handle.remove()
    return torch.cat(got).view(-1, hkv, d).transpose(0, 1)


def test_the_layout_takes_it(model) -> None:
    assert describe(model).rope.layer(0).long_after == LIMIT


@pytest.mark.parametrize("calls", [CROSSING, LONG_PROMPT])
def test_keys_are_coded_before_rope_by_each_token_s_factors(model, calls) -> None:
    """The codec is handed the model's keys before RoPE (short and long calls alike), and the
    rows attention reads carry the model's rotation: as a DynamicCache fed the same calls."""
    spy = Spy(pre_rope_keys=True)
    cache = KakeyaCache(spy, model=model, block_size=4, n_sink=1)
    logits = _feed(model, cache, calls)
    dyn = transformers.DynamicCache(config=model.config)
    want = _feed(model, dyn, calls)
    assert (logits - want).abs().max().item() <= 1e-5
    pos = cache._positions
    first_long = next(i for i, n in enumerate(np.cumsum(calls)) if n > LIMIT)
    assert pos.long is not None and int(pos.long.sum()) == sum(calls[first_long:])
    pre = _pre_rope_keys(model, calls)
    for h in range(2):
        coded = torch.cat([torch.from_numpy(x) for s, i, hh, x in spy.seen if (s, i, hh) == ("k", 0, h)])
        torch.testing.assert_close(coded, pre[h, 1:1 + coded.shape[0]].float(), rtol=0, atol=1e-5)
    for a, b in zip(cache.layers, dyn.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def codec(model):
    g = np.random.default_rng(0)
    stats = calibration.collect(model, [list(g.integers(3, VOCAB, 14)) for _ in range(3)], samples=4)
    return calibration.ModelCodec(stats, fast_recipe("before"))


@pytest.mark.parametrize("calls", [CROSSING, LONG_PROMPT])
def test_attention_over_the_codes_as_decode_then_attend(model, codec, calls) -> None:
    fast = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32")
    slow = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=False)
    assert fast.fast, fast.fast_reason
    got, want = _feed(model, fast, calls), _feed(model, slow, calls)
    assert (got - want).abs().max().item() <= 1e-5
    assert fast.layers[0].num_sealed() == (sum(calls) - 1) // 4


def test_a_saved_cache_keeps_each_token_s_factors(model, codec, tmp_path) -> None:
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    _feed(model, cache, CROSSING[:-2])
    path = tmp_path / "p.kkc"
    cache.save(path)
    header = json.loads(path.read_bytes()[12:12 + int.from_bytes(path.read_bytes()[8:12], "little")])
    assert header["long_rope"] == [[LIMIT, sum(CROSSING[:-2])]]
    loaded = KakeyaCache.load(path, model, codec)
    assert torch.equal(loaded._positions.long, cache._positions.long)
    more = [1, 1]
    a, b = _feed(model, cache, more, seed=2), _feed(model, loaded, more, seed=2)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for n, runs in enumerate(([[3, 2]], [[0, 99]], [[0, 2], [2, 4]], "x", [])):
        bad = _with_header(path, tmp_path / f"bad{n}.kkc", lambda h: h.update(long_rope=runs))
        with pytest.raises(CorruptDataError):
            KakeyaCache.load(bad, model, codec)
    old = _with_header(path, tmp_path / "v4.kkc", lambda h: None, version=4)  # the runs need version 5
    with pytest.raises(CorruptDataError, match="version 4 records no longrope"):
        KakeyaCache.load(old, model, codec)


def test_compress_cache_takes_one_set_of_factors_per_layer(model) -> None:
    """A filled cache does not record which factors rotated each key: a layer holding a position
    past the limit is taken as one long call left it (one prefill; transformers' generate
    recomputes the sequence so), else as short calls did. The codec is handed the model's keys
    before RoPE either way; RoPE goes back on as it was."""
    for calls in ([12, 1], [20]):
        dyn = transformers.DynamicCache(config=model.config)
        _feed(model, dyn, calls)
        before = dyn.layers[0].keys.clone()
        spy = Spy(pre_rope_keys=True)
        compress_cache(dyn, spy, model=model, n_sink=1)
        torch.testing.assert_close(dyn.layers[0].keys, before, rtol=0, atol=1e-5)
        pre = _pre_rope_keys(model, calls)
        for h in range(2):
            (coded,) = [torch.from_numpy(x) for s, i, hh, x in spy.seen if (s, i, hh) == ("k", 0, h)]
            torch.testing.assert_close(coded, pre[h, 1:].float(), rtol=0, atol=1e-5)


def test_generate_drops_any_cache_at_the_limit(model) -> None:
    """transformers' Phi-3 recomputes the sequence at the call that crosses the limit, with a
    cache of its own: the cache it was given stops there, a DynamicCache as a KakeyaCache."""
    ids = torch.from_numpy(np.random.default_rng(1).integers(3, VOCAB, (1, 12)))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    caches = [transformers.DynamicCache(config=model.config), KakeyaCache(IdentityCodec(pre_rope_keys=True),
                                                                          model=model, block_size=4, n_sink=1)]
    outs = [model.generate(ids, cache=c, **kw) for c in caches]
    assert torch.equal(outs[0], outs[1])
    assert [c.get_seq_length() for c in caches] == [LIMIT, LIMIT]


@lru_cache(maxsize=None)
def _saved(tmp: str) -> bytes:
    model = build()
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=model, block_size=4, n_sink=1)
    _feed(model, cache, CROSSING)
    return cache.save(f"{tmp}/long.kkc").read_bytes()


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_damage_to_a_saved_longrope_cache_is_a_kakeya_error(tmp_path_factory, data) -> None:
    """A version-5 file damaged in its header (where the runs are) or anywhere, the checksum
    recomputed: it loads, or it is refused with a KakeyaError; nothing else escapes."""
    raw = _saved(str(tmp_path_factory.getbasetemp()))
    hlen = struct.unpack_from("<I", raw, 8)[0]
    head = data.draw(st.booleans())
    where = st.integers(12, 12 + hlen - 1) if head else st.integers(0, len(raw) - 5)
    values = st.sampled_from(b"0123456789[],-\" ") if head else st.integers(0, 255)
    damaged_loads_or_refuses(raw, data, where, values, tmp_path_factory.mktemp("fuzz") / "f.kkc",
                             lambda p: KakeyaCache.load(p, build(), IdentityCodec(pre_rope_keys=True)))
