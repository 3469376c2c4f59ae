"""RoPE and its inverse against what tiny random-weight Llama / Qwen2 models put in their cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo.cache.rope import (  # noqa: E402
    apply_rope,
    rope_for,
    rotate_half,
    unapply_rope,
)

T = 37


def tiny(kind: str = "llama", rope_parameters: "dict | None" = None):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if rope_parameters is not None:
        common["rope_parameters"] = rope_parameters
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=16, **common)).eval()


def pre_and_post_rope_keys(model, ids):
    """(k_proj outputs as [B, H, T, D] per layer, the keys the model cached per layer)."""
    pre = []
    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda mod, inp, out: pre.append(out))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else (
        model.config.hidden_size // model.config.num_attention_heads)
    b, t = ids.shape
    pre = [k.view(b, t, -1, d).transpose(1, 2) for k in pre]
    return pre, [layer.keys for layer in out.cache.layers]


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    # yarn scales cos and sin (attention_scaling != 1): the inverse must divide it out.
    "yarn": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
             "original_max_position_embeddings": 128},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind,rope", [("llama", r) for r in ROPES] + [("qwen2", "default")])
def test_apply_matches_the_model_and_inverse_undoes_it(kind: str, rope: str) -> None:
    model = tiny(kind, ROPES[rope])
    ids = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(1))
    pre, post = pre_and_post_rope_keys(model, ids)
    cos, sin = rope_for(model)(torch.arange(T))
    assert cos.shape == sin.shape == (1, T, pre[0].shape[-1]) and cos.dtype == torch.float32
    for k_pre, k_post in zip(pre, post):
        # The same arithmetic as the model's attention: bit for bit.
        assert torch.equal(apply_rope(k_pre, cos[:, None], sin[:, None]), k_post)
        back = unapply_rope(k_post, cos[:, None], sin[:, None])
        assert back.dtype == torch.float32
        rel = (back - k_pre).norm() / k_pre.norm()
        assert rel < 1e-6, f"relative error {rel:.2e}"


def test_inverse_roundtrip_on_random_rows_and_partial_rotary() -> None:
    model = tiny()
    pos = torch.arange(200).view(2, 100)  # [batch, T] positions
    cos, sin = rope_for(model)(pos)
    assert cos.shape == (2, 100, 16)
    x = torch.randn(2, 3, 100, 16, generator=torch.Generator().manual_seed(0))
    for f, g in ((apply_rope, unapply_rope), (unapply_rope, apply_rope)):
        y = g(f(x, cos[:, None], sin[:, None]), cos[:, None], sin[:, None])
        assert ((y - x).norm() / x.norm()) < 1e-6
    # Partial rotary: only the first rot_dim channels move.
    xp = torch.randn(2, 3, 100, 24, generator=torch.Generator().manual_seed(1))
    yp = apply_rope(xp, cos[:, None], sin[:, None])
    assert torch.equal(yp[..., 16:], xp[..., 16:])
    assert torch.equal(yp[..., :16], apply_rope(xp[..., :16], cos[:, None], sin[:, None]))
    assert ((unapply_rope(yp, cos[:, None], sin[:, None]) - xp).norm() / xp.norm()) < 1e-6


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_apply_in_place_is_apply_bit_for_bit(style: str) -> None:
    from kakeyaturbo.families.rope import apply_rope_

    g = torch.Generator().manual_seed(2)
    cos, sin = (torch.randn(2, 1, 50, 16, generator=g) for _ in range(2))
    for width in (16, 24):  # full and partial rotary
        x = torch.randn(2, 3, 50, width, generator=g)
        want = apply_rope(x, cos, sin, style)
        y = x.clone()
        assert apply_rope_(y, cos, sin, style) is y and torch.equal(y, want)
    # Another promoted dtype (bf16 rows, float32 tables): apply_rope's new tensor, x untouched.
    xb = x[..., :16].to(torch.bfloat16)
    kept = xb.clone()
    out = apply_rope_(xb, cos, sin, style)
    assert out.dtype == torch.float32 and torch.equal(out, apply_rope(kept, cos, sin, style))
    assert torch.equal(xb, kept)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_inverse_is_within_units_of_the_exact_one(style: str) -> None:
    """The inverse against the same arithmetic in float64 (scaled tables, whose squares do not sum
    to 1; partial rotary; bfloat16 rows with float32 tables, float64 rows), its dtype and shape
    the promoted ones, and differentiable where the rows need a gradient."""
    from kakeyaturbo.families.rope import _rotate

    g = torch.Generator().manual_seed(3)
    ang = torch.rand(2, 1, 40, 8, generator=g, dtype=torch.float64) * 300
    scale = 0.5 + torch.rand(2, 1, 40, 1, generator=g, dtype=torch.float64)
    cos, sin = ((f(ang) * scale).repeat(1, 1, 1, 2).float() for f in (torch.cos, torch.sin))
    for dtype, width, ulps in ((torch.float32, 16, 4), (torch.float32, 24, 4), (torch.bfloat16, 16, 4),
                               (torch.float64, 16, 4)):
        x = torch.randn(2, 3, 40, width, generator=g).to(dtype)
        c, s, xr = cos.double(), sin.double(), x[..., :16].double()
        exact = (xr * c - _rotate(xr, style) * s) / (c * c + s * s)
        y = unapply_rope(x, cos, sin, style)
        want = torch.promote_types(dtype, torch.float32)
        assert y.dtype == want and y.shape == x.shape
        assert torch.equal(y[..., 16:], x[..., 16:].to(want))
        err = (y[..., :16].double() - exact).abs()
        assert bool((err <= ulps * torch.finfo(want).eps * exact.abs().amax(-1, keepdim=True)).all())
    x = torch.randn(2, 3, 40, 16, generator=g, requires_grad=True)
    unapply_rope(x, cos, sin, style).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    # bfloat16 tables too: computed in float32, rounded to bfloat16 once.
    xb, cb, sb = (t.detach().to(torch.bfloat16) for t in (x, cos, sin))
    yb = unapply_rope(xb, cb, sb, style)
    want = unapply_rope(xb.float(), cb.float(), sb.float(), style).to(torch.bfloat16)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, want)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_the_cores_removal_is_the_torch_one_within_units(style: str) -> None:
    """``_core.unrope_keys`` (what sealing runs on the CPU) against :func:`unapply_rope`: float32
    and bfloat16 rows (as their bits), a table per row or one for the batch, partial rotary,
    the first ``rows`` rows only; and ``LayerRope.remove_rows`` on either path."""
    import numpy as np

    from kakeyaturbo import _core
    from kakeyaturbo.families.rope import LayerRope

    g = torch.Generator().manual_seed(4)
    for tb, width, rows in ((2, 16, 30), (1, 24, 40), (2, 24, 0)):
        ang = torch.rand(tb, rows, 8, generator=g, dtype=torch.float64) * 500
        scale = 0.5 + torch.rand(tb, rows, 1, generator=g, dtype=torch.float64)
        cos, sin = ((f(ang) * scale).repeat(1, 1, 2).float() for f in (torch.cos, torch.sin))
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(2, 3, 40, width, generator=g).to(dtype)
            want = unapply_rope(x[..., :rows, :], cos[:, None], sin[:, None], style).float()
            bits = x.numpy() if dtype is torch.float32 else x.view(torch.int16).numpy().view(np.uint16)
            got = _core.unrope_keys(bits, cos.numpy(), sin.numpy(), style, rows)
            assert got.dtype == np.float32 and got.shape == (2, 3, rows, width)
            err = np.abs(got - want.numpy())
            assert (err <= 4 * 2.0 ** -23 * np.abs(want.numpy()).max(initial=1.0)).all()
            assert np.array_equal(got[..., 16:], x[..., :rows, 16:].float().numpy())
    # LayerRope.remove_rows: the core's path (float32 rows) and torch's (float64 rows), and a
    # key norm's weight divided out first.
    rope = LayerRope.__new__(LayerRope)
    rope.style, rope.key_norm = style, None
    x = torch.randn(1, 2, 12, 16, generator=g)
    ang = torch.rand(1, 10, 8, generator=g) * 100
    c, s = (f(ang).repeat(1, 1, 2) for f in (torch.cos, torch.sin))
    a, b = rope.remove_rows(x, 10, c, s), rope.remove_rows(x.double(), 10, c, s)
    assert a.shape == b.shape == (1, 2, 10, 16) and np.allclose(a, b, rtol=0, atol=1e-5)
    rope.key_norm = torch.nn.Module()
    rope.key_norm.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 16))
    a, b = rope.remove_rows(x, 10, c, s), rope.remove_rows(x.double(), 10, c, s)
    want = unapply_rope(x[..., :10, :] / torch.linspace(0.5, 1.5, 16), c[:, None], s[:, None], style)
    assert np.allclose(a, b, rtol=0, atol=1e-5) and np.allclose(a, want.numpy(), rtol=0, atol=1e-5)


def test_the_cores_removal_refuses_bad_input_by_type() -> None:
    import numpy as np

    import kakeyaturbo as kt
    from kakeyaturbo import _core

    x, t = np.ones((1, 2, 4, 8), np.float32), np.full((1, 4, 8), 0.5, np.float32)
    assert _core.unrope_keys(x, t, t, "half").shape == (1, 2, 4, 8)
    for args, err in [
        ((x.astype(np.float64), t, t, "half"), TypeError),
        ((x, t.astype(np.float64), t, "half"), TypeError),
        ((x, t, t, "diagonal"), kt.InvalidParameterError),
        ((x[0], t, t, "half"), kt.InvalidInputError),
        ((x, t, t[:, :2], "half"), kt.InvalidInputError),
        ((x, t[:, :2], t[:, :2], "half"), kt.InvalidInputError),  # not one table row per row
        ((x, np.full((1, 4, 7), 0.5, np.float32), np.full((1, 4, 7), 0.5, np.float32), "half"),
         kt.InvalidParameterError),  # an odd rotation
        ((x, np.full((3, 4, 8), 0.5, np.float32), np.full((3, 4, 8), 0.5, np.float32), "half"),
         kt.InvalidInputError),  # a table batch of neither 1 nor B
        ((x, np.zeros_like(t), np.zeros_like(t), "half"), kt.InvalidInputError),
        ((x, np.full_like(t, np.nan), t, "half"), kt.InvalidInputError),
        ((x[:, :, ::2], t[:, :2], t[:, :2], "half"), kt.InvalidInputError),  # not C-contiguous
    ]:
        with pytest.raises(err):
            _core.unrope_keys(*args)
    for rows, err in ((5, kt.InvalidInputError), (-1, kt.InvalidParameterError), (2**40, kt.InvalidParameterError)):
        with pytest.raises(err):
            _core.unrope_keys(x, t, t, "half", rows)


def test_rotate_half_convention() -> None:
    x = torch.arange(6.0)
    assert rotate_half(x).tolist() == [-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]


def test_bad_inputs_and_stateful_rope_types_raise() -> None:
    dynamic = tiny(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    rope_for(dynamic)  # static below max_position_embeddings (test_dynamic_rope.py)
    del dynamic.model.rotary_emb.original_max_seq_len  # a dynamic module that does not say its limit
    with pytest.raises(ValueError, match="dynamic"):
        rope_for(dynamic)
    with pytest.raises(ValueError, match="not a transformers model"):
        rope_for(torch.nn.Linear(2, 2))
    rope = rope_for(tiny())
    with pytest.raises(ValueError, match="positions"):
        rope(torch.zeros(1, 1, 3, dtype=torch.long))
    cos, sin = rope(torch.arange(4))
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rope(torch.zeros(4, 8), cos[0], sin[0])
    with pytest.raises(ValueError, match="same shape"):
        unapply_rope(torch.zeros(4, 16), cos[0], sin[0, :2])
