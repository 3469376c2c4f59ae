"""DeepSeek V4's compressed attention (``kakeyaturbo.cache.compressed``): a sliding window of K=V
rows beside the entries its compressor emits (CSA: one per 4 tokens, with an indexer's entries;
HCA: one per ``rate``), the entries coded by the cache (their channels without RoPE as keys, the
rotated ones as values). A tiny random-weight model with one layer of each kind: described,
served exactly by the identity codec (greedy tokens and logits as ``DynamicCache``'s, beams too),
coded by a per-block recipe and by a calibration of its own (statistics and sensitivity of the
entries, ``kakeyaturbo.calibration.compressed``), through ``compress_cache`` and the evaluation as
through the cache, saved and loaded, rolled back after a refused call, and refused where it
cannot work (crop)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING  # noqa: E402

from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import BlockCodec, IdentityCodec, KakeyaCache, compress_cache, persist  # noqa: E402
from kakeyaturbo.cache.compressed import CompressedEntries  # noqa: E402
from kakeyaturbo.cache.layer import KakeyaLayer  # noqa: E402
from kakeyaturbo.calibration import Calibration  # noqa: E402
from kakeyaturbo.calibration.compressed import COMPRESSED_POINT  # noqa: E402
from kakeyaturbo.errors import (CorruptDataError, InvalidInputError, InvalidParameterError,  # noqa: E402
                                KakeyaError, ModelMismatchError)
from kakeyaturbo.eval import harness, peers  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .test_persist import _rewrite, _with_header  # noqa: E402

VOCAB = 96
TYPES = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def v4():
    torch.manual_seed(0)
    cfg = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, layer_types=TYPES, num_attention_heads=4,
        head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_lora_rank=16, o_groups=2, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, index_n_heads=2, index_head_dim=16,
        index_topk=3, sliding_window=8, hc_mult=2, num_nextn_predict_layers=0,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    for p in model.parameters():  # random weights of a usable scale
        if p.ndim >= 2:
            torch.nn.init.normal_(p, std=0.08)
    return model


def _ids(batch: int = 2, n: int = 70, seed: int = 1) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(3, VOCAB, (batch, n)))


def _generate(model, cache, ids, **kw):
    kw.setdefault("max_new_tokens", 14)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)


def test_layout(v4) -> None:
    layout = describe(v4)
    assert [s.kind for s in layout.layers] == ["compressed", "compressed", "sliding"]
    assert [s.rate for s in layout.layers] == [8, 4, None]
    assert [s.window for s in layout.layers] == [8, 8, 8]
    # The entries split: 24 channels without RoPE (keys), the 8 rotated ones (values).
    assert [(s.q_heads, s.kv_heads, s.head_dim, s.v_dim) for s in layout.layers] == [(4, 1, 24, 8)] * 2 + [
        (4, 1, 32, None)]
    assert layout.kv_layers == (0, 1, 2) and all(layout.rope.layer(i) is None for i in range(3))
    # Calibrated: the compressed layers; the sliding one holds at most 7 rows and stays raw.
    assert layout.shape_groups() == (((0, 1), (4, 1, 24)),)


def test_identity_codec_is_dynamic_cache(v4) -> None:
    ids = _ids()
    ref = _generate(v4, DynamicCache(config=v4.config), ids)
    cache = KakeyaCache(IdentityCodec(), model=v4, block_size=4, n_sink=1)
    out = _generate(v4, cache, ids)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    hca, csa, sliding = cache.layers
    assert isinstance(hca, CompressedEntries) and isinstance(csa, CompressedEntries)
    assert isinstance(sliding, KakeyaLayer)
    # 83 tokens: 10 HCA entries, 20 CSA entries (4 sealed blocks of 4 after the sink entry).
    assert hca.entries.get_seq_length() == 10 and csa.entries.get_seq_length() == 20
    assert csa.entries.num_sealed() == 4 and hca.entry_count["compressor"] == 10
    mem = cache.memory()
    assert mem["blobs"] > 0 and mem["indexer"] == 2 * 20 * 16 * 4 and mem["state"] > 0
    assert cache.nbytes() == sum(v for k, v in mem.items() if k != "rope_table")
    # Every held byte of DynamicCache's layers is counted once (its window's K=V rows once).
    raw = ref.past_key_values.layers
    expect = sum(_bytes(x) for layer in raw[:2] for x in _held(layer)) + 2 * _bytes(raw[2].keys)
    assert cache.nbytes_uncompressed() == expect
    # transformers' own layer classes stay those of every DynamicCache.
    assert DYNAMIC_LAYER_TYPE_MAPPING["compressed_sparse_attention"] is type(raw[1])
    assert type(raw[1]).__name__ == "DeepseekV4CSACache"


def _entries(layer):
    """The entries a compressed layer of a KakeyaCache holds, decoded: ``[B, n, D]``."""
    return torch.cat([layer.entries.keys, layer.entries.values], dim=-1)[:, 0]


def _bytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _held(layer):
    yield layer.keys
    for f in ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"):
        yield from getattr(layer, f, {}).values()


def test_prefill_in_pieces_and_beams(v4) -> None:
    ids = _ids(batch=1, n=61, seed=2)
    caches = [DynamicCache(config=v4.config), KakeyaCache(IdentityCodec(), model=v4, block_size=4)]
    logits = []
    with torch.no_grad():
        for c in caches:
            parts = [v4(input_ids=ids[:, a:b], cache=c).logits for a, b in ((0, 23), (23, 50), (50, 61))]
            logits.append(torch.cat(parts, dim=1))
    assert torch.equal(logits[0], logits[1])
    ref = _generate(v4, DynamicCache(config=v4.config), ids, num_beams=3, max_new_tokens=9)
    out = _generate(v4, KakeyaCache(IdentityCodec(), model=v4, block_size=4), ids, num_beams=3, max_new_tokens=9)
    assert torch.equal(out.sequences, ref.sequences)


def test_batch_rows_move_with_every_part(v4) -> None:
    ids = _ids(batch=2, n=45, seed=3)
    nxt = torch.tensor([[5], [7]])
    with torch.no_grad():
        cache = KakeyaCache(IdentityCodec(), model=v4, block_size=4)
        v4(input_ids=ids, cache=cache)
        moved = KakeyaCache(IdentityCodec(), model=v4, block_size=4)
        v4(input_ids=ids, cache=moved)
        moved.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
        moved.batch_select_indices(torch.tensor([1, 2]))  # rows 0, 1 again
        want = v4(input_ids=nxt, cache=cache).logits
        got = v4(input_ids=nxt, cache=moved).logits
    assert torch.equal(got, want)
    with pytest.raises(InvalidInputError, match="batch rows"):
        moved.reorder_cache(torch.tensor([0, 5]))


def test_a_per_block_recipe_codes_the_entries(v4) -> None:
    ids = _ids(batch=1, n=400, seed=4)
    ref = DynamicCache(config=v4.config)
    cache = KakeyaCache.from_recipe(recipes.load("balanced"), model=v4, block_size=32)
    with torch.no_grad():
        want = v4(input_ids=ids, cache=ref).logits
        got = v4(input_ids=ids, cache=cache).logits
    assert torch.equal(got, want)  # the tokens of a call attend to their own rows exactly
    csa = cache.layers[1]
    assert csa.entries.num_sealed() == 3 and cache.memory()["blobs"] > 0
    exact = ref.layers[1].compressed_kv["compressor"]
    held = _entries(csa)
    assert held.shape == exact.shape
    err = float((held - exact).norm() / exact.norm())
    assert 0 < err < 0.2
    with torch.no_grad():
        step = v4(input_ids=torch.tensor([[11]]), cache=cache).logits
    assert torch.isfinite(step).all()


def test_a_refused_call_is_rolled_back(v4, monkeypatch) -> None:
    ids = _ids(batch=1, n=37, seed=5)
    ref = DynamicCache(config=v4.config)
    cache = KakeyaCache(IdentityCodec(), model=v4, block_size=4)
    with torch.no_grad():
        v4(input_ids=ids, cache=ref)
        v4(input_ids=ids, cache=cache)
        before = cache.memory(), [dict(lay.entry_count) for lay in cache.layers[:2]]

        def refuse(*a, **k):
            raise InvalidInputError("refused here")

        monkeypatch.setattr(cache.layers[2], "update", refuse)
        with pytest.raises(InvalidInputError, match="refused here"):
            v4(input_ids=_ids(batch=1, n=9, seed=6), cache=cache)
        monkeypatch.undo()
        assert (cache.memory(), [dict(lay.entry_count) for lay in cache.layers[:2]]) == before
        more = _ids(batch=1, n=9, seed=7)
        assert torch.equal(v4(input_ids=more, cache=cache).logits, v4(input_ids=more, cache=ref).logits)
        bad = v4.get_input_embeddings()(more[:, :2]).clone()
        bad[0, 1, 0] = float("nan")
        with pytest.raises(InvalidInputError, match="NaN"):
            v4(inputs_embeds=bad, cache=cache)


def test_what_cannot_work_is_refused(v4, tmp_path) -> None:
    cache = KakeyaCache(IdentityCodec(), model=v4, block_size=4)
    with torch.no_grad():
        v4(input_ids=_ids(batch=1, n=20), cache=cache)
    with pytest.raises(RuntimeError, match="cannot be cropped"):
        cache.crop(-1)
    assert cache.get_seq_length() == 20
    with pytest.raises(InvalidParameterError, match="fewer than two entries"):
        calibration.collect(v4, [list(range(3, 12))], n_sink=1, samples=4)


def test_compress_cache_codes_the_entries_once(v4) -> None:
    ids = _ids(batch=2, n=300, seed=8)
    cache = DynamicCache(config=v4.config)
    with torch.no_grad():
        v4(input_ids=ids, cache=cache)
    hca, csa, sliding = cache.layers
    windows = [lay.keys.clone() for lay in (hca, csa)]
    indexer = csa.compressed_kv["indexer"].clone()
    entries = [lay.compressed_kv["compressor"].clone() for lay in (hca, csa)]
    window = sliding.keys.clone()
    codec = BlockCodec(recipes.load("balanced"))
    with pytest.raises(InvalidParameterError, match="pass model="):
        compress_cache(cache, codec, n_sink=2)
    out = compress_cache(cache, codec, n_sink=2, model=v4)
    # Every tensor held counts once: the windows (K=V), the entries, the indexer's entries, and
    # the sliding layer's K and V.
    counted = sum(t.numel() for lay in (hca, csa) for t in [lay.keys, *lay.compressed_kv.values()])
    assert out["elements"] == counted + 2 * window.numel()
    coded = sum(2 * (e.shape[1] - 2) * 32 for e in entries) + 2 * window.numel()  # the sliding layer's too
    assert out["raw_elements"] == out["elements"] - coded and out["compressed_layers"] == [0, 1, 2]
    assert out["bits"] == 8 * out["blob_bytes"] + 16 * out["raw_elements"]
    for lay, e, old in zip((hca, csa), entries, windows):
        new = lay.compressed_kv["compressor"]
        assert torch.equal(new[:, :2], e[:, :2]) and not torch.equal(new, e)
        assert float((new - e).norm() / e.norm()) < 0.2
        assert torch.equal(lay.keys, old) and lay.values is lay.keys
    assert torch.equal(csa.compressed_kv["indexer"], indexer)
    with torch.no_grad():  # the model continues from the coded entries
        assert torch.isfinite(v4(input_ids=ids[:, :1], cache=cache).logits).all()


def test_the_evaluation_codes_the_entries_for_every_method(v4) -> None:
    g = np.random.default_rng(9)
    wins = [list(g.integers(3, VOCAB, 217)) for _ in range(2)]
    methods = harness.baseline_methods(["identity", "fp8_e4m3"]) + [
        harness.Method("exact", harness._no_quantise, kind="codec", codec=IdentityCodec()),
        harness.codec_method(recipes.load("balanced"), 3)]
    res = harness.evaluate(v4, wins, 200, methods)
    assert res["identity"]["kl"] == 0 and res["exact"]["kl"] == 0
    # fp8 codes the windows raw (16 bits), the entries and the sliding layer's K and V at 8 + scales.
    assert 8 < res["fp8_e4m3"]["bits_per_element"] < 16 and res["fp8_e4m3"]["kl"] > 0
    assert res["kakeyaturbo:balanced"]["kl"] > 0
    assert "compressed-attention" in peers.unsupported("quanto-int4", v4)
    cache = DynamicCache(config=v4.config)
    with torch.no_grad():
        v4(input_ids=torch.tensor([wins[0]]), cache=cache)
    hca, csa, sliding = cache.layers
    entries = [lay.compressed_kv["compressor"].clone() for lay in (hca, csa)]
    windows = [lay.keys.clone() for lay in (hca, csa)]
    fp8 = harness.baseline_methods(["fp8_e4m3"])[0]
    with pytest.raises(InvalidParameterError, match="pass model="):
        harness.compress_prefix(cache, fp8)
    bits, elems = harness.compress_prefix(cache, fp8, model=v4)
    assert elems == sum(t.numel() for lay in (hca, csa) for t in [lay.keys, *lay.compressed_kv.values()]) \
        + 2 * sliding.keys.numel()
    for lay, e, w in zip((hca, csa), entries, windows):
        assert not torch.equal(lay.compressed_kv["compressor"], e) and torch.equal(lay.keys, w)


@pytest.fixture(scope="module")
def fitted(v4):
    g = np.random.default_rng(10)
    wins = [list(g.integers(3, VOCAB, 120)) for _ in range(3)]
    stats = calibration.collect(v4, wins, n_sink=1, samples=16)
    sens = calibration.collect_sensitivity(v4, wins, n_sink=1, score=12)
    return wins, stats, sens


def test_statistics_are_the_entries_moments(v4, fitted) -> None:
    wins, stats, sens = fitted
    assert stats.layer_index == (0, 1) and stats.meta["hooks"] == COMPRESSED_POINT
    assert stats.q2.shape == (2, 1, 24, 24) and stats.o_gram.shape == (2, 1, 8, 8)
    assert stats.k_samples.shape == (2, 1, 16, 24) and stats.v_samples.shape == (2, 1, 16, 8)
    assert sens.k.shape == (2, 1, 24, 24) and sens.v.shape == (2, 1, 8, 8)
    for f in (sens.k, sens.v):  # Fisher matrices: symmetric, positive semi-definite, not zero
        assert np.allclose(f, np.swapaxes(f, -1, -2)) and np.linalg.eigvalsh(f).min() > -1e-9 * f.max() > -1
        assert (np.abs(f).reshape(2, -1).max(axis=1) > 0).all()
    # Uniform weighting: the plain moments of the entries after the first, every window.
    flat = calibration.collect(v4, wins, n_sink=1, samples=0, weighting="uniform")
    for j in (0, 1):
        rows = []
        for w in wins:
            ref = DynamicCache(config=v4.config)
            with torch.no_grad():
                v4(input_ids=torch.tensor([w]), cache=ref)
            rows.append(ref.layers[j].compressed_kv["compressor"][0, 1:].double())
        x = torch.cat(rows).numpy()
        assert np.allclose(flat.k_mean[j, 0], x[:, :24].mean(0), atol=1e-6)
        assert np.allclose(flat.v_cov[j, 0], np.cov(x[:, 24:].T, bias=True), atol=1e-6)
    # Attention weighting moves the means away from the plain ones.
    assert not np.allclose(stats.k_mean, flat.k_mean, atol=1e-4)


def test_a_calibrated_cache_codes_the_entries_as_compress_cache(v4, fitted, tmp_path) -> None:
    _, stats, sens = fitted
    cal = Calibration.for_model(v4, stats, sens)
    back = Calibration.load(cal.save(tmp_path / "v4.kkcal")).check_model(v4)
    cache = KakeyaCache.from_pretrained(v4, "calibrated-4bit", calibration=back, block_size=8)
    assert not cache.fast and "not among the families" in cache.fast_reason
    ids = _ids(batch=1, n=150, seed=11)
    ref = DynamicCache(config=v4.config)
    with torch.no_grad():
        v4(input_ids=ids, cache=cache)
        v4(input_ids=ids, cache=ref)
    # The codec codes rows one by one: the cache's sealed blocks decode to what compress_cache
    # writes for the same entries.
    codec = cache.codec
    out = compress_cache(ref, codec, n_sink=1, model=v4)
    assert out["compressed_layers"] == [0, 1] and 3.5 < 8 * out["blob_bytes"] / sum(
        (e.shape[1] - 1) * 32 for e in (ref.layers[i].compressed_kv["compressor"] for i in (0, 1))) < 4.2
    for i in (0, 1):
        sealed = cache.layers[i].entries.num_sealed() * 8
        assert sealed > 0
        got = _entries(cache.layers[i])[:, 1:sealed + 1]
        assert torch.equal(got, ref.layers[i].compressed_kv["compressor"][:, 1:sealed + 1])
    assert cache.nbytes() < cache.nbytes_uncompressed()
    fresh = KakeyaCache.from_pretrained(v4, "calibrated-4bit", calibration=back, block_size=8)
    res = _generate(v4, fresh, _ids(batch=1, n=40, seed=12), max_new_tokens=6)
    assert res.sequences.shape == (1, 46)
    with pytest.raises(ModelMismatchError):
        codec.check_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1)))


@pytest.mark.parametrize("tokens", [3, 37, 70])
def test_a_saved_cache_continues_as_the_one_saved(v4, fitted, tokens, tmp_path) -> None:
    """Before the first entry (3 tokens), with entries raw and sealed, under the identity codec, a
    per-block recipe and the calibrated one; a header whose counts or states do not add up is
    refused."""
    _, stats, sens = fitted
    ids = _ids(batch=2, n=tokens, seed=13)
    nxt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    for n, cache in enumerate([KakeyaCache(IdentityCodec(), model=v4, block_size=4, n_sink=1),
                               KakeyaCache.from_recipe(recipes.load("balanced"), model=v4, block_size=4),
                               KakeyaCache.from_pretrained(v4, "calibrated-4bit", block_size=4,
                                                           calibration=Calibration.for_model(v4, stats, sens))]):
        with torch.no_grad():
            v4(input_ids=ids, cache=cache)
        path = cache.save(tmp_path / f"v4-{n}.kkpfx")
        loaded = KakeyaCache.load(path, v4, codec=cache.codec)
        with torch.no_grad():
            assert torch.equal(v4(input_ids=nxt, cache=loaded).logits, v4(input_ids=nxt, cache=cache).logits)
    header, _ = persist.read_header(path)
    assert header["layers"][1]["counts"] == {"cumulative_length": tokens, "entry_count.compressor": tokens // 4,
                                             "entry_count.indexer": tokens // 4}
    bad = tmp_path / "bad.kkpfx"
    for edit, match in ((lambda h: h["layers"][1]["counts"].update(cumulative_length=tokens + 1), "the model's layer"),
                        (lambda h: h["layers"][0]["counts"].update({"entry_count.compressor": 99}), "entries held"),
                        (lambda h: h["layers"][0]["counts"].pop("cumulative_length"), "counts"),
                        (lambda h: h["layers"][2].update(counts={"cumulative_length": 1}), "keeps none")):
        with pytest.raises(CorruptDataError, match=match):
            KakeyaCache.load(_with_header(path, bad, edit), v4, codec=cache.codec)
    data = path.read_bytes()  # damage anywhere under a recomputed checksum: loads or a KakeyaError
    rng = np.random.default_rng(tokens)
    for _ in range(15):
        d = bytearray(data)
        for at in rng.choice(len(d) - 4, size=2, replace=False):
            d[at] ^= int(rng.integers(1, 256))
        try:
            KakeyaCache.load(_rewrite(bad, bytes(d)), v4, codec=cache.codec)
        except KakeyaError:
            pass



def test_a_deep_copy_continues_as_the_original(v4, fitted) -> None:
    """``copy.deepcopy`` (tests/cache/test_copy.py for the other kinds of layer): the compressor's
    entries, raw and sealed, its window, buffers, overlap state and the indexer's entries copied;
    the copy continues with the original's logits, and what it takes leaves the original as it
    was (which then continues with the same logits)."""
    _, stats, sens = fitted
    ids, nxt = _ids(batch=2, n=37, seed=13), torch.tensor([[5, 6, 7], [8, 9, 10]])
    for cache in (KakeyaCache(IdentityCodec(), model=v4, block_size=4, n_sink=1),
                  KakeyaCache.from_pretrained(v4, "calibrated-4bit", block_size=4,
                                              calibration=Calibration.for_model(v4, stats, sens))):
        with torch.no_grad():
            v4(input_ids=ids, cache=cache)
            twin = copy.deepcopy(cache)
            assert torch.equal(v4(input_ids=nxt, cache=twin).logits, v4(input_ids=nxt, cache=cache).logits)
