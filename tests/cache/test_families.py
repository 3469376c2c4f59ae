"""Every family the cache supports, on tiny random-weight models (``families.py``; no download):
RoPE re-applied bit for bit against the model's own cache and removed to float rounding; the
identity codec exact through the evaluation with every layer coded, across sliding windows;
a calibrated recipe calibrated, coded and generating; KakeyaCache generation token for token
as DynamicCache's, past the sliding window; what cannot work refused up front. The families of
``families.NO_STATISTICS`` (attention of their own, K/V heads tiled over the queries, or calls
that cannot be told apart by layer): the cache as for every family, statistics and attention
weights refused by name."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache, compress_cache  # noqa: E402
from kakeyaturbo.cache.generation import _state_bytes  # noqa: E402
from kakeyaturbo.cache.prefix import held_span  # noqa: E402
from kakeyaturbo.calibration.moments import attention_p2  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402
from kakeyaturbo.families import AttentionCapture, describe, keynorm  # noqa: E402
from kakeyaturbo.families.rope import apply_rope, unapply_rope, unscale_keys  # noqa: E402

from .conftest import forward, generate  # noqa: E402
from .families_latent import MLA, OWN_ROTATION  # noqa: E402
from .families import (FAMILIES, NO_STATISTICS, QUERY_SCALE, SLIDING_FULL_SLIDING, T_PROMPT, VOCAB,  # noqa: E402
                       WINDOW, build, family_prompt, rope_calls)

NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module", params=NAMES)
def family(request):
    return request.param, build(request.param)


def _rope_layers(layout):
    """The layers that rotate keys of their own (not those sharing another's K/V)."""
    return [i for i in layout.kv_layers if layout.rope.layer(i) is not None]


def _normalised(r, x):
    """Rows ``x`` before RoPE as the key norm after RoPE of ``r`` leaves them, its weight taken
    off (HunYuan's, NanoChat's: ``families.keynorm``)."""
    w = r.key_scale(x)
    y = r.key_norm(x).detach()
    return y if w is None else unscale_keys(y, w)


def test_rope_reapplied_bit_exact_and_removed(family, monkeypatch) -> None:
    """The family's own pre-RoPE keys (recorded inside its apply_rotary_pos_emb: after any k
    norm) with RoPE applied by the cache's LayerRope equal the keys in the model's cache bit
    for bit (a sliding layer: the rows it still holds); removal recovers them to float32
    rounding, and the cos/sin are the ones the model used."""
    name, model = family
    layout = describe(model)
    calls = rope_calls(model, monkeypatch)
    cache = transformers.DynamicCache(config=model.config)
    forward(model, family_prompt(batch=2), cache)
    layers = _rope_layers(layout)
    assert len(calls) == len(layers)
    worst = 0.0
    for i, (_, k_pre, cos, sin) in zip(layers, calls):
        r = layout.rope.layer(i)
        first, held = held_span(cache.layers[i])
        assert held == (T_PROMPT if not layout.layers[i].is_sliding else WINDOW - 1)
        pos = torch.arange(first, first + held)
        # Phi splits off the rotated channels before RoPE: only they are recorded.
        want = cache.layers[i].keys[..., :k_pre.shape[-1]]
        k_pre = k_pre[:, :, first:]
        if r.key_norm is None:
            assert torch.equal(r.apply(k_pre, pos), want), f"{name} layer {i}"
        else:  # an RMS norm after RoPE (families.keynorm): its rows normalised before RoPE,
            # equal to float32 rounding (the model normalises the rotated rows)
            k_pre = _normalised(r, k_pre)
            assert float((r.apply(k_pre, pos) - want).abs().max() / want.abs().max()) < 1e-6, f"{name} layer {i}"
        c, s = r.module_tables(torch.arange(T_PROMPT))  # as the module hands them to the model
        # (a batch's cos/sin where the family takes positions per row: Qwen3.5's multimodal RoPE)
        assert torch.equal(c.expand_as(cos), cos.float()) and torch.equal(s.expand_as(sin), sin.float())
        back = r.remove(want, pos)
        err = float((back - k_pre).abs().max() / k_pre.abs().max())
        worst = max(worst, err)
    assert worst < 1e-6, f"{name}: removal error {worst:.2e} of the largest key entry"
    for s in layout.layers:
        if s.kind == "shared":  # KV sharing: the keys it reads carry its producer's RoPE
            assert layout.rope.layer(s.index) is layout.rope.layer(s.reads)
        elif s.index not in layers:  # NoPE layers: keys cached as they are
            assert layout.rope.layer(s.index) is None


def test_identity_codec_is_exact_through_the_eval(family) -> None:
    """Every layer coded by the plain identity codec: dppl exactly 0, across sliding windows
    (ctx 20 > window 8); with keys coded without RoPE the deviation stays at float rounding;
    elements are counted as the cache holds them."""
    name, model = family
    g = np.random.default_rng(0)
    ctx, n_eval = 20, 6
    wins = [list(g.integers(3, VOCAB, ctx + n_eval + 1)) for _ in range(2)]
    methods = harness.baseline_methods(["identity"]) + [
        harness.Method("exact", harness._no_quantise, kind="codec", codec=IdentityCodec()),
        harness.Method("exact-pre", harness._no_quantise, kind="codec", n_sink=1,
                       codec=IdentityCodec(pre_rope_keys=True)),
    ]
    res = harness.evaluate(model, wins, ctx, methods)
    for m in ("identity", "exact"):
        assert (res[m]["dppl"], res[m]["top1"], res[m]["kl"]) == (0.0, 1.0, 0.0), (name, m, res[m])
    pre = res["exact-pre"]
    assert abs(pre["dppl"]) < 1e-5 and pre["top1"] == 1.0 and pre["kl"] < 1e-9, (name, pre)
    layout = describe(model)
    cache = transformers.DynamicCache(config=model.config)
    forward(model, family_prompt(t=ctx), cache)
    got = compress_cache(cache, IdentityCodec())
    held = [min(ctx, WINDOW - 1) if s.is_sliding else ctx for s in layout.layers]
    indexer = sum(layer.indexer_keys.numel() for layer in cache.layers  # dynamic sparse attention's, raw
                  if isinstance(getattr(layer, "indexer_keys", None), torch.Tensor))
    assert got["elements"] == indexer + sum(s.kv_heads * n * (s.head_dim + (s.v_dim or s.head_dim))  # values: v_dim
                                            for s, n in zip(layout.layers, held) if s.has_kv)
    assert got["raw_elements"] >= indexer
    again = transformers.DynamicCache(config=model.config)  # the baselines count the same elements
    forward(model, family_prompt(t=ctx), again)
    assert harness.compress_prefix(again, harness.baseline_methods(["fp8_e4m3"])[0], model=model)[1] == got["elements"]


@pytest.mark.parametrize("pre_rope", [False, True])
def test_kakeya_cache_generates_as_dynamic_cache(family, pre_rope) -> None:
    """KakeyaCache with an identity codec, blocks of 4 and 2 sink tokens: the same tokens as
    DynamicCache (logits bit-equal when keys keep their RoPE), from a prompt longer than the
    window and through 16 more tokens; sliding layers hold what DynamicSlidingWindowLayer holds
    and keep no sealed block that fell out of the window."""
    name, model = family
    ids = family_prompt()
    ref = transformers.DynamicCache(config=model.config)
    ref_seq, ref_logits = generate(model, ids, ref, n=16)
    cache = KakeyaCache(IdentityCodec(pre_rope_keys=pre_rope), model=model, block_size=4, n_sink=2)
    seq, logits = generate(model, ids, cache, n=16)
    assert torch.equal(seq, ref_seq), name
    if pre_rope:
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    else:
        assert torch.equal(logits, ref_logits), name
    assert cache.is_sliding == ref.is_sliding and cache.is_linear == ref.is_linear
    for i, (a, b) in enumerate(zip(cache.layers, ref.layers)):
        if describe(model).layers[i].is_cross:  # text alone: the model skips it (test_cross_attention.py)
            assert a.get_seq_length() == b.get_seq_length() == 0
            continue
        if not describe(model).layers[i].has_kv:  # a hybrid's state layer: transformers' own
            assert type(a) is type(b) and _state_bytes(a) == _state_bytes(b)
            continue
        assert a.get_seq_length() == b.get_seq_length() and _state_bytes(a) == _state_bytes(b)
        assert a.keys.shape == b.keys.shape and a.get_mask_sizes(1) == b.get_mask_sizes(1)
        if not pre_rope:
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        if a.is_sliding:  # blocks of 4 overlapping the last WINDOW - 1 positions, no sink
            assert a.num_sealed() <= (WINDOW - 1 + 3) // 4 + 1 and a._s["k"].sink.shape[-2] == 0
    kv = describe(model).kv_layers
    assert cache.nbytes_uncompressed() == sum(  # (a layer may hold K/V rows and states: Falcon-H1;
        # K/V rows and an indexer's keys: Qwen4-Exp)
        sum(t.numel() * t.element_size() for t in ((layer.keys, layer.values) if i in kv else ())
            + (getattr(layer, "indexer_keys", None),) if t is not None)
        + _state_bytes(layer) for i, layer in enumerate(ref.layers))
    assert cache.memory()["state"] == sum(_state_bytes(layer) for layer in ref.layers)


def test_calibrated_recipe_calibrates_codes_and_generates(family, monkeypatch) -> None:
    """Statistics are those of the keys and queries that enter RoPE (after any q/k norm); a
    calibrated recipe is fitted from them, codes the prefix in the evaluation and generates."""
    name, model = family
    layout = describe(model)
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 24)) for _ in range(3)]
    if name in NO_STATISTICS:  # refused by name
        with pytest.raises(kt.UnsupportedModelError, match=f"'{layout.model_type}'.*{NO_STATISTICS[name]}"):
            calibration.collect(model, wins, n_sink=1, samples=8, weighting="uniform")
        return
    calls = rope_calls(model, monkeypatch)
    stats = calibration.collect(model, wins, n_sink=1, samples=8, weighting="uniform")
    monkeypatch.undo()
    group, (hq, hkv, d) = layout.calibration_group()
    nl = len(_rope_layers(layout))
    # rows: the K/V layers (a hybrid's, not all) of the calibration group's shape (MiMo-V2-Flash's
    # sliding layers have other head counts than its full ones)
    assert stats.layer_index == group
    if nl == 0:  # no RoPE anywhere (GPT-2): the statistics are those of the cached keys
        i = [j for j in group if not layout.layers[j].is_sliding][-1]  # (a sliding layer holds the last rows)
        ks = []
        for w in wins:
            cache = transformers.DynamicCache(config=model.config)
            forward(model, torch.tensor([w]), cache)
            ks.append(cache.layers[i].keys[:, :, 1:])
        k = torch.cat(ks, dim=2)[0].double()
        np.testing.assert_allclose(stats.k_mean[group.index(i)], k.mean(dim=1).numpy(), rtol=1e-5, atol=1e-6)
    else:
        # The last layer whose rows no other layer reads (with KV sharing, a row of the
        # statistics also holds the queries of the layers sharing it).
        read = {s.reads for s in layout.layers}
        i = [r for r in _rope_layers(layout) if r not in read and r in group][-1]
        at = _rope_layers(layout).index(i)
        calls = calls[-3 * nl:]  # the three windows' forward passes (describe probes the function too)
        qs, ks = [c[0] for c in calls[at::nl]], [c[1] for c in calls[at::nl]]
        attn = kt.families.attention_modules(model)[i]
        if name in QUERY_SCALE:  # queries scaled after RoPE, as attention receives them
            qs = [x * QUERY_SCALE[name](attn) for x in qs]
        if layout.rope.layer(i).key_norm is not None:
            # q/k RMS norms after RoPE (HunYuan's, NanoChat's: families.keynorm): the keys are the rows
            # normalised before RoPE; the queries as attention receives them, times the key norm's
            # weight, with RoPE taken off
            r = layout.rope.layer(i)
            wk = r.key_scale(ks[0])
            wk = 1.0 if wk is None else wk  # (NanoChat's norms have no weights)
            qn = getattr(attn, "query_layernorm", None) or attn.q_norm
            ks = [_normalised(r, x) for x in ks]
            cs = [(c[2][:, None], c[3][:, None]) for c in calls[at::nl]]
            if r.reverse:  # NanoChat turns by -theta
                cs = [(c, -s) for c, s in cs]
            qs = [unapply_rope(wk * qn(apply_rope(x, *c)).detach(), *c) for x, c in zip(qs, cs)]
        q = torch.cat(qs, dim=2)[0].double()  # [hq, 3 * 24, d]
        k = torch.cat([x[:, :, 1:] for x in ks], dim=2)[0].double()
        w = k.shape[-1]  # the rotated channels only where the attention splits them off (Phi)
        j = group.index(i)
        np.testing.assert_allclose(stats.k_mean[j, :, :w], k.mean(dim=1).numpy(), rtol=1e-5, atol=1e-6)
        qg = q.reshape(hkv, hq // hkv * q.shape[1], w)
        want_q2 = (qg.transpose(1, 2) @ qg / qg.shape[1]).numpy()
        np.testing.assert_allclose(stats.q2[j, :, :w, :w], want_q2, rtol=1e-5,
                                   atol=1e-6 * np.abs(want_q2).max())
    stats = calibration.collect(model, wins, n_sink=1, samples=8)  # attention-weighted
    sens = calibration.collect_sensitivity(model, wins, n_sink=1, score=6)
    assert np.abs(sens.k).max() > 0 and np.abs(sens.v).max() > 0
    rec = recipes.load("calibrated-4bit")
    m = harness.codec_method(rec, layout.num_layers, stats=stats, sensitivity=sens)
    ev = [list(w) + list(w[:7]) for w in wins]  # ctx 24 + 6 + 1
    res = harness.evaluate(model, ev, 24, [m])[m.name]
    assert 2.0 < res["bits_per_element"] < 10.0 and np.isfinite(res["kl"]) and res["kl"] > 0
    cache = KakeyaCache(m.codec, model=model, block_size=4, n_sink=1)
    seq, logits = generate(model, family_prompt(), cache, n=6)
    assert seq.shape == (1, T_PROMPT + 6) and torch.isfinite(logits).all()
    assert max(cache.layers[i].num_sealed() for i in layout.kv_layers) >= 1


def _sink_scaled(module, q, k, mask, kwargs, p):
    """Eager's probabilities ``p`` as attention weighs the values: Granite SWA's eager returns the
    softmax without its learnt sink and scales the output by ``sigmoid(lse - sink)`` after (the
    sink as one more softmax entry, as GPT-OSS's eager folds it in before returning)."""
    sinks = getattr(module, "sinks", None)
    if sinks is None or not torch.allclose(p.sum(-1), torch.ones(())):
        return p
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ kk.transpose(-1, -2) * kwargs["scaling"]
    if mask is not None:
        logits = logits + mask[..., :kk.shape[-2]]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return p * torch.sigmoid(lse - sinks.view(1, -1, 1, 1))


def test_attention_weights_as_the_model_computes_them(family) -> None:
    """The squared attention probabilities the statistics are weighted by equal those of the
    family's own eager attention (scaling, softcapping, sliding-window masks), whether the mask
    arrives as eager's additive floats or as the model's own implementation's (sdpa: booleans,
    or None for plain causal); the attention output computed from them is the family's own."""
    name, model = family
    ids = family_prompt(t=T_PROMPT)
    got = {}
    if name in NO_STATISTICS:  # refused by name: before the forward pass, or by the capture's check
        with pytest.raises(kt.UnsupportedModelError, match=NO_STATISTICS[name]):
            with torch.no_grad(), AttentionCapture(model, lambda *a: a[-1](*a[2:5])) as cap:
                model(input_ids=ids, use_cache=False)
            cap.check(describe(model).kv_layers)
        return

    def run(weights: bool):
        def handler(i, module, q, k, v, mask, kwargs, attend):
            out = attend(q, k, v)
            wq, wk, o = attention_p2(module, q, k, mask, kwargs, n_sink=1, v=v)
            # the output from the same probabilities is the model's own attention output
            torch.testing.assert_close(o, out[0], rtol=1e-5, atol=1e-6)
            assert o.shape == out[0].shape and o.dtype == out[0].dtype and o.is_contiguous()
            if weights:  # eager's own probabilities
                p2 = (_sink_scaled(module, q, k, mask, kwargs, out[1])[0].double().square()
                      .reshape(wq.shape[0], wq.shape[1], *out[1].shape[-2:]))
                torch.testing.assert_close(wq, p2[..., 1:].sum(-1), rtol=1e-5, atol=1e-7)
                torch.testing.assert_close(wk, p2.sum(dim=(1, 2)), rtol=1e-5, atol=1e-7)
            got.setdefault(weights, []).append((wq, wk))
            return out

        with torch.no_grad(), AttentionCapture(model, handler, weights=weights) as cap:
            model(input_ids=ids, use_cache=False)
        cap.check(describe(model).kv_layers)

    before = model.config._attn_implementation
    run(True)
    run(False)
    assert model.config._attn_implementation == before
    for (a, b), (c, d) in zip(got[True], got[False]):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(b, d, rtol=1e-5, atol=1e-7)


def test_refused_up_front_with_the_model_type_and_reason(monkeypatch) -> None:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    # (longrope, refused here before 2026-12-07, is served: test_longrope.py; a dynamic rope type
    # below its limit since 2026-12-08: test_dynamic_rope.py; here one whose limit is not known)
    for rope, why in (({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "'dynamic'"),):
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_parameters=rope, **common)).eval()
        del m.model.rotary_emb.original_max_seq_len
        for call in (lambda: KakeyaCache(IdentityCodec(pre_rope_keys=True), model=m),
                     lambda: calibration.collect(m, [[1, 2, 3, 4]], samples=2),
                     lambda: harness.evaluate(m, [[1] * 8], 4, [harness.Method(
                         "x", harness._no_quantise, kind="codec", codec=IdentityCodec(pre_rope_keys=True))])):
            with pytest.raises(kt.UnsupportedModelError, match=f"'llama'.*{why}"):
                call()
        KakeyaCache(IdentityCodec(), model=m)  # keys kept with their RoPE: nothing to refuse
    with pytest.raises(kt.UnsupportedModelError, match="not a transformers model"):
        describe(torch.nn.Linear(2, 2))
    # A pairing none of the table forms reproduces (NanoChat's function made to swap the halves
    # without a sign: no rotation; its own turns the other way, which LayerRope reads as
    # reverse=True): keys without RoPE are refused, keys as the model caches them are served.
    nano = transformers.NanoChatForCausalLM(transformers.NanoChatConfig(head_dim=16, **common)).eval()
    with monkeypatch.context() as mp:
        mp.setattr(sys.modules[type(nano).__module__], "rotate_half", lambda x: torch.cat((x[..., 8:], x[..., :8]), -1))
        with pytest.raises(kt.UnsupportedModelError, match="'nanochat'.*neither rotate_half nor interleaved"):
            KakeyaCache(IdentityCodec(pre_rope_keys=True), model=nano)
        KakeyaCache(IdentityCodec(), model=nano)
    assert describe(nano).rope.layer(0).reverse
    # HunYuan normalises its keys after RoPE with a learnt weight, which comes off before RoPE
    # does (families.keynorm). Without that rule the keys attention receives are not those its
    # apply_rotary_pos_emb returned: refused by calibration's check (after RoPE they are served);
    # a norm after RoPE that does not commute with the rotation (a LayerNorm) is refused up front.
    hy = transformers.HunYuanDenseV1ForCausalLM(transformers.HunYuanDenseV1Config(head_dim=16, **common)).eval()
    wins = [[3, 4, 5, 6, 7, 8, 9, 10]] * 2
    assert calibration.collect(hy, wins, samples=2).meta["rope"] == "before"
    with monkeypatch.context() as mp:
        mp.delitem(keynorm.KEY_NORM_AFTER_ROPE, "hunyuan_v1_dense")
        with pytest.raises(kt.UnsupportedModelError, match="'hunyuan_v1_dense'.*keys change after RoPE"):
            calibration.collect(hy, wins, samples=2)
        assert calibration.collect(hy, wins, samples=2, rope="after").meta["rope"] == "after"
    hy.model.layers[1].self_attn.key_layernorm = torch.nn.LayerNorm(16)
    with pytest.raises(kt.UnsupportedModelError,
                       match="'hunyuan_v1_dense'.*layer 1's key_layernorm after RoPE does not commute"):
        KakeyaCache(IdentityCodec(pre_rope_keys=True), model=hy)
    KakeyaCache(IdentityCodec(), model=hy)
    # Gemma 4 Unified with every token attending both ways (not its default "vision"): refused.
    both = transformers.Gemma4UnifiedForCausalLM(transformers.Gemma4UnifiedTextConfig(
        head_dim=16, per_layer_config={}, use_bidirectional_attention="all", **common)).eval()
    with pytest.raises(kt.UnsupportedModelError, match="'gemma4_unified_text': bidirectional attention"):
        KakeyaCache(IdentityCodec(), model=both)
    # Dory's recurrent section run twice per forward pass: refused in either cache mode.
    for mode in ("per_loop", "last_loop"):
        dory = transformers.DoryForCausalLM(transformers.DoryConfig(
            head_dim=16, num_hidden_layers=3, n_input_layers=1, n_output_layers=1, n_recurrent_loops=2,
            recurrent_kv_cache_mode=mode, **{k: v for k, v in common.items() if k != "num_hidden_layers"})).eval()
        for call in (lambda: describe(dory), lambda: KakeyaCache(IdentityCodec(), model=dory)):
            with pytest.raises(kt.UnsupportedModelError, match="'dory': layers run 2 times per forward pass"):
                call()


