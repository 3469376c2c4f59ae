"""The codec inside transformers' cache, on tiny random-weight Llama and Qwen2 models (no download)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import recipes  # noqa: E402
from kakeyaturbo.cache import (  # noqa: E402
    BlockCodec,
    IdentityCodec,
    KakeyaCache,
    compress_cache,
)
from kakeyaturbo.cache.rope import rope_for  # noqa: E402

from .conftest import (  # noqa: E402
    KV_HEADS,
    LAYERS,
    VOCAB,
    Spy,
    Zero,
    cache_kw,
    filled,
    forward,
    generate,
    prompt,
)

# --- KakeyaCache with an exact codec: the same generation as DynamicCache ---------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("pre_rope", [False, True])
def test_identity_generate_matches_dynamic_cache(kind, pre_rope, request) -> None:
    model = request.getfixturevalue(kind)
    ids = prompt()
    ref_seq, ref_logits = generate(model, ids, transformers.DynamicCache(config=model.config))
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=pre_rope), model=model, block_size=8,
                        n_sink=2, boundary=(-1,))
    seq, logits = generate(model, ids, cache)
    assert torch.equal(seq, ref_seq)
    if pre_rope:  # RoPE removed and re-applied: exact up to float rounding
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-5)
    else:
        assert torch.equal(logits, ref_logits)
    n = ids.shape[1] + 24 - 1  # the last generated token is never fed back
    assert cache.get_seq_length() == n
    assert [layer.num_sealed() for layer in cache.layers] == [(n - 2) // 8] * (LAYERS - 1) + [0]
    assert cache.nbytes_uncompressed() == LAYERS * 2 * KV_HEADS * n * 16 * 4


def test_layers_of_a_forward_pass_share_one_rotation(llama) -> None:
    """Keys coded before RoPE, decoded then attended: a forward pass's layers take RoPE off the
    rows they seal and put it back on the rows they decode with one cos/sin per set of rows
    (computed once, not once per layer), held during the pass only."""
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=llama, block_size=8, n_sink=2,
                        boundary=(-1,), fast=False)
    ref_seq, _ = generate(llama, prompt(), transformers.DynamicCache(config=llama.config), n=12)
    own = []  # the cache's own calls of the rotary module (an empty probe), by row count
    hook = llama.model.rotary_emb.register_forward_pre_hook(
        lambda _m, args: own.append(args[1].shape[-1]) if args[0].numel() == 0 else None)
    try:
        seq, _ = generate(llama, prompt(), cache, n=12)
    finally:
        hook.remove()
    assert torch.equal(seq, ref_seq) and LAYERS - 1 == 2  # two layers rotate
    # 21 prompt tokens: 2 sink, 16 sealed (one call for both layers), 3 staged; the next 5
    # passes decode 16 rows, the fifth then seals 8 more; the last 6 decode 24.
    assert own == [16] + [16] * 5 + [8] + [24] * 6
    n = prompt().shape[1] + 12 - 1
    assert cache.memory()["positions"] == 4 * n  # nothing else held after the call


def test_batched_left_padding_beams_and_pre_rope_positions(llama) -> None:
    """Left padding shifts RoPE positions per row: the codec must still see the keys without
    RoPE, and beam search reorders sealed blocks as bytes."""
    ids = prompt(batch=2, t=19)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    ref_seq, ref_logits = generate(llama, ids, transformers.DynamicCache(config=llama.config),
                                   attention_mask=mask)
    pre = []
    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: pre.append(o))
             for layer in llama.model.layers]
    spy = Spy(pre_rope_keys=True)
    cache = KakeyaCache(spy, model=llama, block_size=8, n_sink=1)
    try:
        seq, logits = generate(llama, ids, cache, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-5)
    # k_proj outputs (no RoPE), per layer, concatenated over the steps: [B, H, T, D].
    per_layer = [torch.cat([o.view(2, o.shape[1], KV_HEADS, 16).transpose(1, 2) for o in pre[i::LAYERS]], dim=2)
                 for i in range(LAYERS)]
    # Blobs arrive per block in batch order: block j, row b -> the (2 j + b)-th call per head.
    for layer in range(LAYERS):
        for head in range(KV_HEADS):
            calls = [x for s, l_, h, x in spy.seen if s == "k" and l_ == layer and h == head]
            assert len(calls) == 2 * cache.layers[layer].num_sealed() and calls
            for j, x in enumerate(calls):
                blk, b = divmod(j, 2)
                want = per_layer[layer][b, head, 1 + 8 * blk:1 + 8 * (blk + 1)].numpy()
                np.testing.assert_allclose(x, want, rtol=0, atol=1e-5)
    beams_ref = llama.generate(ids[:1], max_new_tokens=12, num_beams=3, do_sample=False,
                               **{cache_kw(llama): transformers.DynamicCache(config=llama.config)})
    beams = llama.generate(ids[:1], max_new_tokens=12, num_beams=3, do_sample=False,
                           **{cache_kw(llama): KakeyaCache(IdentityCodec(pre_rope_keys=True),
                                                           model=llama, block_size=4, n_sink=1)})
    assert torch.equal(beams, beams_ref)


# --- KakeyaCache with the real codec ---------------------------------------------------------


RECIPE4 = recipes.Recipe(name="t4", k={"bit_width": 4, "variance_ratio": 1.0, "share_basis": True},
                         v={"bit_width": 4, "variance_ratio": 1.0, "share_basis": True})


def test_block_codec_generates_and_holds_bytes(llama32) -> None:
    bs, t, steps = 128, 140, 20
    n = t + steps - 1
    cache = KakeyaCache.from_recipe(RECIPE4, model=llama32, block_size=bs)
    seq, logits = generate(llama32, prompt(t=t), cache, n=steps)
    assert seq.shape == (1, t + steps) and torch.isfinite(logits).all()
    blob_bytes = 0
    for layer in cache.layers:
        assert layer.num_sealed() == 1
        for st in layer._s.values():
            blobs = [b for blk in st.blocks for row in blk for b in row]
            assert len(blobs) == KV_HEADS and all(type(b) is bytes for b in blobs)
            for b in blobs:
                r = kt.inspect_layer(b)
                assert r["num_vecs"] == bs and r["compressed_bytes"] == len(b)
                assert r["code_bytes"] >= bs * 32 * 4 // 8  # 4-bit residual codes
            blob_bytes += sum(len(b) for b in blobs)
            assert st.decoded == [] and st.staging.shape[-2] == n - bs
    raw_bytes = LAYERS * 2 * KV_HEADS * (n - bs) * 32 * 4  # staging, float32
    assert cache.memory() == {"blobs": blob_bytes, "sink": 0, "staging": raw_bytes, "decoded": 0, "state": 0, "indexer": 0,
                              "positions": 0, "rope_table": 0}
    assert cache.nbytes() == blob_bytes + raw_bytes
    full = LAYERS * 2 * KV_HEADS * n * 32 * 4
    assert cache.nbytes_uncompressed() == full
    # A sealed 128 x 32 head block (16 KiB in float32, 8 KiB in bf16): about 5.8 KiB of
    # container (4-bit codes 2 KiB, fp16 basis 2 KiB, centres 1 KiB, per-row scales).
    sealed_raw = LAYERS * 2 * KV_HEADS * bs * 32 * 4
    assert 0.3 * sealed_raw < blob_bytes < 0.4 * sealed_raw
    assert cache.nbytes() / full == pytest.approx((blob_bytes + raw_bytes) / full)
    assert cache.nbytes() < 0.5 * full


def test_block_codec_keeps_sink_boundary_and_staging_exact(qwen2) -> None:
    ids = prompt(t=45)
    ref = transformers.DynamicCache(config=qwen2.config)
    forward(qwen2, ids, ref)
    cache = KakeyaCache.from_recipe(RECIPE4, model=qwen2, block_size=16, n_sink=3, boundary=(1,))
    forward(qwen2, ids, cache)
    for i, (layer, r) in enumerate(zip(cache.layers, ref.layers)):
        for got, want in ((layer.keys, r.keys), (layer.values, r.values)):
            if i == 1:
                assert torch.equal(got, want) and layer.num_sealed() == 0
                continue
            assert layer.num_sealed() == 2
            assert torch.equal(got[:, :, :3], want[:, :, :3])  # the sink
            assert torch.equal(got[:, :, 35:], want[:, :, 35:])  # staging
            assert not torch.equal(got[:, :, 3:35], want[:, :, 3:35])  # sealed: lossy
    # keep_decoded gives the same values and counts the decoded tensors.
    kept = KakeyaCache.from_recipe(RECIPE4, model=qwen2, block_size=16, n_sink=3, boundary=(1,),
                                   keep_decoded=True)
    forward(qwen2, ids, kept)
    for a, b in zip(kept.layers, cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert kept.memory()["decoded"] == 2 * 2 * KV_HEADS * 32 * 16 * 4
    assert kept.nbytes() == cache.nbytes() + kept.memory()["decoded"]


@pytest.mark.parametrize("pre_rope", [False, True])
def test_generation_cache_and_prefix_compression_agree(llama, pre_rope) -> None:
    """With the prefix exactly one sealed block, KakeyaCache and compress_cache code the same
    rows: the continuation sees the same decoded prefix and gives the same logits."""
    n_sink, bs = 2, 24
    ids = prompt(t=n_sink + bs + 6)
    ctx, cont = ids[:, :n_sink + bs], ids[:, n_sink + bs:]
    codec = BlockCodec(RECIPE4, pre_rope_keys=pre_rope)
    kc = KakeyaCache(codec, model=llama, block_size=bs, n_sink=n_sink)
    forward(llama, ctx, kc)
    got = forward(llama, cont, kc)
    dc = transformers.DynamicCache(config=llama.config)
    forward(llama, ctx, dc)
    stats = compress_cache(dc, codec, n_sink=n_sink, rope=rope_for(llama))
    want = forward(llama, cont, dc)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert kc.memory()["blobs"] == stats["blob_bytes"]
    plain = transformers.DynamicCache(config=llama.config)
    forward(llama, ctx, plain)
    assert not torch.allclose(forward(llama, cont, plain), want, atol=1e-5)


@pytest.mark.parametrize("pre_rope", [False, True])
def test_per_block_rows_decoded_into_the_tensor_attention_reads(llama, pre_rope) -> None:
    # The slow path's rows of a per-block recipe decoded straight into the tensor it returns:
    # sink, four sealed blocks of two kv-heads, staging, the call's rows.
    cache = KakeyaCache(BlockCodec(recipes.load("balanced"), pre_rope_keys=pre_rope), model=llama,
                        block_size=8, n_sink=1)
    forward(llama, prompt(t=36), cache)
    layer = cache.layers[1]
    assert layer.num_sealed() == 4
    _direct_read_is_concatenated_read(layer)


def _direct_read_is_concatenated_read(layer) -> None:
    """A layer's rows decoded straight into the tensor ``_read`` returns (float32 on the CPU)
    equal those decoded into an array of their own and concatenated (the route of rows that need
    a gradient), the call's own rows last."""
    new = torch.randn(1, KV_HEADS, 1, 16)
    every = layer.seen + 1
    for name in ("k", "v"):
        direct = layer._read(name, new, every)
        assert torch.equal(direct, layer._read(name, new.clone().requires_grad_(), every).detach())
        assert direct.shape == (1, KV_HEADS, every, 16) and torch.equal(direct[..., -1:, :], new)


