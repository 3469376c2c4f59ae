"""The statistics collected through the attention interface equal, on Llama and Qwen2, those the
earlier forward hooks on q_proj/k_proj/v_proj gave (``legacy_collect``), to float rounding."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import calibration  # noqa: E402

from . import legacy_collect  # noqa: E402

T, HQ, HKV, D = 40, 4, 2, 16


def _model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=256)
    if kind == "qwen2":  # biased q/k/v projections
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=D, **common)).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    g = np.random.default_rng(0)
    return _model(request.param), [list(g.integers(0, 97, T)) for _ in range(3)]


def _close(a: np.ndarray, b: np.ndarray, name: str, rtol: float = 1e-6) -> None:
    scale = max(float(np.abs(b).max()), 1e-30)
    err = float(np.abs(a - b).max()) / scale
    assert err <= rtol, f"{name}: max error {err:.2e} of the largest entry"


@pytest.mark.parametrize("weighting", ["attention", "uniform"])
def test_statistics_equal_the_hooks(tiny, weighting) -> None:
    model, windows = tiny
    new = calibration.collect(model, windows, n_sink=1, samples=25, weighting=weighting)
    old = legacy_collect.collect(model, windows, n_sink=1, samples=25, weighting=weighting)
    for name in calibration.AttentionStats.ARRAYS:
        a, b = getattr(new, name), getattr(old, name)
        assert a.shape == b.shape, name
        _close(a, b, name)
    assert new.meta["weighting"] == weighting


def test_sensitivity_equals_the_hooks(tiny) -> None:
    model, windows = tiny
    new = calibration.collect_sensitivity(model, windows[:2], n_sink=1, score=8)
    old = legacy_collect.collect_sensitivity(model, windows[:2], n_sink=1, score=8)
    for s in ("k", "v"):
        _close(new.of(s), old.of(s), s)
    assert all(p.requires_grad for p in model.parameters())


def test_attention_weights_from_every_kind_of_mask() -> None:
    """The squared probabilities are the same whether the mask comes as eager's additive floats,
    sdpa's booleans, or not at all (causal, with the layer's sliding window from its kwargs),
    and equal those of a plain softmax over the full matrix."""
    from kakeyaturbo.calibration.moments import attention_p2

    g = torch.Generator().manual_seed(0)
    t, w = 37, 5
    q, k = torch.randn(1, 4, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)
    pos = torch.arange(t)
    keep = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w)
    add = torch.zeros(t, t).masked_fill(~keep, float("-inf"))[None, None]
    kw = {"scaling": 0.3, "softcap": 2.0, "sliding_window": w}
    logits = torch.matmul(q[0].view(2, 2, t, 8), k[0].transpose(1, 2)[:, None]) * 0.3
    p2 = torch.softmax(torch.tanh(logits / 2.0) * 2.0 + add[0], dim=-1).double() ** 2
    want = (p2[..., 1:].sum(-1), p2.sum(dim=(1, 2)))
    for mask in (add, keep[None, None], None):
        for chunk in (4, 64):
            got = attention_p2(torch.nn.Module(), q, k, mask, kw, n_sink=1, chunk=chunk)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def test_calibration_imports_without_torch() -> None:
    """The fit, the allocation and the statistics store need numpy only (the wheel without the
    eval extra): the collection imports the model-family code (torch) where it runs."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import kakeyaturbo.calibration, kakeyaturbo.recipes\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
