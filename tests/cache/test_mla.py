"""Multi-head latent attention (DeepSeek V2/V3/V3.2, GLM-4.7-Flash, GLM-5, MiniCPM3, Youtu, Kimi Linear) on
tiny random-weight models (``families.MLA``): described as it caches (a latent row as keys, the
rotated key part as values, one "head" each), served by codecs of the cached rows; keys without
RoPE and calibration refused by name."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import BlockCodec, IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .families import MLA, VOCAB, build  # noqa: E402


@pytest.fixture(scope="module", params=sorted(MLA))
def family(request):
    return request.param, build(request.param)


def _generate(model, ids, cache):
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, cache=cache)
    return out.sequences, torch.stack(out.logits)


def test_described_as_cached(family) -> None:
    name, model = family
    layout = describe(model)
    assert layout.latent and layout.rope is None and "latent" in layout.rope_error
    kv = [s for s in layout.layers if s.has_kv]
    assert kv and all((s.kv_heads, s.head_dim, s.v_dim) == (1, 32, 8) for s in kv), name
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]), cache=ref)
    for s in kv:
        assert ref.layers[s.index].keys.shape[1:] == (1, 5, 32) and ref.layers[s.index].values.shape[1:] == (1, 5, 8)


def test_codecs_of_the_cached_rows_serve_it(family) -> None:
    """The identity codec generates bit for bit as DynamicCache; a per-block recipe seals the
    latent and rotated rows and generates; the evaluation codes them (identity exact)."""
    name, model = family
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    ref = transformers.DynamicCache(config=model.config)
    ref_seq, ref_logits = _generate(model, ids, ref)
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=8, n_sink=1)
    seq, logits = _generate(model, ids, cache)
    assert torch.equal(seq, ref_seq) and torch.equal(logits, ref_logits), name
    kv = describe(model).kv_layers
    mem = cache.memory()
    assert cache.nbytes_uncompressed() - mem["state"] - mem["indexer"] == sum(
        t.numel() * t.element_size() for i in kv for t in (ref.layers[i].keys, ref.layers[i].values))
    for i in kv:  # dynamic sparse attention: the indexer's keys held raw, as DynamicCache holds them
        want = getattr(ref.layers[i], "indexer_keys", None)
        assert (want is None) == (mem["indexer"] == 0)
        if want is not None:
            assert torch.equal(cache.layers[i].indexer_keys, want)
    lossy = KakeyaCache(BlockCodec(recipes.load("balanced")), model=model, block_size=8, n_sink=1)
    seq2, logits2 = _generate(model, ids, lossy)
    assert torch.isfinite(logits2).all() and all(lossy.layers[i].num_sealed() == 4 for i in kv)
    assert lossy.memory()["blobs"] < cache.memory()["blobs"]
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 31)) for _ in range(2)]
    rec = recipes.load("balanced")
    methods = harness.baseline_methods(["identity"]) + [harness.codec_method(rec, describe(model).num_layers)]
    res = harness.evaluate(model, wins, 24, methods)
    assert (res["identity"]["dppl"], res["identity"]["kl"]) == (0.0, 0.0)
    row = res[methods[1].name]  # coded (on 23-row prefixes the per-block skeletons outweigh the rows)
    assert np.isfinite(row["kl"]) and row["kl"] > 0 and row["bits_per_element"] > 0


def test_keys_without_rope_and_calibration_refused(family) -> None:
    name, model = family
    with pytest.raises(kt.UnsupportedModelError, match=f"'{name}'.*latent row without RoPE"):
        KakeyaCache(IdentityCodec(pre_rope_keys=True), model=model)
    for rope in ("before", "after"):
        with pytest.raises(kt.UnsupportedModelError, match=f"'{name}': multi-head latent attention caches a latent"):
            calibration.collect(model, [[3, 4, 5, 6, 7, 8]], samples=2, rope=rope)


def test_indexer_keys_are_not_saved(tmp_path) -> None:
    model = build("deepseek_v32")
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=8)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11]]), cache=cache)
    assert cache.memory()["indexer"] == 3 * 9 * 16 * 4  # three layers, nine tokens, 16 float32 each
    keys = cache.layers[0].indexer_keys.clone()
    cache.batch_repeat_interleave(2)  # beam search: the indexer's keys follow the rows
    assert cache.layers[0].indexer_keys.shape == (2, 9, 16)
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(cache.layers[0].indexer_keys, keys)
    cache.layers[0].crop(-2)
    assert cache.layers[0].indexer_keys.shape == (1, 7, 16) and cache.layers[0].get_seq_length() == 7
    with pytest.raises(kt.UnsupportedModelError, match=r"'deepseek_v32': layers \[0, 1, 2\] hold .* an indexer's keys"):
        cache.save(tmp_path / "d.kkpfx")