def test_crop_select_and_reset(llama) -> None:
    ids = prompt(t=30)
    for codec in (IdentityCodec(), Zero()):
        cache = KakeyaCache(codec, model=llama, block_size=8, n_sink=2)
        forward(llama, ids, cache)
        full_k = cache.layers[0].keys
        cache.crop(-3)  # inside staging (4 raw rows): exact
        assert cache.get_seq_length() == 27 and cache.layers[0].num_sealed() == 3
        assert torch.equal(cache.layers[0].keys, full_k[:, :, :27])
        cache.crop(-10)  # into two sealed blocks: read back through the codec
        assert cache.get_seq_length() == 17 and cache.layers[0].num_sealed() == 1
        assert torch.equal(cache.layers[0].keys, full_k[:, :, :17])
        forward(llama, ids[:, 17:20], cache)
        assert cache.get_seq_length() == 20 and cache.layers[0].num_sealed() == 2
    assert not cache.is_croppable
    two = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=llama, block_size=8)
    forward(llama, prompt(batch=2, t=20), two)
    want = transformers.DynamicCache(config=llama.config)
    forward(llama, prompt(batch=2, t=20), want)
    assert len(list(two)) == len(list(want)) == LAYERS
    for (k, v, w), (k2, v2, w2) in zip(two, want):  # iterated as DynamicCache iterates
        torch.testing.assert_close(k, k2, rtol=0, atol=1e-5)  # RoPE taken off and put back
        assert torch.equal(v, v2) and w is None and w2 is None
    k = two.layers[2].keys
    blobs = two.memory()["blobs"]
    two.batch_repeat_interleave(2)
    assert torch.equal(two.layers[2].keys, k.repeat_interleave(2, dim=0))
    assert two.memory()["blobs"] == blobs  # the copied rows share their sealed bytes
    two.batch_select_indices(torch.tensor([3, 0]))
    assert torch.equal(two.layers[2].keys, k[[1, 0]])
    assert two._positions.pos.shape == (2, 20)
    two.reset()
    assert two.get_seq_length() == 0 and two.nbytes() == 0 and two.layers[0].keys is None