@pytest.mark.parametrize("name, classes", [
    ("flint", ("FlintConfig", "FlintForCausalLM")), ("cohere2_moe", ("Cohere2MoeConfig", "Cohere2MoeForCausalLM")),
    ("kolibri1", ("Kolibri1Config", "Kolibri1ForCausalLM")),
    ("afmoe", ("AfmoeConfig", "AfmoeForCausalLM"))])
def test_rules_for_layers_without_rope(name, classes) -> None:
    """The families of families.layout._ROPE_IF not in families.py, tiny, a full layer between two
    sliding ones:
    describe reads the full layer as without RoPE, and the statistics' count of the calls of
    apply_rotary_pos_emb agrees (it refuses otherwise)."""
    cfg_cls, model_cls = (getattr(transformers, c) for c in classes)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=256, pad_token_id=0, sliding_window=WINDOW,
                              layer_types=SLIDING_FULL_SLIDING)).eval()
    rope = describe(model).rope
    assert [rope.layer(i) is not None for i in range(3)] == [True, False, True]
    calibration.collect(model, [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]] * 2, samples=2, weighting="uniform")


def test_kv_sharing_by_source_layer() -> None:
    """Kolibri 1.1 names each layer's producer (``kv_source_layers``): its last layer reads the first
    indexed layer's rows, not the last producer's before it; the indexed layers carry no RoPE; a
    row of the statistics holds the queries of every layer reading it (uniform weighting)."""
    model = build("kolibri1_1")
    layout = describe(model)
    assert [(s.kind, s.reads) for s in layout.layers] == [
        ("sliding", None), ("full", None), ("full", None), ("sliding", None), ("shared", 2), ("shared", 1)]
    assert [layout.rope.layer(i) is not None for i in range(6)] == [True, False, False, True, False, False]
    wins = [list(np.random.default_rng(0).integers(3, VOCAB, 24)) for _ in range(2)]
    stats = calibration.collect(model, wins, n_sink=1, samples=4, weighting="uniform")
    seen = {}

    def handler(i, module, q, k, v, mask, kwargs, attend):
        seen.setdefault(i, []).append(q.detach().double()[0])  # no RoPE to take off: [hq, t, d]
        return attend(q, k, v)

    with torch.no_grad(), AttentionCapture(model, handler):
        for w in wins:
            model(input_ids=torch.tensor([w]), use_cache=False)
    hq, hkv, d = layout.calibration_group()[1]
    for row, readers in ((1, (1, 5)), (2, (2, 4))):
        q = torch.cat([torch.cat(seen[i], dim=1) for i in readers], dim=1)
        qg = q.reshape(hkv, hq // hkv * q.shape[1], d)
        want = (qg.transpose(1, 2) @ qg / qg.shape[1]).numpy()
        np.testing.assert_allclose(stats.q2[stats.layer_index.index(row)], want, rtol=1e-5,
                                   atol=1e-6 * np.abs(want).max())


def test_attention_other_than_described_is_refused(monkeypatch) -> None:
    """A model whose attention receives other head counts than its config reads (a Persimmon
    config given a kv-head count it does not use) is refused by name, not a torch error; one whose
    attention is not the softmax the weighted statistics assume (here: the model's own function,
    its output scaled) is refused on the first window, and collected with uniform weights."""
    from kakeyaturbo.families import capture

    torch.manual_seed(0)
    wins = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]] * 2
    cfg = transformers.PersimmonConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    odd = transformers.PersimmonForCausalLM(cfg).eval()
    with pytest.raises(kt.UnsupportedModelError, match=r"'persimmon': layer 0's attention receives.*\(4, 2, 16\)"):
        calibration.collect(odd, wins, samples=2)
    model = build("llama")
    calibration.collect(model, wins, samples=2)
    orig = capture.AttentionCapture._function

    def scaled(self, module):
        fn = orig(self, module)
        return lambda *a, **kw: (lambda o: (o[0] * 1.5, o[1]))(fn(*a, **kw))

    monkeypatch.setattr(capture.AttentionCapture, "_function", scaled)
    with pytest.raises(kt.UnsupportedModelError, match="'llama': layer 0's attention is not the softmax"):
        calibration.collect(model, wins, samples=2)
    calibration.collect(model, wins, samples=2, weighting="uniform")


