"""Layouts beyond one shape of layer, on tiny random-weight models (no download): Gemma 4's full
layers of another head size than its sliding ones, the layers that share another's K/V rows
(Gemma 4, Gemma 3n) weighed and made sensitive through what they read, a rotation the cache
cannot recompute calibrated after RoPE, Llama 4's chunked attention, and configs edited after the
model was built (layer and head counts other than its modules') refused."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402
from kakeyaturbo.families import AttentionCapture, describe  # noqa: E402

from .conftest import Spy, generate  # noqa: E402
from .families import VOCAB, WINDOW, build, family_prompt  # noqa: E402


def test_gemma4_layers_of_two_head_sizes(tmp_path) -> None:
    """Gemma 4's full layers have another head_dim and kv-head count than its sliding ones, read
    per layer from the config: caches of any codec serve it (keys with or without RoPE); a
    calibration covers the full layers (whose cache grows with the context), the sliding layer
    of the other shape stays raw, and attention runs over the codes of the full layers."""
    cfg = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        per_layer_config={"01": {"head_dim": 32, "num_key_value_heads": 1}, "02": {"head_dim": 32, "num_key_value_heads": 1}})
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    layout = describe(model)
    assert [(s.q_heads, s.kv_heads, s.head_dim) for s in layout.layers] == [(4, 2, 16), (4, 1, 32), (4, 1, 32)]
    assert layout.calibration_group() == ((1, 2), (4, 1, 32))
    ids = family_prompt()
    ref_seq, ref_logits = generate(model, ids, transformers.DynamicCache(config=model.config), n=16)
    for codec in (IdentityCodec(), IdentityCodec(pre_rope_keys=True), kt.cache.BlockCodec(recipes.load("balanced"))):
        cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
        seq, logits = generate(model, ids, cache, n=16)
        assert cache.layers[0].num_sealed() > 0 and cache.layers[1].num_sealed() > 0
        if isinstance(codec, IdentityCodec):
            assert torch.equal(seq, ref_seq)
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 24)) for _ in range(3)]
    stats = calibration.collect(model, wins, n_sink=1, samples=8)
    sens = calibration.collect_sensitivity(model, wins, n_sink=1, score=6)
    assert stats.layer_index == sens.layer_index == (1, 2) and stats.q2.shape == (2, 1, 32, 32)
    codec = calibration.ModelCodec(stats, recipes.load("calibrated-4bit"), sensitivity=sens).check_model(model)
    fast = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    slow = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=False)
    assert fast.fast, fast.fast_reason
    seq_f, _ = generate(model, ids, fast, n=8)
    seq_s, _ = generate(model, ids, slow, n=8)
    assert torch.equal(seq_f, seq_s)
    assert fast.layers[0].streams == () and fast.layers[0].num_sealed() == 0  # the sliding layer: raw
    assert fast.layers[1].fast and fast.layers[1].num_sealed() > 0 and fast.layers[2].num_sealed() > 0
    # In the evaluation, the raw layer counts 16 bits per element.
    m = harness.codec_method(recipes.load("calibrated-4bit"), layout.num_layers, codec=codec)
    res = harness.evaluate(model, [list(w) + list(w[:7]) for w in wins], 24, [m])[m.name]
    assert 4.0 < res["bits_per_element"] < 16.0 and res["kl"] > 0
    # The sliding layer's group calibrated too: a calibration of both groups, through its file,
    # gives one codec of every layer, each group fitted from its own statistics.
    assert layout.shape_groups() == (((1, 2), (4, 1, 32)), ((0,), (4, 2, 16)))
    s0 = calibration.collect(model, wins, n_sink=1, samples=8, layers=[0])
    z0 = calibration.collect_sensitivity(model, wins, n_sink=1, score=6, layers=[0])
    assert s0.layer_index == z0.layer_index == (0,) and s0.q2.shape == (1, 2, 16, 16)
    # Both groups from one pass over the windows: what a pass per group gives, to float32 rounding
    # (the layers of both groups return the attention output computed from the probabilities).
    passes = []
    hook = model.register_forward_pre_hook(lambda *_: passes.append(1))
    joint = calibration.collect_groups(model, wins, n_sink=1, samples=8)
    joint_z = calibration.collect_sensitivity_groups(model, wins, n_sink=1, score=6)
    hook.remove()
    assert len(passes) == 2 * len(wins)
    for got, want in zip(joint + joint_z, (stats, s0, sens, z0)):
        assert got.layer_index == want.layer_index and got.meta["layers"] == want.meta["layers"]
        for name in got.ARRAYS:
            a, b = getattr(got, name), getattr(want, name)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(np.abs(b).max(), 1e-30), err_msg=name)
    with pytest.raises(kt.InvalidParameterError, match="asked twice"):
        calibration.collect_groups(model, wins, groups=[None, [1, 2]])
    # A group's sensitivity is that of a cache, every layer's cached rows fixed (a pass for the
    # sliding layer alone once let its gradients run through the full layers' cached rows): one
    # cached position, the gradient at its value row through a prefilled DynamicCache.
    score = 3
    w = list(wins[0][:1 + 1 + score + 1])  # sink, one cached position, fed tokens, target
    z = calibration.collect_sensitivity(model, [w], n_sink=1, score=score, layers=[0])
    ids = torch.tensor([w])
    with torch.no_grad():
        _, cache = harness._forward(model, ids[:, :2])
    offset = torch.zeros(2, 16, requires_grad=True)
    rows = cache.layers[0].values.clone()
    rows[0, :, 1] = rows[0, :, 1] + offset
    cache.layers[0].values = rows
    logits, _ = harness._forward(model, ids[:, 2:-1], cache)
    nll = -torch.log_softmax(logits[0].double(), -1).gather(1, ids[0, 3:, None]).sum()
    (g,) = torch.autograd.grad(nll, [offset])
    g = g.double().numpy()
    for h in range(2):
        np.testing.assert_allclose(z.v[0, h], np.outer(g[h], g[h]), rtol=1e-4, atol=1e-6 * np.abs(g[h]).max() ** 2)
    cal = calibration.Calibration.for_model(model, stats, sens, groups=[(s0, z0)])
    cal = calibration.Calibration.load(cal.save(tmp_path / "g4.kkcal")).check_model(model)
    assert [st.layer_index for st, _ in cal.pairs()] == [(1, 2), (0,)]
    # The float32 synthesis computes the decoded keys, so the greedy tokens must equal
    # decode-then-attend's; the rounding ones (bf16, i16) move this random model's logits by
    # their rounding, which can flip one of its near ties.
    both = KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration=cal, block_size=4,
                                       synthesis="f32")
    assert both.codec.layers == (0, 1, 2) and both.fast
    seq_b, _ = generate(model, ids, both, n=8)
    seq_bs, _ = generate(model, ids, KakeyaCache(both.codec, model=model, block_size=4, n_sink=1, fast=False), n=8)
    assert torch.equal(seq_b, seq_bs) and all(layer.num_sealed() for layer in both.layers)
    assert {c.d for (_, layer, _), c in both.codec.codecs.items() if layer == 0} == {16}
    path = both.codec.save(tmp_path / "g4.kkcodec", model)
    assert calibration.ModelCodec.load(path).check_model(model).layers == (0, 1, 2)
    with pytest.raises(kt.InvalidParameterError, match="layers \\[1\\] are not one of its groups"):
        calibration.collect(model, wins, samples=2, layers=[1])
    with pytest.raises(calibration.bundle.ModelMismatchError, match="a group of layers \\[1, 2\\]"):
        calibration.Calibration.for_model(model, stats, sens, groups=[(stats, sens)])
    with pytest.raises(calibration.bundle.ModelMismatchError, match="a group of layers twice"):
        calibration.Calibration.for_model(model, stats, sens, groups=[(s0, z0), (s0, z0)])
    # A groups record that does not read: a typed error naming the file.
    meta, arrays = calibration.bundle._read(tmp_path / "g4.kkcal", "x")
    calibration.bundle.write_file(tmp_path / "bad.kkcal", arrays, dict(meta, groups="[1]"))
    with pytest.raises(kt.CorruptDataError, match="bad.kkcal.*groups record does not read"):
        calibration.Calibration.load(tmp_path / "bad.kkcal")
    del meta["groups"]  # its arrays without their record: refused, not ignored
    calibration.bundle.write_file(tmp_path / "bad.kkcal", arrays, meta)
    with pytest.raises(kt.CorruptDataError, match="holds arrays no group record describes"):
        calibration.Calibration.load(tmp_path / "bad.kkcal")


def test_calibration_needs_one_shape_for_the_full_layers() -> None:
    """Full-attention layers of two shapes leave no group a calibration could stack."""
    from kakeyaturbo.families.layout import LayerSpec, ModelLayout

    layout = ModelLayout("x", (LayerSpec(0, "full", None, 4, 2, 16), LayerSpec(1, "full", None, 4, 1, 32),
                               LayerSpec(2, "sliding", 8, 4, 2, 16)), None, "none")
    with pytest.raises(kt.UnsupportedModelError, match=r"'x': layers differ.*\(4, 1, 32\), \(4, 2, 16\)"):
        layout.calibration_group()
    one = ModelLayout("y", layout.layers[:1] + layout.layers[2:], None, "none")
    assert one.calibration_group() == ((0, 2), (4, 2, 16))


@pytest.mark.parametrize("name", ["gemma4_text", "gemma3n_text"])
def test_kv_sharing_layers_weigh_the_rows_they_read(name) -> None:
    """With KV sharing (the last two layers attend over the rows of layers 2 and 1), a row of the
    statistics holds the queries of every layer reading it, RoPE removed (uniform weighting:
    their plain second moment), and the output projections of them all."""
    model = build(name)
    layout = describe(model)
    assert [(s.kind, s.reads) for s in layout.layers] == [
        ("sliding", None), ("full", None), ("sliding", None), ("shared", 2), ("shared", 1)]
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 24)) for _ in range(2)]
    stats = calibration.collect(model, wins, n_sink=1, samples=4, weighting="uniform")
    assert stats.layer_index == (0, 1, 2)
    seen = {}

    def handler(i, module, q, k, v, mask, kwargs, attend):
        pre = layout.rope.layer(i).remove(q.detach().double(), torch.arange(q.shape[2])[None])
        seen.setdefault(i, []).append(pre[0])  # [hq, t, d]
        return attend(q, k, v)

    with torch.no_grad(), AttentionCapture(model, handler):
        for w in wins:
            model(input_ids=torch.tensor([w]), use_cache=False)
    hq, hkv, d = layout.calibration_group()[1]
    for row, readers in ((2, (2, 3)), (1, (1, 4)), (0, (0,))):
        q = torch.cat([torch.cat(seen[i], dim=1) for i in readers], dim=1)  # [hq, n, d]
        qg = q.reshape(hkv, hq // hkv * q.shape[1], d)
        want = (qg.transpose(1, 2) @ qg / qg.shape[1]).numpy()
        np.testing.assert_allclose(stats.q2[row], want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    mods = {m.layer_idx: m for m in model.modules() if type(m).__name__.endswith("Attention")}
    w_o = {i: mods[i].o_proj.weight.detach().double().numpy() for i in (2, 3)}
    want = sum(w[:, :d].T @ w[:, :d] + w[:, d:2 * d].T @ w[:, d:2 * d] for w in w_o.values())
    np.testing.assert_allclose(stats.o_gram[2, 0], want, rtol=1e-10)


def test_kv_sharing_sensitivity_reaches_through_the_sharing_layers() -> None:
    """The gradient at a layer's cached keys includes what flows back through the layers that
    attend over them (Gemma 4's layer 3 reads layer 2): against the same gradient taken by hand."""
    model = build("gemma4_text")
    layout = describe(model)
    w = list(np.random.default_rng(1).integers(3, VOCAB, 24))
    score, n_sink = 6, 1
    sens = calibration.collect_sensitivity(model, [w], n_sink=n_sink, score=score)
    ctx = len(w) - score - 1
    leaf = {}

    def handler(i, module, q, k, v, mask, kwargs, attend):
        if i == 2:
            leaf["k"] = k[:, :, :ctx].detach().requires_grad_(True)
            leaf["kv"] = (torch.cat([leaf["k"], k[:, :, ctx:]], dim=2), v)
        if i in (2, 3):
            return attend(q, *leaf["kv"])
        return attend(q, k, v)

    ids = torch.tensor([w])
    with torch.enable_grad(), AttentionCapture(model, handler):
        logits = model(input_ids=ids, use_cache=False).logits[0, ctx:-1]
        nll = -torch.log_softmax(logits.double(), dim=-1).gather(1, ids[0, ctx + 1:, None]).sum()
        g = torch.autograd.grad(nll, [leaf["k"]])[0]
    g = layout.rope.layer(2).transpose(g.double(), torch.arange(ctx)[None])[0, :, n_sink:]
    want = torch.bmm(g.transpose(1, 2), g).numpy()
    np.testing.assert_allclose(sens.k[2], want, rtol=1e-6, atol=1e-9 * np.abs(want).max())


def test_a_rotation_not_recomputable_is_calibrated_after_rope() -> None:
    """Phi-4-mini's `longrope`: a recipe that codes keys as cached (after RoPE) is calibrated and
    attends over the codes. (The config's own `original_max_position_embeddings`, 4096, governs
    the switch, not the 16 of `rope_parameters`: generation to 36 tokens stays below it. Keys
    before RoPE and the switch itself: `test_longrope.py`.)"""
    from .conftest import fast_recipe

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [3.0] * 8,
            "original_max_position_embeddings": 16}
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_parameters=rope, pad_token_id=0)).eval()
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 14)) for _ in range(3)]
    stats = calibration.collect(model, wins, samples=4, rope="after")
    codec = calibration.ModelCodec(stats, fast_recipe("after"))
    ids = family_prompt(t=12)
    fast = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    slow = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=False)
    assert fast.fast, fast.fast_reason
    seq_f, log_f = generate(model, ids, fast, n=24)
    seq_s, log_s = generate(model, ids, slow, n=24)
    assert torch.equal(seq_f, seq_s) and fast.layers[0].num_sealed() == 8
    torch.testing.assert_close(log_f, log_s, rtol=0, atol=1e-3)


