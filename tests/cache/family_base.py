"""What the tiny random-weight models of ``families.py`` and ``families_latent.py`` are built from:
the shared config (3 layers, hidden 64, 4 heads, a vocabulary of 97), sliding windows of 8 tokens
(so prompts cross them), layer-type lists, and helpers that give initialised-to-neutral weights
(learnt sinks, Doge's dynamic mask, ZAYA's key scale) values that weigh."""

from __future__ import annotations

import copy
from typing import Any, Tuple

import torch

VOCAB, WINDOW = 97, 8
T_PROMPT = 21  # > WINDOW: every sliding layer has rolled
#: Three layers, a full one between two sliding ones.
SLIDING_FULL_SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]

#: Five layers, the last two sharing the K/V rows of the last sliding and full layers before them.
SHARED_FIVE = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
#: A hybrid's three layers: an attention layer between two recurrent ones.
LINEAR_FULL_LINEAR = ["linear_attention", "full_attention", "linear_attention"]
_DELTANET = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1)

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)


def _make(cfg_cls: Any, model_cls: Any, drop: Tuple[str, ...] = (), **kw: Any) -> Any:
    """A tiny ``model_cls`` of ``cfg_cls`` from the common settings (less those named in ``drop``,
    which the config does not take) and ``kw``, copied (a config may edit a list it is given in
    place: Gemma 4 Unified's makes the last layer full, which would change the shared layer-type
    lists for every later test)."""
    torch.manual_seed(0)
    common = {k: v for k, v in _COMMON.items() if k not in drop}
    return model_cls(cfg_cls(**copy.deepcopy(dict(common, **kw)))).eval()


def _with_sinks(model: Any) -> Any:
    """Learnt sinks that weigh: logits -1 .. 3 (the initialisation draws them near 0, where a
    kernel ignoring them would still come close)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            s = layer.self_attn.sinks
            if s is None:  # a layer without sinks (MiMo-V2-Flash's full layers)
                continue
            s.copy_(torch.rand(s.shape, generator=g) * 4 - 1)
    return model


def _with_dynamic_mask(model: Any) -> Any:
    """Doge's dynamic mask made to weigh: its per-kv-head rates ``A`` drawn in -2 .. 2 (initialised
    to 0, where the additive bias is 1 for every key and the top-k keeps an arbitrary tie)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn.A
            a.copy_(torch.rand(a.shape, generator=g) * 4 - 2)
    return model


def _with_norm_weights(model: Any) -> Any:
    """HunYuan's q/k norm weights after RoPE (initialised to 1, where a cache that forgot them
    would pass) drawn in 0.5 .. 1.5."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.query_layernorm, layer.self_attn.key_layernorm):
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
    return model


def _with_key_scale(model: Any) -> Any:
    """ZAYA's learnt key scales (initialised to 0: every key 0, every score equal) drawn in 1 .. 3."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            t = layer.self_attn.qk_norm.temp
            t.copy_(torch.rand(t.shape, generator=g) * 2 + 1)
    return model


_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16)
_ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
               n_group=1, topk_group=1)

_DSA = dict(index_head_dim=16, index_n_heads=4, index_topk=8)  # top 8 rows: prompts of 30 tokens skip some