def test_layers_without_rope_found_or_refused(monkeypatch) -> None:
    """Cohere 2 and EXAONE 4 rotate their sliding layers' keys only: describe reads which layers
    do (families.layout._ROPE_IF); for a family whose rule it did not know, collecting statistics
    before RoPE sees which layers call apply_rotary_pos_emb and refuses rather than remove a RoPE
    the keys never had."""
    from kakeyaturbo.families import layout as layout_mod

    wins = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]] * 2
    for name in ("cohere2", "exaone4"):
        model = build(name)
        rope = describe(model).rope
        assert [rope.layer(i) is not None for i in range(3)] == [True, False, True], name
        monkeypatch.delitem(layout_mod._ROPE_IF, name)
        assert describe(model).rope.layer(1) is not None  # the rule unknown: read as rotating
        with pytest.raises(kt.UnsupportedModelError, match=f"'{name}': layer 1 did not call its apply_rotary_pos_emb"):
            calibration.collect(model, wins, samples=2)
        monkeypatch.undo()


@pytest.mark.parametrize("name", ["gpt_neox", "gemma3_text"])
def test_left_padded_batch_codec_sees_the_keys_before_rope(name, monkeypatch) -> None:
    """Left padding shifts the RoPE positions per row. GPT-NeoX does not pass position_ids to
    the cache (the cache takes them from the model's forward call); Gemma 3 rotates its layer
    types differently. Either way the codec must see each row's keys before RoPE."""
    from .conftest import Spy

    model = build(name)
    ids = family_prompt(batch=2, t=19)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    calls = rope_calls(model, monkeypatch)
    spy = Spy(pre_rope_keys=True)
    cache = KakeyaCache(spy, model=model, block_size=4, n_sink=1)
    n0 = len(calls)  # describe's probes of the function
    seq, _ = generate(model, ids, cache, n=4)
    full = next(s.index for s in describe(model).layers if not s.is_sliding)
    k_pre = calls[n0 + full][1]  # the first full-attention layer in the prefill
    ref, _ = generate(model, ids, transformers.DynamicCache(config=model.config), n=4)
    assert torch.equal(seq, ref)
    sealed = [x for s, layer, h, x in spy.seen if s == "k" and layer == full and h == 0]
    for b in range(2):  # the first sealed block (positions 1 .. 4) of each row, in batch order
        np.testing.assert_allclose(sealed[b], k_pre[b, 0, 1:5].numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["mistral", "gemma3_text"])