def _state(cache) -> tuple:
    """What a cache holds, layer by layer: every stream's rows as attention reads them."""
    return cache.get_seq_length(), [(layer.keys, layer.values) for layer in cache.layers]


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for (k1, v1), (k2, v2) in zip(a[1], b[1])
                                for x, y in ((k1, k2), (v1, v2)))


@pytest.mark.parametrize("codec", [lambda: IdentityCodec(), lambda: BlockCodec(recipes.load("balanced"))])
def test_bad_updates_and_batch_operations_leave_the_cache_unchanged(codec) -> None:
    cache = KakeyaCache(codec(), num_layers=1, block_size=4, n_sink=1)
    g = torch.Generator().manual_seed(0)
    rows = lambda q, b=1: torch.randn(b, 2, q, 16, generator=g)  # noqa: E731
    cache.update(rows(3), rows(3), 0)
    before = _state(cache)
    nan = rows(3)
    nan[0, 0, 0, 0] = float("nan")
    bad = [
        ((nan, rows(3)), kt.InvalidInputError),  # would seal a block: the codec refuses it
        ((rows(3), rows(3).masked_fill(torch.ones(1, dtype=torch.bool), float("inf"))), kt.InvalidInputError),
        ((rows(2), rows(1)), kt.InvalidInputError),  # K and V of other lengths
        ((rows(2, b=2), rows(2, b=2)), kt.InvalidInputError),  # another batch
        ((rows(2)[..., :8], rows(2)[..., :8]), kt.InvalidInputError),  # another D
        ((rows(2).long(), rows(2).long()), TypeError),
        ((rows(2).to(torch.complex64), rows(2)), TypeError),
        ((rows(2)[0], rows(2)[0]), kt.InvalidInputError),
    ]
    for (k, v), err in bad:
        with pytest.raises(err):
            cache.update(k, v, 0)
        assert _same(_state(cache), before)
    for call, err in [
        (lambda: cache.crop(-1.5), TypeError),
        (lambda: cache.crop(float("nan")), TypeError),
        (lambda: cache.reorder_cache(torch.tensor([], dtype=torch.long)), kt.InvalidInputError),
        (lambda: cache.reorder_cache(torch.tensor([1])), kt.InvalidInputError),
        (lambda: cache.reorder_cache(torch.tensor([-1])), kt.InvalidInputError),
        (lambda: cache.reorder_cache(torch.tensor([0.0])), TypeError),
        (lambda: cache.batch_repeat_interleave(0), kt.InvalidParameterError),
        (lambda: cache.batch_select_indices(torch.tensor([5])), kt.InvalidInputError),
    ]:
        with pytest.raises(err):
            call()
        assert _same(_state(cache), before)
    # ... and the cache goes on as if nothing had been asked of it.
    cache.update(rows(3), rows(3), 0)
    assert cache.get_seq_length() == 6 and cache.layers[0].keys.shape == cache.layers[0].values.shape


