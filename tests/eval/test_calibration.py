"""Calibration statistics from a real forward pass (tiny random-weight Llama), the whitening
identity on captured queries, and the calibrated mode through the evaluation harness."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import calibrate, recipes  # noqa: E402
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
    st = calibrate.collect(model, windows, n_sink=1, samples=30, weighting="uniform")
    assert st.q2.shape == (2, HKV, D, D) and st.k_samples.shape == (2, HKV, 30, D)
    cap = _captured(model, windows, 1)
    k = cap["k"][:, 1:].reshape(-1, HKV, D)  # the sink position left out
    np.testing.assert_allclose(st.k_mean[1], k.mean(0), rtol=1e-6, atol=1e-9)
    for h in range(HKV):
        np.testing.assert_allclose(st.k_cov[1, h], np.cov(k[:, h].T, bias=True), rtol=1e-6, atol=1e-9)
        # GQA pooling: the query heads of group h, every position.
        q = cap["q"][:, :, h * 2:(h + 1) * 2].reshape(-1, D)
        np.testing.assert_allclose(st.q2[1, h], q.T @ q / len(q), rtol=1e-6, atol=1e-9)
        # The whitening identity on the captured queries: |e L|^2 = mean_q (q . e)^2.
        lw = calibrate.whitening_factor(st.q2[1, h], ridge=0.0)
        e = np.random.default_rng(h).standard_normal((5, D))
        np.testing.assert_allclose(np.sum((e @ lw) ** 2, axis=1), np.mean((e @ q.T) ** 2, axis=1),
                                   rtol=1e-8)


def test_attention_weighting_round_trips_files(tiny, tmp_path) -> None:
    model, windows = tiny
    before = model.config._attn_implementation
    st = calibrate.collect(model, windows, n_sink=1, samples=10, weighting="attention")
    assert model.config._attn_implementation == before  # eager only while collecting
    uni = calibrate.collect(model, windows, n_sink=1, samples=10, weighting="uniform")
    assert not np.allclose(st.k_cov, uni.k_cov)
    for a in (st.q2, st.k_cov, st.v_cov, st.o_gram):
        assert np.all(np.linalg.eigvalsh(a) > -1e-9)
    path, side = st.save(tmp_path / "s.safetensors")
    back = calibrate.AttentionStats.load(path)
    assert back.meta["weighting"] == "attention" and side.exists()
    for name in calibrate.AttentionStats.ARRAYS:
        assert np.array_equal(getattr(back, name), getattr(st, name))


def test_calibrated_recipe_through_the_harness(tiny) -> None:
    model, windows = tiny
    st = calibrate.collect(model, windows[:2], n_sink=1, samples=10)
    rec = recipes.load("calibrated-4bit")
    m = harness.codec_method(rec, 2, stats=st)
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