def test_llama4_chunked_attention() -> None:
    """Llama 4's chunked layers (a query sees the earlier tokens of its chunk of 8 here) keep what
    a sliding layer of that window keeps, and attention over the codes follows the model's mask,
    which marks the chunks: the identity codec bit-exact against DynamicCache across chunks, keys
    coded before its complex-valued RoPE (the fast path's test runs them over the codes), a
    recipe coding keys after RoPE calibrated and attending over the codes as the slow path."""
    from .conftest import fast_recipe

    model = build("llama4_text")
    layout = describe(model)
    assert [(s.kind, s.window) for s in layout.layers] == [("chunked", 8)] * 3 + [("full", None)]
    ids = family_prompt()
    ref = transformers.DynamicCache(config=model.config)
    ref_seq, ref_logits = generate(model, ids, ref, n=12)
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=4, n_sink=1)
    seq, logits = generate(model, ids, cache, n=12)
    assert torch.equal(seq, ref_seq) and torch.equal(logits, ref_logits)
    assert [a.get_mask_sizes(1) for a in cache.layers] == [b.get_mask_sizes(1) for b in ref.layers]
    # Keys before RoPE (since 2026-12-07): the module's complex rotations, checked bit for bit
    # against its apply_rotary_emb; its L2 norm after RoPE commutes with the rotation, so the keys
    # the codec is handed are the projection's rows normalised.
    spy = Spy(pre_rope_keys=True)
    rows = []
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, a, y: rows.append(y[0]))
    seq, logits = generate(model, ids, KakeyaCache(spy, model=model, block_size=4, n_sink=1), n=12)
    handle.remove()
    assert torch.equal(seq, ref_seq) and (logits - ref_logits).abs().max().item() <= 1e-5
    k = torch.cat(rows).view(-1, 2, 16).transpose(0, 1)  # [kv-heads, T, head_dim]
    want = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps)
    blocks = [torch.from_numpy(x) for s, i, h, x in spy.seen if (s, i, h) == ("k", 0, 0)]
    assert blocks  # (a chunked layer codes the blocks its window still holds: find each one's rows)
    for x in blocks:
        assert min((x - want[0, t:t + 4]).abs().max().item() for t in range(want.shape[1] - 3)) <= 1e-5
    g = np.random.default_rng(0)
    stats = calibration.collect(model, [list(g.integers(3, VOCAB, 20)) for _ in range(3)], samples=4, rope="after")
    codec = calibration.ModelCodec(stats, fast_recipe("after"))
    fast = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    slow = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=False)
    assert fast.fast, fast.fast_reason
    seq_f, log_f = generate(model, ids, fast, n=12)
    seq_s, log_s = generate(model, ids, slow, n=12)
    assert torch.equal(seq_f, seq_s) and all(layer.num_sealed() for layer in fast.layers)
    torch.testing.assert_close(log_f, log_s, rtol=0, atol=1e-4)
    from kakeyaturbo.eval import peers

    assert "chunked-attention" in peers.unsupported("quanto-int4", model)  # QuantizedCache: full layers only


