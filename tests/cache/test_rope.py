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
