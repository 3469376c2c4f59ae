"""Multi-head latent attention (DeepSeek V2/V3/V3.2, GLM-4.7-Flash, GLM-5, MiniCPM3, Youtu, Kimi Linear) on
tiny random-weight models (``families.MLA``): described as it caches (a latent row as keys, the
rotated key part as values, one "head" each), served by codecs of the cached rows, calibrated on
them (statistics and sensitivity taken at the cache); the calibration of the hybrids (Kimi Linear,
Ling 2.5) refused by name."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import BlockCodec, IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.codec.attention import LayerCodes  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .families import MLA, VOCAB, build  # noqa: E402

#: Latent attention beside recurrent layers: served, not calibrated (refused by name).
HYBRIDS = {"kimi_linear", "bailing_hybrid"}


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
    assert layout.latent and layout.rope_error is None and set(layout.rope.layers) == {None}  # no RoPE on the latent
    kv = [s for s in layout.layers if s.has_kv]
    # (dots.llm3's sliding layer: a latent of its own width, from its per-layer config)
    full = [s for s in kv if s.kind == "full"]
    assert full and all((s.kv_heads, s.head_dim, s.v_dim) == (1, 32, 8) for s in full), name
    ref = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]), cache=ref)
    for s in kv:
        assert s.kv_heads == 1 and ref.layers[s.index].keys.shape[1:] == (1, 5, s.head_dim)
        assert ref.layers[s.index].values.shape[1:] == (1, 5, s.v_dim)


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
    # dynamic sparse attention: the indexer's keys held raw, as DynamicCache holds them (none on a
    # layer that reuses another's picks: HY-V4's shared indexer layers)
    held = [getattr(ref.layers[i], "indexer_keys", None) for i in kv]
    assert all(k is None for k in held) == (mem["indexer"] == 0)
    for i, want in zip(kv, held):
        if want is not None:
            assert torch.equal(cache.layers[i].indexer_keys, want)
        else:
            assert getattr(cache.layers[i], "indexer_keys", None) is None
    lossy = KakeyaCache(BlockCodec(recipes.load("balanced")), model=model, block_size=8, n_sink=1)
    seq2, logits2 = _generate(model, ids, lossy)
    full = [i for i in kv if describe(model).layers[i].kind == "full"]  # (a sliding layer holds its window)
    assert torch.isfinite(logits2).all() and all(lossy.layers[i].num_sealed() == 4 for i in full)
    assert lossy.memory()["blobs"] < cache.memory()["blobs"]
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 31)) for _ in range(2)]
    rec = recipes.load("balanced")
    methods = harness.baseline_methods(["identity"]) + [harness.codec_method(rec, describe(model).num_layers)]
    res = harness.evaluate(model, wins, 24, methods)
    assert (res["identity"]["dppl"], res["identity"]["kl"]) == (0.0, 0.0)
    row = res[methods[1].name]  # coded (on 23-row prefixes the per-block skeletons outweigh the rows)
    assert np.isfinite(row["kl"]) and row["kl"] > 0 and row["bits_per_element"] > 0


def test_calibrated_on_the_rows_it_caches(family, tmp_path) -> None:
    """Statistics and sensitivity of the cached rows: the uniform moments are those of the
    DynamicCache's rows, the latent's queries map onto the scores, the sensitivity is the
    gradient through a prefilled DynamicCache (one cached position: ``g g^T``); the shipped
    recipe's codecs then serve the cache (keys without RoPE: the latent as cached), generate and
    evaluate, from a calibration file too. The hybrids are refused by name."""
    from kakeyaturbo.calibration import latent

    name, model = family
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 20)) for _ in range(2)]
    if name in HYBRIDS:
        for collect in (calibration.collect, calibration.collect_sensitivity):
            with pytest.raises(kt.UnsupportedModelError, match=f"'{name}': latent attention beside recurrent"):
                collect(model, wins)
        return
    kv = describe(model).calibration_group()[0]  # the full latent layers (dots.llm3's sliding one: raw)
    uniform = calibration.collect(model, wins, n_sink=1, samples=4, weighting="uniform")
    rows = {"k": [], "v": []}
    for w in wins:
        ref = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([w]), cache=ref)
        rows["k"].append(torch.stack([ref.layers[i].keys[0, 0, 1:] for i in kv]))
        rows["v"].append(torch.stack([ref.layers[i].values[0, 0, 1:] for i in kv]))
    for s, mean in (("k", uniform.k_mean), ("v", uniform.v_mean)):
        x = torch.cat(rows[s], dim=1).double()
        np.testing.assert_allclose(mean[:, 0], x.mean(dim=1).numpy(), rtol=0, atol=1e-6)
    assert uniform.dims == (32, 8) and uniform.k_samples.shape == (len(kv), 1, 4, 32)
    assert uniform.v_samples.shape[-1] == 8
    mod = latent._modules(model, kv)[kv[0]]
    c = torch.randn(32, dtype=torch.float64)
    keys = mod.kv_b_proj.double()(c).reshape(4, 32)[:, :16]  # each head's keys without RoPE
    torch.testing.assert_close(latent._key_up(mod) @ c, keys)
    mod.kv_b_proj.float()
    # The sensitivity with one cached position, against the gradient through a DynamicCache.
    score = 3
    w = wins[0][:1 + 1 + score + 1]
    sens = calibration.collect_sensitivity(model, [w], n_sink=1, score=score)
    ids = torch.tensor([w])
    for row, i in enumerate(kv):
        for s, attr in (("k", "keys"), ("v", "values")):
            with torch.no_grad():
                _, cache = harness._forward(model, ids[:, :2])
            x = getattr(cache.layers[i], attr)
            offset = torch.zeros(x.shape[-1], requires_grad=True)
            y = x.clone()
            y[0, 0, 1] = y[0, 0, 1] + offset
            setattr(cache.layers[i], attr, y)
            logits, _ = harness._forward(model, ids[:, 2:-1], cache)
            nll = -torch.log_softmax(logits[0].double(), -1).gather(1, ids[0, 3:, None]).sum()
            (grad,) = torch.autograd.grad(nll, [offset])
            grad = grad.double().numpy()
            np.testing.assert_allclose(sens.of(s)[row, 0], np.outer(grad, grad), rtol=1e-4,
                                       atol=1e-6 * np.abs(grad).max() ** 2, err_msg=f"{name} {s} {i}")
    # The shipped recipe on them: keys without RoPE are the latent as cached.
    stats = calibration.collect(model, wins, n_sink=1, samples=8)
    sens = calibration.collect_sensitivity(model, wins, n_sink=1, score=6)
    cal = calibration.Calibration.for_model(model, stats, sens).save(tmp_path / "mla.kkcal")
    cache = KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration=cal, block_size=8)
    assert cache.codec.pre_rope_keys and {c.d for (s, _, _), c in cache.codec.codecs.items() if s == "v"} == {8}
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    seq, logits = _generate(model, ids, cache)
    assert torch.isfinite(logits).all() and all(cache.layers[i].num_sealed() == 4 for i in kv)
    assert 0 < cache.memory()["blobs"] and cache.nbytes() < cache.nbytes_uncompressed()
    exact = KakeyaCache(IdentityCodec(pre_rope_keys=True), model=model, block_size=8, n_sink=1)
    ref = transformers.DynamicCache(config=model.config)
    assert torch.equal(_generate(model, ids, exact)[1], _generate(model, ids, ref)[1])
    rec = recipes.load("calibrated-4bit")
    m = harness.codec_method(rec, describe(model).num_layers, stats=stats, sensitivity=sens)
    res = harness.evaluate(model, [list(w) + list(w[:11]) for w in wins], 24, [m])[m.name]
    # (Dynamic sparse attention's indexer keys count raw, at 16 bits: above 8 in A.X-K2's tiny model.)
    assert 3.0 < res["bits_per_element"] < 9.0 and np.isfinite(res["kl"])


def test_indexer_keys_follow_the_rows_and_are_saved(tmp_path) -> None:
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
    loaded = KakeyaCache.load(cache.save(tmp_path / "d.kkpfx"), model)
    assert [lay.indexer_keys.shape[1] for lay in loaded.layers] == [7, 9, 9]
    assert all(torch.equal(a.indexer_keys, b.indexer_keys) for a, b in zip(loaded.layers, cache.layers))


def test_a_calibrated_cache_is_saved_and_continued(tmp_path) -> None:
    """A calibrated cache of latent rows saved to a prefix file and loaded with its calibration
    continues token for token as the cache it was saved from."""
    model = build("deepseek_v3")
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 20)) for _ in range(2)]
    cal = calibration.Calibration.for_model(model, calibration.collect(model, wins, samples=8),
                                            calibration.collect_sensitivity(model, wins, score=6))
    cal = cal.save(tmp_path / "d.kkcal")
    cache = KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration=cal, block_size=8)
    ids = torch.randint(3, VOCAB, (1, 25), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
    loaded = KakeyaCache.load(cache.save(tmp_path / "d.kkpfx"), model, calibration=cal)
    assert all(layer.num_sealed() == 3 for layer in loaded.layers)
    ids = torch.cat([ids, torch.tensor([[5, 6, 7]])], dim=1)
    a = model.generate(ids, max_new_tokens=5, do_sample=False, cache=loaded, pad_token_id=0)
    b = model.generate(ids, max_new_tokens=5, do_sample=False, cache=cache, pad_token_id=0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(set(MLA) - HYBRIDS))
def test_attention_over_the_codes(name, monkeypatch) -> None:
    """A calibrated cache of latent rows attends over their codes in the absorbed form
    (``fast._attend_latent``): no sealed block is ever decoded or expanded, and the tokens and
    logits are those of the same cache decoding its blocks under the model's own sdpa attention
    (dynamic sparse attention's picks folded into the mask as the model folds them there);
    another cache computes as before once the attention function and ``expand_kv`` are wrapped."""
    from kakeyaturbo.cache import fast as fast_mod
    from kakeyaturbo.cache.layer import KakeyaLayer

    from .conftest import fast_codec, fast_recipe, generate

    model = build(name)
    codec = fast_codec(model, fast_recipe("before"), "before")
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    dyn = generate(model, ids, transformers.DynamicCache(config=model.config), n=4)
    slow = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=False)
    assert model.config._attn_implementation in ("sdpa", "eager")  # (HY-V4: eager only)
    seq_s, log_s = generate(model, ids, slow, n=10)
    fast = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    assert fast.fast, fast.fast_reason
    orig = KakeyaLayer._block

    def guarded(self, stream, j):
        raise AssertionError(f"layer {self.index} decoded sealed block {j} of {stream}")

    monkeypatch.setattr(KakeyaLayer, "_block", guarded)
    calls = [0]
    real = LayerCodes.kernel_attend

    def counted(self, *a):
        calls[0] += bool(a[11])  # latent (q, the four raw arrays, mask, scale, softcap, window, threads, rope, latent)
        return real(self, *a)

    monkeypatch.setattr(LayerCodes, "kernel_attend", counted)
    seq_f, log_f = generate(model, ids, fast, n=10)
    monkeypatch.setattr(KakeyaLayer, "_block", orig)
    kv = describe(model).calibration_group()[0]
    assert calls[0] >= 9 * len(kv) and all(fast.layers[i].num_sealed() >= 9 for i in kv)
    assert torch.equal(seq_f, seq_s), name
    scale = max(1.0, log_s.abs().max().item())
    err = (log_f - log_s).abs().amax(dim=(1, 2))
    assert err[:3].max().item() <= 1e-5 * scale and err.max().item() <= 1e-2 * scale, (name, err)
    # Any other cache: the model's own expansion and attention, bit for bit.
    assert model.config._attn_implementation in fast_mod.NAMES.values()
    again = generate(model, ids, transformers.DynamicCache(config=model.config), n=4)
    assert torch.equal(again[0], dyn[0]) and torch.equal(again[1], dyn[1])
    # The kernel over latent rows is the Rust one: on a GPU such a layer takes the slow path.
    layer = fast.layers[kv[0]]
    assert layer.latent and layer._kernel_for(torch.device("cuda")) is None
    layer.kernel = "triton"
    assert layer._kernel_for(torch.device("cpu")) == "rust"


def test_attention_over_the_codes_of_a_bfloat16_model() -> None:
    """A bfloat16 model: the projections into and out of the latent run in its dtype (as its
    own ``expand_kv``); the tokens are those of the slow path, the logits within bfloat16's
    rounding (2**-6 of their largest; measured 0.0039 on logits up to 0.60, 2026-12-05)."""
    from .conftest import fast_codec, fast_recipe, generate

    model = build("deepseek_v3")
    codec = fast_codec(model, fast_recipe("before"), "before")
    model = model.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    seq_s, log_s = generate(model, ids, KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=False), n=10)
    fast = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    assert fast.fast, fast.fast_reason
    seq_f, log_f = generate(model, ids, fast, n=10)
    assert torch.equal(seq_f, seq_s)
    assert (log_f.float() - log_s.float()).abs().max().item() <= 2.0 ** -6 * log_s.abs().max().item()