# --- compress_cache ---------------------------------------------------------------------------


# --- errors -----------------------------------------------------------------------------------


def test_bad_settings_raise(llama) -> None:
    pre = IdentityCodec(pre_rope_keys=True)
    with pytest.raises(ValueError, match="rope"):
        KakeyaCache(pre)
    with pytest.raises(ValueError, match="num_layers"):
        KakeyaCache(IdentityCodec(), boundary=(-1,))
    with pytest.raises(ValueError, match="block_size"):
        KakeyaCache(IdentityCodec(), block_size=0)
    with pytest.raises(ValueError, match="stream"):
        KakeyaCache(IdentityCodec(), streams=("q",))
    with pytest.raises(ValueError, match="layers"):
        KakeyaCache(IdentityCodec(), model=llama, num_layers=5)
    with pytest.raises(TypeError, match="StreamCodec"):
        KakeyaCache(object())
    with pytest.raises(TypeError, match="fast must be a bool"):
        KakeyaCache(IdentityCodec(), model=llama, fast="yes")
    assert not KakeyaCache(IdentityCodec(), model=llama, fast=np.False_).fast  # as keep_decoded takes it
    with pytest.raises(TypeError, match="recipe must be a Recipe"):
        KakeyaCache.from_recipe("balanced")
    with pytest.raises(kt.InvalidParameterError, match="twice"):
        KakeyaCache(IdentityCodec(), streams=["k", "k"])
    with pytest.raises(TypeError, match="dict"):
        KakeyaCache(IdentityCodec(), streams={"k": 1})
    with pytest.raises(TypeError, match="transformers cache"):
        compress_cache(None, IdentityCodec())
    with pytest.raises(TypeError, match="StreamCodec"):
        compress_cache(transformers.DynamicCache(), 5)
    with pytest.raises(TypeError, match="Recipe"):
        BlockCodec({"k": {}})
    with pytest.raises(kt.InvalidParameterError, match="bit_widht"):
        recipes.Recipe(name="x", k={"bit_widht": 3})
    cache, _ = filled(llama)
    with pytest.raises(ValueError, match="rope"):
        compress_cache(cache, pre)

    class Short(IdentityCodec):
        def decode(self, stream, layer, head, blob):
            return super().decode(stream, layer, head, blob)[1:]

    with pytest.raises(ValueError, match="expected"):
        compress_cache(cache, Short())
    sliding = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
        max_window_layers=1))
    assert KakeyaCache(IdentityCodec(), model=sliding).is_sliding == [False, True]
    dynamic = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    KakeyaCache(IdentityCodec(), model=dynamic)  # keys stay as cached: no RoPE to remove
    del dynamic.model.rotary_emb.original_max_seq_len  # no known limit below which it is static
    with pytest.raises(kt.UnsupportedModelError, match="'llama'.*'dynamic'"):
        KakeyaCache(pre, model=dynamic)


