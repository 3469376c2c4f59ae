"""Hybrid models (recurrent, state-space or convolution layers between attention layers): only
the K/V layers are described, calibrated, coded and sealed; the others keep transformers' own
cache layers. What the tiny families of ``families.py`` do not show: the layer index carried
by statistics, sensitivity, calibration and codec files, and what is refused."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.calibration import AttentionStats, Calibration, ModelCodec, Sensitivity  # noqa: E402
from kakeyaturbo.errors import ModelMismatchError  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .families import VOCAB, _make, build  # noqa: E402


@pytest.fixture(scope="module")
def qwen3_next():
    return build("qwen3_next")


@pytest.fixture(scope="module")
def fitted(qwen3_next):
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 24)) for _ in range(3)]
    stats = calibration.collect(qwen3_next, wins, n_sink=1, samples=8)
    sens = calibration.collect_sensitivity(qwen3_next, wins, n_sink=1, score=6)
    return stats, sens


def test_layout_lists_the_kv_layers(qwen3_next) -> None:
    layout = describe(qwen3_next)
    assert [s.kind for s in layout.layers] == ["state", "full", "state"]
    assert layout.kv_layers == (1,) and layout.calibration_group() == ((1,), (4, 2, 16))
    assert [s.cache_type for s in layout.layers] == ["linear_attention", "full_attention", "linear_attention"]
    assert layout.rope.layer(0) is None and layout.rope.layer(1) is not None
    nemo = describe(build("nemotron_h"))  # a Mamba-2 layer, attention, an MLP-only layer
    assert [s.cache_type for s in nemo.layers] == ["linear_attention", "full_attention", "dummy"]
    assert nemo.kv_layers == (1,)


def test_statistics_and_codecs_are_keyed_by_the_model_layer(qwen3_next, fitted, tmp_path) -> None:
    stats, sens = fitted
    assert stats.q2.shape[0] == 1 and stats.layer_index == (1,) and stats.meta["layer_index"] == [1]
    assert sens.layer_index == (1,)
    codec = ModelCodec(stats, recipes.load("calibrated-4bit"), sensitivity=sens)
    assert codec.layers == (1,) and {k[1] for k in codec.codecs} == {1}
    codec.check_model(qwen3_next)
    # The codec file and the calibration file carry the layer index.
    back = ModelCodec.load(codec.save(tmp_path / "m.kkcodec", qwen3_next)).check_model(qwen3_next)
    assert back.layers == (1,)
    cal = Calibration.for_model(qwen3_next, stats, sens)
    again = Calibration.load(cal.save(tmp_path / "m.kkcal")).check_model(qwen3_next)
    assert again.stats.layer_index == (1,) and again.sensitivity.layer_index == (1,)
    # Statistics of layer 1 do not fit a model whose K/V layer is another.
    moved = AttentionStats(meta=dict(stats.meta, layer_index=[2]),
                           **{k: getattr(stats, k) for k in AttentionStats.ARRAYS})
    with pytest.raises(ModelMismatchError, match=r"layers \[2\].*calibrated K/V layers.*\[1\]"):
        Calibration.for_model(qwen3_next, moved)
    moved_sens = Sensitivity(meta=dict(sens.meta, layer_index=[2]), k=sens.k, v=sens.v)
    with pytest.raises(ModelMismatchError, match=r"\[2\].*\[1\]"):
        ModelCodec(moved, recipes.load("calibrated-4bit"), sensitivity=moved_sens).check_model(qwen3_next)
    with pytest.raises(kt.InvalidParameterError, match="not match the statistics"):
        ModelCodec(moved, recipes.load("calibrated-4bit"), sensitivity=sens)
    # A plain model's codec does not fit the hybrid (nor the other way round).
    llama = build("llama")
    with pytest.raises(ModelMismatchError, match="layers, kv-heads, head_dim"):
        codec.check_model(llama)


@pytest.mark.parametrize("bad", [[0, 1], [-1], ["1"], 1, [True]])
def test_a_bad_layer_index_is_refused(fitted, tmp_path, bad) -> None:
    stats, sens = fitted
    with pytest.raises(kt.InvalidParameterError, match="layer_index"):
        AttentionStats(meta=dict(stats.meta, layer_index=bad), **{k: getattr(stats, k) for k in AttentionStats.ARRAYS})
    with pytest.raises(kt.InvalidParameterError, match="layer_index"):
        Sensitivity(meta=dict(sens.meta, layer_index=bad), k=sens.k, v=sens.v)
    # ... and in a stored file, a CorruptDataError naming it.
    p, side = stats.save(tmp_path / "s.safetensors")
    side.write_text(side.read_text().replace('"layer_index": [\n    1\n  ]', f'"layer_index": {bad!r}'.replace("'", '"')))
    with pytest.raises(kt.CorruptDataError, match="layer_index"):
        AttentionStats.load(p)


def test_cache_keeps_the_state_layers_and_counts_them(qwen3_next, fitted) -> None:
    stats, sens = fitted
    codec = ModelCodec(stats, recipes.load("calibrated-4bit"), sensitivity=sens)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
    ref = transformers.DynamicCache(config=qwen3_next.config)
    cache = KakeyaCache(codec, model=qwen3_next, block_size=4, n_sink=1)
    assert cache.fast, cache.fast_reason
    with torch.no_grad():
        qwen3_next(input_ids=ids, cache=ref)
        qwen3_next(input_ids=ids, cache=cache)
    assert type(cache.layers[0]) is type(ref.layers[0]) and cache.is_linear == ref.is_linear
    # The recurrent and convolution states are those of DynamicCache, held uncompressed.
    for a, b in ((cache.layers[0], ref.layers[0]), (cache.layers[2], ref.layers[2])):
        assert torch.equal(a.recurrent_states[0], b.recurrent_states[0])
        assert torch.equal(a.conv_states[0], b.conv_states[0])
    state = sum(t.numel() * t.element_size() for i in (0, 2)
                for t in (ref.layers[i].recurrent_states[0], ref.layers[i].conv_states[0]))
    mem = cache.memory()
    assert mem["state"] == state > 0
    assert cache.nbytes() == sum(v for k, v in mem.items() if k != "rope_table")
    assert cache.nbytes_uncompressed() == state + sum(
        t.numel() * t.element_size() for t in (ref.layers[1].keys, ref.layers[1].values))
    assert cache.layers[1].num_sealed() == 7 and cache.get_seq_length() == 30


def test_a_hybrid_cache_is_saved_with_its_states(qwen3_next, tmp_path) -> None:
    """(More in test_persist_states.py.)"""
    cache = KakeyaCache(IdentityCodec(), model=qwen3_next, block_size=4)
    with torch.no_grad():
        qwen3_next(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8]]), cache=cache)
    loaded = KakeyaCache.load(cache.save(tmp_path / "c.kkv"), qwen3_next)
    for i in (0, 2):
        assert torch.equal(loaded.layers[i].recurrent_states[0], cache.layers[i].recurrent_states[0])


def test_refused_hybrids() -> None:
    common = dict(num_key_value_heads=2, head_dim=16)
    # MiniMax's forward takes only its own cache class.
    minimax = _make(transformers.MiniMaxConfig, transformers.MiniMaxForCausalLM, num_local_experts=2,
                    num_experts_per_tok=1, layer_types=["linear_attention", "full_attention", "linear_attention"],
                    **common)
    with pytest.raises(kt.UnsupportedModelError, match="'minimax'.*cache class of its own \\(MiniMaxCache\\)"):
        KakeyaCache(IdentityCodec(), model=minimax)
    # No K/V rows at all: nothing to compress.
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8)).eval()
    with pytest.raises(kt.UnsupportedModelError, match="'mamba'.*no layer caches K/V rows"):
        KakeyaCache(IdentityCodec(), model=mamba)


def test_a_kv_sharing_cache_is_saved_and_continued(tmp_path) -> None:
    """Gemma 4's layers that share K/V cache nothing: saved as empty entries, loaded back as
    transformers' DummyLayer, and generation continues as from the cache that was saved."""
    import json

    from kakeyaturbo.cache import BlockCodec

    model = build("gemma4_text")
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    cache = KakeyaCache(BlockCodec(recipes.load("balanced")), model=model, block_size=8, n_sink=1)
    with torch.no_grad():
        model(input_ids=ids[:, :26], cache=cache)
    path = cache.save(tmp_path / "g4.kkpfx")
    loaded = KakeyaCache.load(path, model)
    assert [type(layer).__name__ for layer in loaded.layers][3:] == ["DummyLayer", "DummyLayer"]
    a = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, cache=loaded)
    b = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, cache=cache)
    assert torch.equal(a, b)
    # An entry of rows for a layer that caches nothing is refused.
    from kakeyaturbo.cache import persist

    header, _ = persist.read_header(path)
    assert header["layers"][3] == {"seen": 0, "streams": {}}
    raw = path.read_bytes()
    head = json.dumps({k: v for k, v in header.items() if not k.startswith("_")}, sort_keys=True,
                      separators=(",", ":")).encode()
    assert head in raw
    bad = head.replace(b'{"seen":0,"streams":{}}', b'{"seen":7,"streams":{}}', 1)
    assert len(bad) == len(head)
    broken = raw.replace(head, bad)
    import struct
    import zlib

    broken = broken[:-4] + struct.pack("<I", zlib.crc32(broken[:-4]))
    (tmp_path / "bad.kkpfx").write_bytes(broken)
    with pytest.raises(kt.CorruptDataError, match="layer 3 saw 7 tokens and holds nothing"):
        KakeyaCache.load(tmp_path / "bad.kkpfx", model)