def _edited(name: str, **entries):
    """A tiny ``name`` model whose config was edited after it was built, past transformers' checks."""
    model = build(name)
    model.config.__dict__.update(entries)
    return model


def test_a_layer_count_the_model_does_not_have_is_refused() -> None:
    """``describe`` checks the config's layer count before any per-layer work: past MAX_LAYERS
    (10**9: per-layer lists of that size, or a hang), past the decoder's layers (a hybrid's too,
    whose extra layers would be state layers), or attention on a layer without an attention module
    is refused naming both counts, by describe, a cache and calibration alike. Fewer layers than
    the model has stay served (the model runs ``layers[:num_hidden_layers]``)."""
    from kakeyaturbo._limits import MAX_LAYERS
    for n in (10**9, MAX_LAYERS + 1):
        model = _edited("llama", num_hidden_layers=n)
        for call in (lambda: describe(model), lambda: KakeyaCache(IdentityCodec(), model=model),
                     lambda: calibration.collect(model, [[3, 4, 5, 6, 7, 8]], samples=2)):
            with pytest.raises(kt.UnsupportedModelError, match=f"'llama': .*num_hidden_layers {n} .*0..{MAX_LAYERS}"):
                call()
    with pytest.raises(kt.UnsupportedModelError, match="'llama': .* says 5 layers, but the model has 3 decoder layers"):
        describe(_edited("llama", num_hidden_layers=5))
    with pytest.raises(kt.UnsupportedModelError, match="'bamba': .* says 5 layers, but the model has 3 decoder layers"):
        describe(_edited("bamba", num_hidden_layers=5))
    # Bamba's layer types from its attention layers' indices: a second one without a module.
    with pytest.raises(kt.UnsupportedModelError,
                       match=r"'bamba': its config says 2 of its 3 layers attend, but the model has attention "
                             r"modules for 1 \(layer_idx 1..1\): none for layer 2"):
        KakeyaCache(IdentityCodec(), model=_edited("bamba", attn_layer_indices=[1, 2]))
    assert describe(_edited("llama", num_hidden_layers=2)).num_layers == 2


