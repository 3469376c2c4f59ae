"""Calibration statistics from a real forward pass (tiny random-weight Llama), the whitening
identity on captured queries, and the calibrated mode through the evaluation harness."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402

T, HQ, HKV, D = 40, 4, 2, 16


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = np.random.default_rng(0)
    windows = [list(g.integers(0, 97, T)) for _ in range(3)]
    return model, windows


def _captured(model, windows, layer):
    """Pre-RoPE q, k, v of one layer from hooks, [windows * T, heads, D]."""
    out = {}
    attn = model.model.layers[layer].self_attn
    hooks = [getattr(attn, f"{n}_proj").register_forward_hook(
        lambda m, i, o, n=n: out.setdefault(n, []).append(o[0].detach().double().numpy()))
        for n in "qkv"]
    with torch.no_grad():
        for w in windows:
            model(input_ids=torch.tensor([w]), use_cache=False)
    for h in hooks:
        h.remove()
    return {n: np.concatenate(v).reshape(len(windows), T, -1, D) for n, v in out.items()}


def test_uniform_statistics_are_the_plain_moments(tiny) -> None:
    model, windows = tiny
    st = calibration.collect(model, windows, n_sink=1, samples=30, weighting="uniform")
    assert st.q2.shape == (2, HKV, D, D) and st.k_samples.shape == (2, HKV, 30, D)
    cap = _captured(model, windows, 1)
    k = cap["k"][:, 1:].reshape(-1, HKV, D)  # the sink position left out
    np.testing.assert_allclose(st.k_mean[1], k.mean(0), rtol=1e-6, atol=1e-9)
    for h in range(HKV):
        np.testing.assert_allclose(st.k_cov[1, h], np.cov(k[:, h].T, bias=True), rtol=1e-6, atol=1e-9)
        # GQA pooling: the query heads of group h, every position.
        q = cap["q"][:, :, h * 2:(h + 1) * 2].reshape(-1, D)
        np.testing.assert_allclose(st.q2[1, h], q.T @ q / len(q), rtol=1e-6, atol=1e-9)
        # The whitening identity on the captured queries: |e L|^2 = mean_q (q . e)^2 (to the
        # float32 rounding of the queries, which the collection sees with RoPE removed).
        lw = calibration.whitening_factor(st.q2[1, h], ridge=0.0)
        e = np.random.default_rng(h).standard_normal((5, D))
        np.testing.assert_allclose(np.sum((e @ lw) ** 2, axis=1), np.mean((e @ q.T) ** 2, axis=1),
                                   rtol=1e-6)


def test_attention_weighting_round_trips_files(tiny, tmp_path) -> None:
    model, windows = tiny
    before = model.config._attn_implementation
    st = calibration.collect(model, windows, n_sink=1, samples=10, weighting="attention")
    assert model.config._attn_implementation == before  # eager only while collecting
    uni = calibration.collect(model, windows, n_sink=1, samples=10, weighting="uniform")
    assert not np.allclose(st.k_cov, uni.k_cov)
    for a in (st.q2, st.k_cov, st.v_cov, st.o_gram):
        assert np.all(np.linalg.eigvalsh(a) > -1e-9)
    path, side = st.save(tmp_path / "s.safetensors")
    back = calibration.AttentionStats.load(path)
    assert back.meta["weighting"] == "attention" and side.exists()
    for name in calibration.AttentionStats.ARRAYS:
        assert np.array_equal(getattr(back, name), getattr(st, name))


def test_calibrated_recipe_through_the_harness(tiny) -> None:
    model, windows = tiny
    st = calibration.collect(model, windows[:2], n_sink=1, samples=10)
    sens = calibration.collect_sensitivity(model, windows[:2], n_sink=1, score=8)
    rec = recipes.load("calibrated-4bit")
    m = harness.codec_method(rec, 2, stats=st, sensitivity=sens)
    ctx = 30
    wins = [list(w) + list(w[:10]) for w in windows]  # ctx + n_eval + 1 tokens
    res = harness.evaluate(model, wins, ctx, harness.baseline_methods(["identity"]) + [m])
    out = res["kakeyaturbo:calibrated-4bit"]
    # Per-token bits <= 4 plus the 16-bit sink row and each container's header (small here).
    assert 3.0 < out["bits_per_element"] < 8.0
    assert out["model_bytes"] == m.codec.model_bytes > 0
    assert out["kl"] > 0.0 and res["identity"]["kl"] == 0.0
    with pytest.raises(ValueError, match="statistics"):
        harness.codec_method(rec, 2)
    with pytest.raises(kt.InvalidParameterError, match="Sensitivity"):
        harness.codec_method(rec, 2, stats=st)


def test_sensitivity_is_the_gradient_second_moment(tiny, tmp_path) -> None:
    """With one cached position between the sink and the fed tokens, the sensitivity is
    ``g g^T`` for the gradient ``g`` of the scored NLL with respect to that position's
    pre-RoPE key (value) row. Checked against gradients taken the way the evaluation runs: a
    prefilled ``DynamicCache`` whose cached row gets a zero offset, the fed tokens run through
    it, and (keys) the gradient rotated back through RoPE (an orthogonal map)."""
    from kakeyaturbo.cache.rope import rope_for, unapply_rope

    model, windows = tiny
    score = 3
    w = list(windows[0][:1 + 1 + score + 1])  # sink, one cached position, fed tokens, target
    ctx = 2
    sens = calibration.collect_sensitivity(model, [w], n_sink=1, score=score)
    assert sens.k.shape == sens.v.shape == (2, HKV, D, D)
    ids = torch.tensor([w])
    cos, sin = rope_for(model)(torch.tensor([1]))

    def grad(layer: int, kind: str) -> np.ndarray:
        with torch.no_grad():
            _, cache = harness._forward(model, ids[:, :ctx])
        lay = cache.layers[layer]
        offset = torch.zeros(HKV, D, requires_grad=True)
        rows = (lay.keys if kind == "k" else lay.values).clone()
        rows[0, :, 1] = rows[0, :, 1] + offset
        if kind == "k":
            lay.keys = rows
        else:
            lay.values = rows
        logits, _ = harness._forward(model, ids[:, ctx:-1], cache)
        nll = -torch.log_softmax(logits[0].double(), -1).gather(1, ids[0, ctx + 1:, None]).sum()
        (g,) = torch.autograd.grad(nll, [offset])
        if kind == "k":
            g = unapply_rope(g[None, :, None], cos, sin)[0, :, 0]
        return g.double().numpy()

    for layer in range(2):
        for kind in ("k", "v"):
            g = grad(layer, kind)
            for h in range(HKV):
                np.testing.assert_allclose(sens.of(kind)[layer, h], np.outer(g[h], g[h]),
                                           rtol=1e-4, atol=1e-6 * np.abs(g[h]).max() ** 2)
    assert np.abs(sens.k[0]).max() > 0 and np.abs(sens.v[1]).max() > 0
    assert all(p.requires_grad for p in model.parameters())  # restored
    back = calibration.Sensitivity.load(sens.save(tmp_path / "f.safetensors")[0])
    assert np.array_equal(back.k, sens.k) and back.meta["score"] == score
    with pytest.raises(kt.InvalidParameterError):
        calibration.collect_sensitivity(model, [w[:5]], n_sink=1, score=score)


def test_model_labels_score_a_label_the_model_drew(tiny, monkeypatch) -> None:
    """labels="model": with one scored position the sensitivity is the outer product of the
    gradient of one label's NLL, the label the model's prediction there was sampled for (the
    same as scoring a text whose next token is that label); reproducible for a seed, and other
    seeds draw other labels (a 97-token random model predicts nearly uniformly)."""
    model, windows = tiny
    score = 1
    w = list(windows[0][:1 + 1 + score + 1])
    with torch.no_grad():
        p = torch.softmax(model(input_ids=torch.tensor([w])).logits[0, -2].double(), -1)
    drawn = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        torch.testing.assert_close(probs, p[None], rtol=1e-5, atol=1e-9)
        out = real(probs, *args, **kwargs)
        drawn.append(int(out[0, 0]))
        return out

    monkeypatch.setattr(torch, "multinomial", spy)
    runs = [calibration.collect_sensitivity(model, [w], n_sink=1, score=score, labels="model",
                                            seed=seed) for seed in range(6)]
    monkeypatch.undo()
    assert len(drawn) == 6 and len(set(drawn)) > 1
    for y, sens in zip(drawn, runs):
        text = calibration.collect_sensitivity(model, [w[:-1] + [y]], n_sink=1, score=score)
        assert np.array_equal(text.k, sens.k) and np.array_equal(text.v, sens.v)
        assert sens.meta["labels"] == "model" and text.meta["labels"] == "text"
    again = calibration.collect_sensitivity(model, [w], n_sink=1, score=score, labels="model",
                                            seed=5)
    assert np.array_equal(again.k, runs[5].k)
    with pytest.raises(kt.InvalidParameterError, match="labels"):
        calibration.collect_sensitivity(model, [w], n_sink=1, score=score, labels="truth")


def test_sensitivity_allocation_follows_the_loss(tiny, tmp_path) -> None:
    """allocation = "sensitivity" pools the bits of K and V of every layer and head and moves
    them to where the measured sensitivity is large, within the pooled budget."""
    model, windows = tiny
    st = calibration.collect(model, windows[:2], n_sink=1, samples=10)
    sens = calibration.collect_sensitivity(model, windows[:2], n_sink=1, score=8)
    p = tmp_path / "s.toml"
    p.write_text('mode = "calibrated"\nn_sink = 1\n[k]\nbits = 4\nwhiten = "query"\n'
                 'allocation = "sensitivity"\n[v]\nbits = 4\nwhiten = "output"\ncenter = false\n'
                 'allocation = "sensitivity"\n')
    rec = recipes.load(p)
    assert rec.needs_sensitivity and recipes.load("calibrated-4bit").needs_sensitivity
    assert not recipes.load("balanced").needs_sensitivity
    with pytest.raises(kt.InvalidParameterError, match="Sensitivity"):
        calibration.ModelCodec(st, rec)
    with pytest.raises(kt.InvalidParameterError, match="does not match"):
        calibration.ModelCodec(st, rec, sensitivity=calibration.Sensitivity(
            meta={}, k=sens.k[:1], v=sens.v[:1]))
    budget = calibration.row_budget(4.0, D, True)

    def row_bits(s):
        c = calibration.ModelCodec(st, rec, sensitivity=s)
        return {key: c.row_bits for key, c in c.codecs.items()}

    base = row_bits(sens)
    assert sum(base.values()) <= budget * len(base) and all(b % 8 == 0 for b in base.values())
    # Make layer 1's values 1000x as costly: they gain bits, the rest pay for them.
    boosted = calibration.Sensitivity(meta={}, k=sens.k, v=sens.v.copy())
    boosted.v[1] *= 1000.0
    more = row_bits(boosted)
    assert sum(more.values()) <= budget * len(more)
    assert all(more[("v", 1, h)] > base[("v", 1, h)] for h in range(HKV))
    # Fisher whitening: the weights in the whitened basis are ~1 (up to the ridge).
    fit = calibration.fit_stream(np.zeros(D), st.k_cov[0, 0], 4.0,
                               whitening=calibration.whitening_factor(sens.k[0, 0], ridge=0.0))
    w = calibration.sensitivity_weights(fit.synthesis, sens.k[0, 0])
    np.testing.assert_allclose(w, 1.0, rtol=1e-6)
    # Through the harness.
    m = harness.codec_method(rec, 2, stats=st, sensitivity=sens)
    wins = [list(w) + list(w[:10]) for w in windows]
    res = harness.evaluate(model, wins, 30, [m])
    assert 3.0 < res[m.name]["bits_per_element"] < 8.0


def test_statistics_after_rope_are_those_of_the_cached_keys(tiny) -> None:
    """rope='after': the keys' moments are those of the keys the cache holds (RoPE applied), the
    values' are unchanged, and codecs fitted from them code keys as the cache holds them."""
    model, windows = tiny
    before = calibration.collect(model, windows, n_sink=1, samples=0, weighting="uniform")
    after = calibration.collect(model, windows, n_sink=1, samples=0, weighting="uniform",
                                rope="after")
    assert after.meta["rope"] == "after" and before.meta["rope"] == "before"
    cached = []
    with torch.no_grad():
        for w in windows:
            cache = transformers.DynamicCache(config=model.config)
            model(input_ids=torch.tensor([w]), cache=cache, use_cache=True)
            cached.append(cache.layers[1].keys[0, :, 1:].double().numpy())  # [HKV, T-1, D]
    k = np.concatenate(cached, axis=1)
    np.testing.assert_allclose(after.k_mean[1], k.mean(axis=1), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(after.v_cov, before.v_cov, rtol=1e-12, atol=1e-15)
    assert not np.allclose(after.k_mean, before.k_mean, rtol=1e-3)
    with pytest.raises(kt.InvalidParameterError, match="rope"):
        calibration.collect(model, windows, rope="middle")
    rec = recipes.Recipe(name="a", mode="calibrated", k={"rope": "after", "bits": 4},
                         v={"bits": 4}, n_sink=1)
    assert rec.key_rope == "after"
    codec = calibration.ModelCodec(after, rec)
    assert not codec.pre_rope_keys
    with pytest.raises(kt.InvalidParameterError, match="codes keys after RoPE"):
        calibration.ModelCodec(before, rec)
    with pytest.raises(kt.InvalidParameterError, match="keys only"):
        recipes.Recipe(name="b", mode="calibrated", v={"rope": "after"})
    sens = calibration.collect_sensitivity(model, windows[:1], n_sink=1, score=8, rope="after")
    assert sens.meta["rope"] == "after"
    srec = recipes.Recipe(name="s", mode="calibrated", n_sink=1,
                          k={"rope": "after", "whiten": "fisher", "allocation": "sensitivity"},
                          v={"whiten": "fisher", "allocation": "sensitivity"})
    m = harness.codec_method(srec, 2, stats=after, sensitivity=sens)
    res = harness.evaluate(model, [list(w) + [1] * 9 for w in windows[:1]], 30, [m])
    assert res["kakeyaturbo:s"]["bits_per_element"] < 8
