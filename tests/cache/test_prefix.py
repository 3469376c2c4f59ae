"""Prefix compression of a filled DynamicCache (compress_cache): exact codecs leave it as it was,
sink, boundary layers and streams stay exact, bits are all-in."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import recipes  # noqa: E402
from kakeyaturbo.cache import (  # noqa: E402
    BlockCodec,
    IdentityCodec,
    KakeyaCache,
    compress_cache,
)
from kakeyaturbo.calibration import ModelCodec  # noqa: E402
from kakeyaturbo.errors import ModelMismatchError  # noqa: E402
from kakeyaturbo.cache.rope import rope_for  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402

from .conftest import (  # noqa: E402
    KV_HEADS,
    LAYERS,
    Zero,
    build,
    fast_codec,
    fast_recipe,
    filled,
    forward,
    prompt,
)


def unchanged(cache, snap) -> bool:
    return all(torch.equal(layer.keys, k) and torch.equal(layer.values, v)
               for layer, (k, v) in zip(cache.layers, snap))


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


def test_compress_cache_checks_a_calibrated_codec_against_the_model(llama, tmp_path) -> None:
    """A codec file made for ``llama`` is refused for a model of the same shapes and other
    attention weights (the cache unchanged), and accepted for ``llama``."""
    path = fast_codec(llama, fast_recipe()).save(tmp_path / "llama.kkcodec", llama)
    codec = ModelCodec.load(path)
    other = build("llama")
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
    cache, snap = filled(other)
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        compress_cache(cache, codec, n_sink=1, model=other)
    assert unchanged(cache, snap)
    cache, snap = filled(llama)
    assert compress_cache(cache, codec, n_sink=1, model=llama)["compressed_layers"] == [0, 1, 2]
    assert not unchanged(cache, snap)


def test_compress_cache_changes_nothing_when_a_later_layer_is_refused(llama) -> None:
    cache, _ = filled(llama)
    cache.layers[2].keys[0, 1, 5, 3] = float("nan")  # the last layer only
    snap = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    for codec in (BlockCodec(recipes.load("balanced")), IdentityCodec()):
        with pytest.raises(kt.InvalidInputError, match=r"layer 2, stream 'k'.*kv-head 1, position 5, column 3"):
            compress_cache(cache, codec, n_sink=1)
        for layer, (k, v) in zip(cache.layers, snap):  # NaN == NaN for torch.equal: compare the finite ones
            assert torch.equal(layer.values, v) and torch.equal(layer.keys.nan_to_num(7.0), k.nan_to_num(7.0))


class FailsOnLayer(IdentityCodec):
    """Refuses the values of one layer (a codec error after earlier layers were coded)."""

    def encode(self, stream, layer, head, x):
        if (stream, layer) == ("v", 1):
            raise kt.InvalidInputError("cannot code these rows")
        return super().encode(stream, layer, head, x)


def test_compress_cache_names_the_layer_of_a_codec_error_and_changes_nothing(llama) -> None:
    cache, snap = filled(llama)
    with pytest.raises(kt.InvalidInputError, match=r"^layer 1, stream 'v': cannot code these rows"):
        compress_cache(cache, type("Zeroing", (FailsOnLayer, Zero), {})(), n_sink=1)
    assert unchanged(cache, snap)


def test_compress_cache_refuses_caches_it_cannot_change_in_place(llama) -> None:
    codec = BlockCodec(recipes.load("balanced"))
    kc = KakeyaCache(IdentityCodec(), model=llama)  # its keys are a computed view
    forward(llama, prompt(t=40), kc)
    before = [layer.keys.clone() for layer in kc.layers]
    with pytest.raises(TypeError, match="DynamicCache.*KakeyaLayer"):
        compress_cache(kc, codec, n_sink=1)
    assert all(torch.equal(b, layer.keys) for b, layer in zip(before, kc.layers))
    sc = transformers.StaticCache(config=llama.config, max_cache_len=128)  # 40 tokens in 128 slots
    forward(llama, prompt(t=40), sc)
    snap = [(layer.keys.clone(), layer.values.clone()) for layer in sc.layers]
    with pytest.raises(TypeError, match="DynamicCache.*StaticLayer"):
        compress_cache(sc, codec, n_sink=1)
    assert unchanged(sc, snap)


class BadDecode(IdentityCodec):
    """Decodes layer 1's keys of kv-head 1 with one bad value."""

    def __init__(self, bad) -> None:
        super().__init__()
        self.bad = bad

    def __repr__(self) -> str:
        return f"BadDecode({self.bad})"

    def decode(self, stream, layer, head, blob):
        y = super().decode(stream, layer, head, blob).astype(np.float64)
        if (stream, layer, head) == ("k", 1, 1):
            y[2, 4] = self.bad
        return y


@pytest.mark.parametrize("bad, dtype", [(float("nan"), torch.float32), (1e300, torch.float32),
                                        (1e5, torch.float16)])  # finite in float32, not in the cache's dtype
def test_compress_cache_refuses_decoded_rows_that_are_not_finite(llama, bad, dtype) -> None:
    cache, _ = filled(llama)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
    snap = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with pytest.raises(ValueError, match=r"layer 1.*'k'.*BadDecode.*decode") as e:
        compress_cache(cache, BadDecode(bad), n_sink=1)
    assert isinstance(e.value, kt.KakeyaError)
    assert unchanged(cache, snap)
