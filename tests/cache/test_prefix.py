"""Prefix compression of a filled DynamicCache (compress_cache): exact codecs leave it as it was,
sink, boundary layers and streams stay exact, bits are all-in."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import recipes  # noqa: E402
from kakeyaturbo.cache import (  # noqa: E402
    BlockCodec,
    IdentityCodec,
    compress_cache,
)
from kakeyaturbo.cache.rope import rope_for  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402

from .conftest import (  # noqa: E402
    KV_HEADS,
    LAYERS,
    Zero,
    filled,
)


@pytest.mark.parametrize("batch", [1, 2])
def test_compress_cache_identity_leaves_the_cache_as_it_was(llama, batch) -> None:
    cache, snap = filled(llama, batch)
    stats = compress_cache(cache, IdentityCodec(), n_sink=3)
    for layer, (k, v) in zip(cache.layers, snap):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    elems = LAYERS * 2 * batch * KV_HEADS * 40 * 16
    blobs = LAYERS * 2 * batch * KV_HEADS * (4 + 37 * 16 * 4)
    assert stats["elements"] == elems and stats["blob_bytes"] == blobs
    assert stats["bits"] == 8 * blobs + 16 * LAYERS * 2 * batch * KV_HEADS * 3 * 16
    cache, snap = filled(llama, batch)
    compress_cache(cache, IdentityCodec(pre_rope_keys=True), rope=rope_for(llama))
    for layer, (k, v) in zip(cache.layers, snap):
        torch.testing.assert_close(layer.keys, k, rtol=0, atol=1e-6)
        assert torch.equal(layer.values, v)


def test_compress_cache_checks_positions_before_any_layer_changes(llama) -> None:
    cache, snap = filled(llama, batch=2)
    codec, rope = IdentityCodec(pre_rope_keys=True), rope_for(llama)
    for pos, err in [(torch.arange(39), kt.InvalidInputError),  # one token short of the 40 held
                     (torch.arange(40)[None].expand(3, 40), kt.InvalidInputError),  # another batch
                     (torch.arange(40, dtype=torch.float32), TypeError),
                     ("0..40", TypeError)]:
        with pytest.raises(err):
            compress_cache(cache, codec, rope=rope, positions=pos)
        for layer, (k, v) in zip(cache.layers, snap):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    compress_cache(cache, codec, rope=rope, positions=torch.arange(40)[None].expand(2, 40))
    for layer, (k, v) in zip(cache.layers, snap):
        torch.testing.assert_close(layer.keys, k, rtol=0, atol=1e-6)


def test_compress_cache_keeps_sink_boundary_and_streams_exact(qwen2) -> None:
    cache, snap = filled(qwen2, batch=2)
    stats = compress_cache(cache, Zero(), n_sink=4, boundary=(-1,), streams=("k",))
    assert stats["compressed_layers"] == [0, 1]
    for i, (layer, (k, v)) in enumerate(zip(cache.layers, snap)):
        assert torch.equal(layer.values, v)
        if i == LAYERS - 1:
            assert torch.equal(layer.keys, k)
        else:
            assert torch.equal(layer.keys[:, :, :4], k[:, :, :4])
            assert torch.count_nonzero(layer.keys[:, :, 4:]) == 0


def test_compress_cache_matches_the_harness_loop(llama) -> None:
    """compress_cache is a drop-in for harness.compress_prefix: same decoded values and bits."""
    recipe = recipes.load("balanced")
    method = harness.codec_method(recipe, LAYERS)
    a, _ = filled(llama)
    bits, elems = harness.compress_prefix(a, method)
    b, _ = filled(llama)
    stats = compress_cache(b, BlockCodec(recipe), n_sink=recipe.n_sink,
                           boundary=recipe.boundary_layers, streams=recipe.streams)
    assert (stats["bits"], stats["elements"]) == (bits, elems)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
