"""A left-padded batch keeps each row's first real tokens as its sink (``kakeyaturbo.cache.padding``),
not its padding: read raw by decode-then-attend and by attention over the codes, kept through
batch operations, a crop and a saved file, on a tiny random-weight Llama with a lossy calibrated
codec (its coded rows differ from the raw ones, so a sink read from the blocks shows)."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest

from .conftest import build, fast_codec, fast_recipe, generate, prompt, torch, transformers
from .families import build as build_family

from kakeyaturbo import recipes  # noqa: E402
from kakeyaturbo.cache import KakeyaCache, codec_for, compress_cache, persist  # noqa: E402
from kakeyaturbo.cache import fast as fast_mod  # noqa: E402
from kakeyaturbo.cache.padding import causal_mask, first_real, move_sinks, sink_unpadded  # noqa: E402
from kakeyaturbo.errors import CorruptDataError  # noqa: E402

PAD = 5  # row 1's padding: its first real token at position 5, in the first sealed block


@pytest.fixture(scope="module")
def model():
    return build("llama")


@pytest.fixture(scope="module", params=["after", "before"])
def codec(request, model):
    return fast_codec(model, fast_recipe(request.param), request.param)


def _batch(t: int = 30):
    ids = prompt(batch=2, t=t)
    mask = torch.ones_like(ids)
    ids[1, :PAD] = 0
    mask[1, :PAD] = 0
    return ids, mask


def _run(model, cache, n: int = 4):
    ids, mask = _batch()
    return generate(model, ids, cache, n=n, attention_mask=mask)


def test_first_real_reads_both_conventions_of_padding() -> None:
    # transformers 5.25: padding at position 0, as the first token; earlier: padding at 1.
    assert first_real(torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1]]), 2) == [0, 2]
    assert first_real(torch.tensor([[0, 1, 2, 3], [1, 1, 0, 1]]), 2) == [0, 2]
    assert first_real(torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]), 2) is None  # none padded
    assert first_real(torch.tensor([[0, 1, 0, 1]]), 1) is None  # packed sequences: the first one's start
    assert first_real(torch.tensor([[0, 1, 2]]), 2) is None  # positions of another batch
    assert first_real(None, 2) is None


def test_move_sinks_moves_each_rows_entry_to_its_sink() -> None:
    m = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    m[1, ..., :3] = False  # row 1's padding
    got = move_sinks(m.clone(), [0, 3], 1, False)
    assert torch.equal(got[0], m[0])
    assert got[1, 0, 0].tolist() == [True, False, False, False, True, True, True, True]
    add = np.where(m.numpy(), np.float32(0), np.float32(-np.inf))
    assert np.array_equal(move_sinks(add.copy(), [0, 3], 1, -np.inf) == 0, got.numpy())
    # A sink of two rows whose row starts inside it (overlapping places), and no mask (causal):
    # queries are the last positions.
    causal = move_sinks(causal_mask(2, 2, 5), [0, 1], 2, False)
    assert causal[0, 0].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert causal[1, 0].int().tolist() == [[1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]


@pytest.mark.parametrize("fast", [True, False])
def test_a_padded_rows_first_tokens_are_read_raw(model, codec, fast) -> None:
    cache = KakeyaCache(codec, model=model, block_size=8, n_sink=1, fast=None if fast else False)
    seq, _ = _run(model, cache)
    ref = transformers.DynamicCache(config=model.config)
    ref_seq, _ = _run(model, ref)
    for layer, want in zip(cache.layers, ref.layers):
        assert layer.sink_rows() == [0, PAD] and layer.num_sealed() == 4
        for name, got, exact in (("k", layer.keys, want.keys), ("v", layer.values, want.values)):
            # Row 1's first token (sealed in the first block) comes back as the raw row; the token
            # after it as coded (lossy), row 0's sink as ever.
            assert torch.equal(got[1, :, PAD], exact[1, :, PAD]), (layer.index, name)
            assert not torch.equal(got[1, :, PAD + 1], exact[1, :, PAD + 1])
            assert torch.equal(got[0, :, 0], exact[0, :, 0])
    # No row of padding was sealed in place of row 1's first token: the sink holds it.
    assert torch.equal(cache.layers[0]._s["k"].sink[1, :, 0], ref.layers[0].keys[1, :, PAD])


def test_codes_attend_over_the_sinks_as_decoded_rows_do(model, codec) -> None:
    fast = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    slow = KakeyaCache(codec, model=model, block_size=8, n_sink=1, fast=False)
    seq_f, log_f = _run(model, fast, n=6)
    seq_s, log_s = _run(model, slow, n=6)
    assert fast.fast and torch.equal(seq_f, seq_s)
    assert (log_f - log_s).abs().max().item() <= 1e-5
    # Without the moved mask entry the codes' attention reads the coded first token: it differs.
    plain = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    orig = fast_mod.move_sinks
    fast_mod.move_sinks = lambda m, *a: m
    try:
        _, log_p = _run(model, plain, n=6)
    finally:
        fast_mod.move_sinks = orig
    assert (log_p - log_s).abs().max().item() > 1e-4


def test_batch_operations_and_a_crop_keep_the_sinks_in_place(model, codec) -> None:
    cache = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    _run(model, cache)
    layer = cache.layers[0]
    keys = layer.keys.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert layer.sink_rows() == [PAD, 0] and torch.equal(layer.keys, keys[[1, 0]])
    cache.batch_repeat_interleave(2)
    assert layer.sink_rows() == [PAD, PAD, 0, 0]
    cache.batch_select_indices(torch.tensor([2, 3]))  # the unpadded rows only
    assert layer.sink_rows() is None and torch.equal(layer.keys, keys[[0, 0]])
    # A crop back into a padded row's first tokens: every sink holds positions 0 .. again.
    cache = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    _run(model, cache)
    keys = cache.layers[0].keys.clone()
    cache.crop(PAD - cache.get_seq_length())  # keeps positions 0 .. PAD-1
    layer = cache.layers[0]
    assert layer.sink_rows() is None and layer.get_seq_length() == PAD
    assert torch.equal(layer.keys[0], keys[0, :, :PAD]) and torch.equal(layer.keys[1, :, 1:], keys[1, :, 1:PAD])
    assert not layer.keys[1, :, 0].any()  # row 1's sink place: padding, zeros now
    assert torch.equal(sink_unpadded(torch.arange(4.).view(2, 1, 2, 1), [0, 1])[:, 0, :, 0],
                       torch.tensor([[0., 1.], [0., 2.]]))


def test_a_saved_padded_batch_loads_with_its_sinks(model, codec, tmp_path) -> None:
    cache = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    _run(model, cache)
    path = cache.save(tmp_path / "padded.kkpfx", model=model)
    header, _ = persist.read_header(path)
    assert header["layers"][0]["streams"]["k"]["sink_at"] == [0, PAD]
    assert path.read_bytes()[4:6] == (4).to_bytes(2, "little")  # a version-4 file
    loaded = KakeyaCache.load(path, model, codec)
    for a, b in zip(cache.layers, loaded.layers):
        assert b.sink_rows() == [0, PAD] and torch.equal(a.keys, b.keys)
    ids, mask = _batch()
    more = torch.cat([ids, torch.full((2, 4), 7)], dim=1)
    mask = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], dim=1)
    runs = [generate(model, more, c, n=3, attention_mask=mask) for c in (cache, loaded)]
    assert torch.equal(runs[0][0], runs[1][0])


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["layers"][0]["streams"]["k"].__setitem__("sink_at", [0, 10 ** 6]), "sink_at"),
    (lambda h: h["layers"][0]["streams"]["k"].__setitem__("sink_at", [0]), "sink_at"),
    (lambda h: h["layers"][0]["streams"]["k"].__setitem__("sink_at", "5"), "sink_at"),
    (lambda h: h.__setitem__("_version", 3), "holds no padded sinks"),
])
def test_a_damaged_record_of_the_sinks_is_refused(model, codec, tmp_path, edit, match) -> None:
    cache = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    _run(model, cache)
    data = cache.save(tmp_path / "padded.kkpfx", model=model).read_bytes()
    magic, version, flags, hlen = struct.unpack_from("<4sHHI", data)
    header = json.loads(data[12:12 + hlen])
    edit(header)
    version = header.pop("_version", version)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = struct.pack("<4sHHI", magic, version, flags, len(head)) + head + data[12 + hlen:-4]
    bad = tmp_path / "bad.kkpfx"
    bad.write_bytes(body + struct.pack("<I", zlib.crc32(body)))
    with pytest.raises(CorruptDataError, match=match):
        KakeyaCache.load(bad, model, codec)


def test_compress_cache_keeps_a_padded_rows_first_tokens(model, codec) -> None:
    ids, mask = _batch()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    held = {}
    for given in (pos, None):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, cache=cache)
        raw = [layer.keys.clone() for layer in cache.layers]
        report = compress_cache(cache, codec, n_sink=1, positions=given, model=model)
        held[given is None] = report["bits"]
        for layer, k in zip(cache.layers, raw):
            assert torch.equal(layer.keys[0, :, 0], k[0, :, 0])
            assert torch.equal(layer.keys[1, :, PAD], k[1, :, PAD]) == (given is not None)
            assert not torch.equal(layer.keys[1, :, PAD + 1], k[1, :, PAD + 1])
    assert held[True] == held[False]  # the bits as a KakeyaCache holds them: the sink's places


def test_a_sliding_layer_keeps_the_sinks_until_a_query_is_a_window_past() -> None:
    """A sliding layer (Mistral, a window of 36 over a prompt of 30) keeps a padded row's first
    token in its sink while no query lies a window past position 0: read raw there, through the
    codes as through decoded blocks; past it the sinks hold positions 0 .. again and the two
    paths still agree."""
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=36, max_position_embeddings=256)).eval()
    codec = fast_codec(model, fast_recipe("before"), "before")
    ref = transformers.DynamicCache(config=model.config)
    _run(model, ref, n=3)
    logits = {}
    for fast in (True, False):
        cache = KakeyaCache(codec, model=model, block_size=8, n_sink=1, fast=None if fast else False)
        seq, _ = _run(model, cache, n=3)  # 32 tokens held: every query within the window of position 0
        layer = cache.layers[0]
        assert layer.sink_rows() == [0, PAD] and layer.window == 36
        assert torch.equal(layer.keys[1, :, PAD], ref.layers[0].keys[1, :, PAD])
        more = torch.cat([seq, torch.full((2, 8), 7)], dim=1)
        mask = torch.cat([_batch()[1], torch.ones(2, more.shape[1] - 30, dtype=torch.long)], dim=1)
        logits[fast] = generate(model, more, cache, n=4, attention_mask=mask)[1]  # past the window
        assert layer.sink_rows() is None and cache.get_seq_length() > 36
    assert (logits[True] - logits[False]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name, recipe", [("gpt_neox", "before"), ("gpt_neox", "block"), ("deepseek_v32", "after")])
def test_a_family_that_hands_the_cache_no_positions(name, recipe) -> None:
    """GPT-NeoX and DeepSeek V3.2's attention pass the cache no ``position_ids``: the cache hands a
    layer's first call the forward's, whether or not it keeps a position store (keys coded before
    RoPE: GPT-NeoX with a calibrated codec; not: a per-block recipe, MLA's latent rows), and a
    padded row's sink comes from them."""
    model = build_family(name)
    codec = (codec_for(recipes.load("balanced")) if recipe == "block"
             else fast_codec(model, fast_recipe(recipe), recipe))
    cache = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    ref = transformers.DynamicCache(config=model.config)
    _run(model, cache)
    _run(model, ref)
    for layer, want in zip(cache.layers, ref.layers):
        assert layer.sink_rows() == [0, PAD]
        assert torch.equal(layer.keys[1, :, PAD], want.keys[1, :, PAD])


def test_no_sink_no_record(model, codec, tmp_path) -> None:
    """Without a sink (``n_sink=0``) nothing is kept raw, so nothing moves, and a saved file
    stays one an earlier build reads (version 1)."""
    cache = KakeyaCache(codec, model=model, block_size=8, n_sink=0)
    _run(model, cache)
    assert cache.layers[0].sink_rows() is None
    path = cache.save(tmp_path / "nosink.kkpfx", model=model)
    assert path.read_bytes()[4:6] == (1).to_bytes(2, "little")


#: Families whose attention differs where the sinks' mask entries move: softcap (Gemma 2), learnt
#: sinks (GPT-OSS), per-layer-type RoPE (Gemma 3), interleaved pairs (Cohere), partial rotary
#: (Phi-3), KV sharing (Gemma 4), a hybrid's state layers (Qwen3-Next), a scale of its own (Granite);
#: the three added to the fast path on 2026-12-08: no position ids passed to the cache (GPT-NeoX), a
#: rotary part split off before RoPE (Phi), learned absolute positions (GPT-2).
#: (Every family of ``fast.FAMILIES`` passed this in a scratch run, 2026-12-07.)
PADDED_FAMILIES = ["gemma2", "gpt_oss", "gemma3_text", "cohere", "phi3", "gemma4_text", "qwen3_next", "granite",
                   "gpt_neox", "phi", "gpt2"]


@pytest.mark.parametrize("name", PADDED_FAMILIES)
def test_families_read_the_sinks_through_the_codes_as_decoded(name) -> None:
    model = build_family(name)
    codec = fast_codec(model, fast_recipe("before"), "before")
    ids, mask = _batch()
    runs = []
    for fast in (True, False):
        cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32", fast=None if fast else False)
        runs.append(generate(model, ids, cache, n=4, attention_mask=mask))
        assert cache.fast == fast
        assert any(getattr(layer, "sink_rows", lambda: None)() == [0, PAD] for layer in cache.layers)
    (seq_f, log_f), (seq_s, log_s) = runs
    assert torch.equal(seq_f, seq_s)
    # Rows computed after the first step carry the kernel's rounding, which can move a row across a
    # quantiser's boundary when sealed: the first steps compared closely, the rest loosely.
    err = (log_f - log_s).abs().amax(dim=(1, 2))
    scale = max(1.0, log_s.abs().max().item())
    assert err[:2].max().item() <= 1e-5 * scale and err.max().item() <= 1e-2 * scale, (name, err)