def test_sliding_layers_sinks_and_bits_as_held(name) -> None:
    """compress_cache keeps sink rows only in layers that still hold position 0, codes the rest
    of what each layer holds, and counts both as held; a sliding KakeyaLayer cannot be cropped
    once it dropped tokens, as DynamicSlidingWindowLayer."""
    from .conftest import Zero

    model = build(name)
    layout = describe(model)
    for t in (WINDOW - 2, T_PROMPT):  # within the window, then past it
        cache = transformers.DynamicCache(config=model.config)
        forward(model, family_prompt(t=t), cache)
        before = [layer.keys.clone() for layer in cache.layers]
        got = compress_cache(cache, Zero(), n_sink=2)
        raw = 0
        for spec, layer, k0 in zip(layout.layers, cache.layers, before):
            first, held = held_span(layer)
            sink = 2 if first == 0 else 0
            assert first == (max(t - WINDOW + 1, 0) if spec.is_sliding else 0)
            assert torch.equal(layer.keys[:, :, :sink], k0[:, :, :sink])
            assert torch.count_nonzero(layer.keys[:, :, sink:]) == 0
            raw += 2 * spec.kv_heads * sink * spec.head_dim
        assert got["raw_elements"] == raw
        assert got["elements"] == sum(2 * s.kv_heads * held_span(layer)[1] * s.head_dim
                                      for s, layer in zip(layout.layers, cache.layers))
    kc = KakeyaCache(IdentityCodec(), model=model, block_size=4, n_sink=2)
    forward(model, family_prompt(t=WINDOW - 3), kc)
    kc.crop(-2)  # nothing dropped yet: exact
    assert kc.get_seq_length() == WINDOW - 5
    forward(model, family_prompt(t=T_PROMPT), kc)
    with pytest.raises(RuntimeError, match="sliding-window"):
        kc.crop(-1)


#: Test models that are variants of a family's row (another setting of its config).
VARIANTS = {"falcon_alibi": "falcon"}


def test_every_family_built_here_has_a_readme_row() -> None:
    """The README's "Model families" table names every family these tests build (a row's first
    cell may name several), so what it lists and what is tested stay one list."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    named = set()
    for line in readme.splitlines():
        if line.startswith("| `"):
            named |= set(re.findall(r"`([a-z0-9_\-]+)`", line.split("|")[1]))
    built = {VARIANTS.get(n, n) for n in [*FAMILIES, *MLA, *OWN_ROTATION]}
    assert not built - named, sorted(built - named)
