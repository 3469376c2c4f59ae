"""The cache path end to end on a tiny random-weight Llama (no download, a second to build)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import recipes  # noqa: E402
from kakeyaturbo.cache import IdentityCodec  # noqa: E402
from kakeyaturbo.eval import harness  # noqa: E402

CTX, N_EVAL = 48, 8


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = np.random.default_rng(0)
    windows = [list(g.integers(0, 97, CTX + N_EVAL + 1)) for _ in range(3)]
    return model, windows


def test_identity_is_exact_and_methods_are_counted(tiny) -> None:
    model, windows = tiny
    methods = harness.baseline_methods(["identity", "fp8_e4m3", "turboquant3"])
    # An exact codec through the codec path on EVERY layer (no boundary layer): the whole
    # prefix is encoded, decoded and written back, and nothing may change.
    methods.append(harness.Method("kakeyaturbo:exact", harness._no_quantise, kind="codec",
                                  codec=IdentityCodec()))
    methods.append(harness.codec_method(recipes.load("predecessor"), 3))
    res = harness.evaluate(model, windows, CTX, methods)
    ident = res["identity"]
    assert ident["dppl"] == 0.0 and ident["top1"] == 1.0 and ident["kl"] == 0.0
    assert ident["verdict"] == "ACCEPT" and ident["tokens"] == 3 * N_EVAL
    assert ident["bits_per_element"] == 16.0
    exact = res["kakeyaturbo:exact"]
    assert exact["boundary_layers"] == []
    assert exact["dppl"] == 0.0 and exact["top1"] == 1.0 and exact["kl"] == 0.0
    # float32 rows plus a 4-byte header per (layer, stream, kv-head) blob.
    assert exact["bits_per_element"] == pytest.approx(32 + 3 * 2 * 2 * 32 / (3 * 2 * 2 * CTX * 16))
    assert res["fp8_e4m3"]["bits_per_element"] == pytest.approx(8 + 16 / 16)
    assert res["turboquant3"]["bits_per_element"] == pytest.approx(3 + 16 / 16)
    codec = res["kakeyaturbo:predecessor"]
    # Boundary layers of the predecessor recipe on 3 layers: 0, 1 and the last two -> all.
    assert codec["boundary_layers"] == [0, 1, 2] and codec["bits_per_element"] == 16.0
    assert codec["dppl"] == 0.0
    for r in res.values():
        assert r["kl"] >= -1e-12 and 0.0 <= r["top1"] <= 1.0


def test_codec_changes_the_cache_and_costs_fewer_bits(tiny) -> None:
    model, windows = tiny
    r = recipes.Recipe(name="t", k={"bit_width": 2}, v={"bit_width": 2})
    res = harness.evaluate(model, windows[:2], CTX, [harness.codec_method(r, 3)])
    out = res["kakeyaturbo:t"]
    assert out["bits_per_element"] < 16.0
    assert out["kl"] > 0.0


def test_sink_tokens_and_streams_are_exact_and_counted(tiny) -> None:
    model, windows = tiny
    calls = []

    def spy(stream, x):
        calls.append((stream, x.shape))
        return np.zeros_like(x), 0

    m = harness.Method("spy", spy, n_sink=5, streams=("k",))
    cache_model = model
    import torch as t

    with t.no_grad():
        ids = t.tensor([windows[0][:CTX]])
        _, cache = harness._forward(cache_model, ids)
    keys0 = [layer.keys.clone() for layer in cache.layers]
    values0 = [layer.values.clone() for layer in cache.layers]
    bits, elems = harness.compress_prefix(cache, m)
    assert all(s == "k" and shape == (CTX - 5, 16) for s, shape in calls)
    assert len(calls) == 3 * 2  # layers x kv-heads, K only
    for layer, k0, v0 in zip(cache.layers, keys0, values0):
        assert t.equal(layer.keys[:, :, :5], k0[:, :, :5])  # the sink is bit-exact
        assert t.count_nonzero(layer.keys[:, :, 5:]) == 0
        assert t.equal(layer.values, v0)
    # V at 16 bits, the sink rows of K at 16 bits, the coded K rows at the spy's 0 bits.
    assert bits == 3 * 2 * 16 * (CTX * 16 + 5 * 16)
    assert elems == 3 * 2 * 2 * CTX * 16


def test_attribution_methods_split_streams_and_layers() -> None:
    r = recipes.Recipe(name="t", k={"bit_width": 3}, v={"bit_width": 3}, boundary_layers=(0,))
    m = harness.codec_method(r, 10)
    parts = harness.attribution_methods(m, 10, 3)
    names = [p.name for p in parts]
    assert names[:2] == ["kakeyaturbo:t[k only]", "kakeyaturbo:t[v only]"]
    assert parts[0].streams == ("k",) and parts[1].streams == ("v",)
    groups = parts[2:]
    assert len(groups) == 3
    compressed = [set(range(10)) - set(g.boundary) for g in groups]
    assert set().union(*compressed) == set(range(1, 10))  # layer 0 stays a boundary layer
    assert all(a.isdisjoint(b) for i, a in enumerate(compressed) for b in compressed[i + 1:])
    assert all(g.codec is m.codec for g in groups)


def test_the_prefill_keeps_the_last_logits_only(tiny) -> None:
    """The prefill's logits are not read: it computes the last position's only (all of them
    would take ctx x vocab floats, 10 GB at 16k tokens and a 152k vocabulary), and fills the
    same cache as a full pass."""
    model, windows = tiny
    ids = torch.tensor([windows[0][:CTX]])
    with torch.no_grad():
        full, a = harness._forward(model, ids)
        last, b = harness._forward(model, ids, keep=1)
    assert full.shape[1] == CTX and last.shape[1] == 1
    torch.testing.assert_close(last[0, -1], full[0, -1])
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
