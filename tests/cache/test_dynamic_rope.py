"""``dynamic`` rope types (dynamic NTK scaling): below ``max_position_embeddings``
every forward call rotates by the original frequencies; a call reaching past it recomputes them
from its longest position (and the rotary module keeps them), so a cached key's rotation is then
no function of its position alone. Keys coded before RoPE (every shipped recipe) are served
below the limit (``LayerRope.static_until``: refused before 2026-12-08, whatever the length); a
call reaching it is refused before anything of it is stored; the cache's own calls of the rotary
module leave its state as they found it. The tiny Llama here has ``max_position_embeddings`` 48."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import calibration  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache, compress_cache  # noqa: E402
from kakeyaturbo.cache import fast as fast_mod  # noqa: E402
from kakeyaturbo.errors import UnsupportedModelError  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .conftest import fast_codec, fast_recipe, forward, generate  # noqa: E402
from .family_base import VOCAB  # noqa: E402

LIMIT = 48


def build(factor: float = 4.0):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LIMIT,
                                   rope_parameters={"rope_type": "dynamic", "factor": factor, "rope_theta": 1e4},
                                   pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(t: int, seed: int = 1):
    return torch.randint(3, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


def test_layout_reads_the_limit() -> None:
    layout = describe(build())
    assert layout.rope_error is None
    assert [r.static_until for r in layout.rope.layers] == [LIMIT, LIMIT]
    assert fast_mod.dynamic_rope(layout.rope.layer(0)) is None
    assert fast_mod.rope_table(layout.rope.layer(0), 10).n_positions == LIMIT  # no row past it


@pytest.mark.parametrize("codec", ["identity", "calibrated"])
def test_served_below_the_limit_as_dynamic_cache(codec) -> None:
    """The identity codec with keys before RoPE generates as ``DynamicCache`` up to the limit;
    a calibrated codec's attention over the codes as the same cache decoding its blocks."""
    m = build()
    ids = _ids(30)
    if codec == "identity":
        got = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m, block_size=4, n_sink=1)
        ref = transformers.DynamicCache(config=m.config)
        seq, log = generate(m, ids, got, n=LIMIT - 30)
        seq_r, log_r = generate(m, ids, ref, n=LIMIT - 30)
        assert torch.equal(seq, seq_r)
        assert (log - log_r).abs().max().item() < 1e-4 * max(1.0, log_r.abs().max().item())
        return
    c = fast_codec(m, fast_recipe("before"), "before")
    fast = KakeyaCache(c, model=m, block_size=4, n_sink=1, synthesis="f32")
    slow = KakeyaCache(c, model=m, block_size=4, n_sink=1, fast=False)
    assert fast.fast, fast.fast_reason
    seq_f, log_f = generate(m, ids, fast, n=LIMIT - 30)
    seq_s, log_s = generate(m, ids, slow, n=LIMIT - 30)
    assert torch.equal(seq_f, seq_s)
    assert (log_f - log_s).abs().max().item() < 1e-2 * max(1.0, log_s.abs().max().item())


def test_a_call_reaching_the_limit_is_refused_and_nothing_is_lost() -> None:
    m = build()
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m, block_size=4, n_sink=1)
    forward(m, _ids(40), cache)
    held = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(UnsupportedModelError, match=r"position 48 .*max_position_embeddings \(48\)"):
        forward(m, _ids(9, seed=2), cache)
    assert cache.get_seq_length() == 40
    assert m.model.rotary_emb.max_seq_len_cached == LIMIT  # refused before the model's rotary module ran
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, held))
    nxt = forward(m, _ids(8, seed=2), cache)  # up to position 47: served as before
    ref = transformers.DynamicCache(config=m.config)
    forward(m, _ids(40), ref)
    want = forward(m, _ids(8, seed=2), ref)
    assert (nxt - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    # Keys as the cache holds them (a codec of keys after RoPE) are served past the limit.
    after = KakeyaCache(IdentityCodec(), model=m, block_size=4, n_sink=1)
    forward(m, _ids(LIMIT + 8), after)
    assert after.get_seq_length() == LIMIT + 8


def test_the_cache_leaves_the_rotary_module_as_it_found_it() -> None:
    """The model run past its limit (a DynamicCache) grows its rotary module's frequencies; the
    cache's own calls of the module (tables at positions below the limit) do not reset them."""
    m = build()
    rot = m.model.rotary_emb
    forward(m, _ids(LIMIT + 16), transformers.DynamicCache(config=m.config))
    grown, inv = rot.max_seq_len_cached, rot.inv_freq
    assert grown == LIMIT + 16 and not torch.equal(inv, rot.original_inv_freq)
    r = describe(m).rope.layer(0)
    cos, _ = r(torch.arange(10))
    assert rot.max_seq_len_cached == grown and rot.inv_freq is inv
    fresh = build()  # the original frequencies, as the module gives them below the limit
    assert torch.equal(cos, describe(fresh).rope.layer(0)(torch.arange(10))[0])
    with pytest.raises(UnsupportedModelError, match="dynamic rope type"):
        r(torch.arange(LIMIT + 1))


def test_calibration_below_the_limit_and_refused_past_it() -> None:
    m = build()
    g = np.random.default_rng(0)
    assert calibration.collect(m, [list(g.integers(3, VOCAB, 40))] * 2, samples=2).meta["rope"] == "before"
    rot = m.model.rotary_emb
    for collect in (calibration.collect, calibration.collect_sensitivity):  # refused before the model runs
        with pytest.raises(UnsupportedModelError, match=r"windows of up to 52 tokens .*\(48\)"):
            collect(m, [list(g.integers(3, VOCAB, LIMIT + 4))] * 2)
        assert rot.max_seq_len_cached == LIMIT
    stats = calibration.collect(m, [list(g.integers(3, VOCAB, LIMIT + 4))] * 2, samples=2, rope="after")
    assert stats.meta["rope"] == "after"


def test_compress_cache_below_the_limit() -> None:
    m = build()
    ref = transformers.DynamicCache(config=m.config)
    forward(m, _ids(40), ref)
    keys = ref.layers[0].keys.clone()
    got = compress_cache(ref, IdentityCodec(pre_rope_keys=True), model=m)
    assert got["elements"] > 0
    assert (ref.layers[0].keys - keys).abs().max().item() < 1e-5