def test_layers_holding_kv_rows_and_states_together(tmp_path) -> None:
    """Falcon-H1's layers run attention and a Mamba-2 mixer side by side: each cache layer holds
    K/V rows (coded) and the mixer's states (as transformers holds them), both in a saved cache."""
    from kakeyaturbo.cache.extra_layers import KakeyaStateLayer

    model = build("falcon_h1")
    layout = describe(model)
    assert [(s.kind, s.cache_type, s.states) for s in layout.layers] == [("full", "hybrid", 1)] * 3
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
    ref = transformers.DynamicCache(config=model.config)
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=4, n_sink=1)
    with torch.no_grad():
        model(input_ids=ids, cache=ref)
        model(input_ids=ids, cache=cache)
    for a, b in zip(cache.layers, ref.layers):
        assert isinstance(a, KakeyaStateLayer) and a.num_sealed() == 7
        assert torch.equal(a.recurrent_states[0], b.recurrent_states[0]) and torch.equal(a.conv_states[0], b.conv_states[0])
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert cache.memory()["state"] == sum(t.numel() * t.element_size() for b in ref.layers
                                          for t in (b.recurrent_states[0], b.conv_states[0]))
    loaded = KakeyaCache.load(cache.save(tmp_path / "f.kkpfx"), model)
    for a, b in zip(loaded.layers, ref.layers):
        assert torch.equal(a.recurrent_states[0], b.recurrent_states[0]) and torch.equal(a.conv_states[0], b.conv_states[0])
        assert torch.equal(a.keys, b.keys) and a.has_previous_state[0]