def test_head_counts_other_than_the_modules_are_refused() -> None:
    """Head counts and widths the config says other than the attention modules hold (their
    projections' shapes, their attributes) are refused by name with both counts, not read as the
    config says: kv-heads, query heads, head_dim; a fused q/k/v projection (GPT-BigCode's MQA); a
    latent's width (DeepSeek V3's MLA)."""
    cases = [("llama", dict(num_key_value_heads=4), r"\(4, 4, 16\).*k_proj.out_features 32 \(the config's: 64\)"),
             ("llama", dict(num_attention_heads=8), r"\(8, 2, 16\).*o_proj.in_features 64 \(the config's: 128\)"),
             ("qwen3", dict(head_dim=32), r"\(4, 2, 32\).*head_dim 16 \(the config's: 32\)"),
             ("gpt_bigcode", dict(num_key_value_heads=4), r"c_attn.out_features 96 \(the config's: 192\)"),
             ("deepseek_v3", dict(kv_lora_rank=16), r"kv_a_proj_with_mqa.out_features 40 \(the config's: 24\)")]
    for name, entries, what in cases:
        model = _edited(name, **entries)
        for call in (lambda: describe(model), lambda: KakeyaCache(IdentityCodec(), model=model)):
            with pytest.raises(kt.UnsupportedModelError,
                               match=f"'{name}': layer 0's attention receives other heads.*{what}"):
                call()