def test_calibrated_codec_seals_blocks_in_generate(llama) -> None:
    """The calibrated mode plugs into the cache: pre-RoPE keys, blocks held as KKYC bytes whose
    size is the per-token bits of the recipe plus one small header per block."""
    from kakeyaturbo import calibration

    g = np.random.default_rng(0)
    wins = [list(g.integers(0, VOCAB, 48)) for _ in range(3)]
    stats = calibration.collect(llama, wins, n_sink=1, samples=8)
    sens = calibration.collect_sensitivity(llama, wins, n_sink=1, score=16)
    rec = recipes.load("calibrated-4bit")
    codec = calibration.ModelCodec(stats, rec, sensitivity=sens)
    assert codec.pre_rope_keys
    cache = KakeyaCache(codec, model=llama, block_size=16, n_sink=1)
    seq, logits = generate(llama, prompt(t=40), cache, n=8)
    ref_seq, _ = generate(llama, prompt(t=40), transformers.DynamicCache(config=llama.config), n=8)
    assert seq.shape == ref_seq.shape and torch.isfinite(logits).all()
    layer = cache.layers[0]
    assert layer.num_sealed() == 2  # 47 cached tokens: 1 sink + 2 x 16 sealed + 14 staged
    mem = cache.memory()
    sealed = LAYERS * KV_HEADS * 2 * 2 * 16 * 16  # layers, heads, streams, blocks, rows, D
    assert 8 * mem["blobs"] / sealed <= 4.0 + 8 * 48 / (16 * 16)  # + one header per blob
    assert cache.nbytes() < cache.nbytes_uncompressed()
    _direct_read_is_concatenated_read(layer)
    holder = np.zeros((1, 16, KV_HEADS, 40), np.float32).transpose(0, 2, 3, 1)  # [1, H, 40, D], strided
    with pytest.raises(kt.InvalidInputError, match="C-contiguous"):  # (a reshape would write a copy)
        codec.decode_blocks_into("k", 0, layer._s["k"].blocks, 16, holder, 0)