@pytest.mark.parametrize("name", ["granitemoehybrid", "lfm2", "falcon_h1"])
def test_sensitivity_is_that_of_a_cache_with_its_states(name) -> None:
    """The sensitivity of a hybrid's cached rows is the gradient through a prefilled cache, whose
    recurrent and convolution states were computed once: with one cached position, ``g g^T`` for
    the gradient at its value row of every K/V layer, taken through a ``DynamicCache``. (Before,
    the cached positions' attention outputs also reached the fed tokens through the states of
    the layers after them: 140 % off on Granite 4's tiny model. Jamba's and Bamba's scans compute
    the prefix differently with and without a cache, to 1e-4 and 3e-3 of their logits, and
    Gated DeltaNet's state update runs in place, so no gradient is taken through their caches.)"""
    from kakeyaturbo.eval import harness

    model = build(name)
    score, ctx = 3, 2
    w = list(np.random.default_rng(0).integers(3, VOCAB, ctx + score + 1))
    sens = calibration.collect_sensitivity(model, [w], n_sink=1, score=score)
    ids = torch.tensor([w])
    for row, layer in enumerate(describe(model).kv_layers):
        with torch.no_grad():
            _, cache = harness._forward(model, ids[:, :ctx])
        lay = cache.layers[layer]
        offset = torch.zeros(lay.values.shape[1], lay.values.shape[-1], requires_grad=True)
        rows = lay.values.clone()
        rows[0, :, 1] = rows[0, :, 1] + offset
        lay.values = rows
        logits, _ = harness._forward(model, ids[:, ctx:-1], cache)
        nll = -torch.log_softmax(logits[0].double(), -1).gather(1, ids[0, ctx + 1:, None]).sum()
        (g,) = torch.autograd.grad(nll, [offset])
        g = g.double().numpy()
        for h in range(g.shape[0]):
            np.testing.assert_allclose(sens.v[row, h], np.outer(g[h], g[h]), rtol=1e-4,
                                       atol=1e-5 * np.abs(g).max() ** 2)


def test_a_block_shared_across_layers_is_served_not_calibrated() -> None:
    """Zamba 2 runs one attention block for several layers, each with its own cache layer: its
    caches are served as DynamicCache's; calibration cannot tell its layers apart and refuses."""
    model = _make(transformers.Zamba2Config, transformers.Zamba2ForCausalLM, num_key_value_heads=2, num_hidden_layers=4,
                  layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=8, mamba_headdim=16,
                  n_mamba_heads=8, use_mem_rope=True)
    assert describe(model).kv_layers == (1, 3)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    ref = model.generate(ids, cache=transformers.DynamicCache(config=model.config), **kw)
    for pre in (False, True):
        cache = KakeyaCache(IdentityCodec(pre_rope_keys=pre), model=model, block_size=8, n_sink=1)
        assert torch.equal(model.generate(ids, cache=cache, **kw), ref)
    with pytest.raises(kt.UnsupportedModelError, match="'zamba2': attention modules share layer_idx"):
        calibration.collect(model, [[3, 4, 5, 6, 7, 8]], samples=2)


@pytest.mark.parametrize("name", ["qwen3_next", "jamba", "falcon_h1", "nemotron_h", "gemma4_text", "qwen4_exp_text"])
def test_left_padded_batches(name) -> None:
    """A batch of two prompts, one left-padded: keys coded without RoPE come back at each row's
    own positions beside the recurrent states (or shared layers), the tokens those of DynamicCache."""
    model = build(name)
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, cache=transformers.DynamicCache(config=model.config), **kw)
    got = model.generate(ids, cache=KakeyaCache(IdentityCodec(pre_rope_keys=True), model=model, block_size=4,
                                                n_sink=1), **kw)
    assert torch.equal(got, ref)
