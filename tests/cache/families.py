"""Tiny random-weight decoders of every family the cache supports, built from a transformers config
(no download), with what sets each apart: sliding windows (8 tokens, so prompts cross them),
q/k norms, MQA, head_dim 256, per-layer-type RoPE, partial rotary, interleaved RoPE, NoPE layers,
attention softcapping, learnt attention sinks; hybrids whose recurrent, state-space or
convolution layers hold no K/V rows."""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Tuple

import torch
import transformers as T

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


def _make(cfg_cls: Any, model_cls: Any, **kw: Any) -> Any:
    torch.manual_seed(0)
    return model_cls(cfg_cls(**dict(_COMMON, **kw))).eval()


def _with_sinks(model: Any) -> Any:
    """Learnt sinks that weigh: logits -1 .. 3 (the initialisation draws them near 0, where a
    kernel ignoring them would still come close)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            s = layer.self_attn.sinks
            s.copy_(torch.rand(s.shape, generator=g) * 4 - 1)
    return model


#: family -> (builder, what differs), the table of the README's "Model families".
FAMILIES: Dict[str, Tuple[Callable[[], Any], str]] = {
    "llama": (lambda: _make(T.LlamaConfig, T.LlamaForCausalLM, num_key_value_heads=2, head_dim=16,
                            rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}),
              "GQA, llama3-scaled RoPE"),
    "mistral": (lambda: _make(T.MistralConfig, T.MistralForCausalLM, num_key_value_heads=2, head_dim=16,
                              sliding_window=WINDOW),
                "sliding window on every layer"),
    "qwen2": (lambda: _make(T.Qwen2Config, T.Qwen2ForCausalLM, num_key_value_heads=2,
                            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
              "biased q/k/v, sliding window from layer 1"),
    "qwen3": (lambda: _make(T.Qwen3Config, T.Qwen3ForCausalLM, num_key_value_heads=2, head_dim=16,
                            rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                             "original_max_position_embeddings": 128}),
              "q/k RMSNorm per head before RoPE, yarn RoPE (scaled cos/sin)"),
    "gemma2": (lambda: _make(T.Gemma2Config, T.Gemma2ForCausalLM, num_key_value_heads=1, head_dim=256,
                             sliding_window=WINDOW),
               "MQA, head_dim 256, interleaved sliding/global layers, attention softcapping"),
    "gemma3_text": (lambda: _make(T.Gemma3TextConfig, T.Gemma3ForCausalLM, num_key_value_heads=1,
                                  head_dim=32, sliding_window=WINDOW,
                                  layer_types=SLIDING_FULL_SLIDING,
                                  rope_parameters={
                                      "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                         "rope_theta": 1000000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
                    "q/k norm, MQA, sliding/global layers with their own RoPE (linear-scaled global)"),
    "phi3": (lambda: _make(T.Phi3Config, T.Phi3ForCausalLM, num_key_value_heads=2, partial_rotary_factor=0.5),
             "fused qkv, partial rotary (half of each head)"),
    "olmo2": (lambda: _make(T.Olmo2Config, T.Olmo2ForCausalLM, num_key_value_heads=2),
              "q/k RMSNorm over the whole projection before the head reshape"),
    "gpt_neox": (lambda: _make(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, rotary_pct=0.25),
                 "fused qkv, partial rotary (a quarter), no position_ids to the cache"),
    "cohere": (lambda: _make(T.CohereConfig, T.CohereForCausalLM, num_key_value_heads=2),
               "interleaved RoPE pairs"),
    "smollm3": (lambda: _make(T.SmolLM3Config, T.SmolLM3ForCausalLM, num_key_value_heads=2,
                              no_rope_layers=[1, 0, 1]),
                "NoPE layers (no RoPE on layer 1)"),
    "phi": (lambda: _make(T.PhiConfig, T.PhiForCausalLM, num_key_value_heads=2, partial_rotary_factor=0.5),
            "partial rotary split off by the attention before RoPE, q/k layer norms off"),
    "gpt2": (lambda: _make(T.GPT2Config, T.GPT2LMHeadModel, n_embd=64, n_layer=3, n_head=4, n_positions=256),
             "learned absolute positions: keys carry no rotation"),
    "mixtral": (lambda: _make(T.MixtralConfig, T.MixtralForCausalLM, num_key_value_heads=2, head_dim=16,
                              sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
                "sparse MoE MLP (4 experts, 2 per token), sliding window on every layer"),
    "qwen2_moe": (lambda: _make(T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, num_key_value_heads=2,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64),
                  "biased q/k/v, sparse MoE MLP with a shared expert"),
    "qwen3_moe": (lambda: _make(T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, num_key_value_heads=2, head_dim=16,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                  "q/k RMSNorm per head before RoPE, sparse MoE MLP"),
    "granite": (lambda: _make(T.GraniteConfig, T.GraniteForCausalLM, num_key_value_heads=2,
                              attention_multiplier=0.05, embedding_multiplier=4.0, residual_multiplier=0.5,
                              logits_scaling=2.0),
                "attention scale 0.05 instead of 1/sqrt(head_dim), scaled embeddings, residuals and logits"),
    "olmo3": (lambda: _make(T.Olmo3Config, T.Olmo3ForCausalLM, num_key_value_heads=2, sliding_window=WINDOW,
                            layer_types=SLIDING_FULL_SLIDING),
              "q/k RMSNorm over the whole projection, sliding and full layers"),
    "starcoder2": (lambda: _make(T.Starcoder2Config, T.Starcoder2ForCausalLM, num_key_value_heads=2,
                                 sliding_window=WINDOW),
                   "biased projections, LayerNorm, sliding window on every layer"),
    "stablelm": (lambda: _make(T.StableLmConfig, T.StableLmForCausalLM, num_key_value_heads=2,
                               partial_rotary_factor=0.25),
                 "partial rotary (a quarter) split off by the attention before RoPE"),
    "exaone4": (lambda: _make(T.Exaone4Config, T.Exaone4ForCausalLM, num_key_value_heads=2, head_dim=16,
                              sliding_window=WINDOW,
                              layer_types=SLIDING_FULL_SLIDING),
                "q/k RMSNorm per head, sliding layers with RoPE and global layers without"),
    "ministral": (lambda: _make(T.MinistralConfig, T.MinistralForCausalLM, num_key_value_heads=2, head_dim=16,
                                sliding_window=WINDOW),
                  "sliding and full layers"),
    "seed_oss": (lambda: _make(T.SeedOssConfig, T.SeedOssForCausalLM, num_key_value_heads=2, head_dim=16),
                 "biased q/k/v"),
    "apertus": (lambda: _make(T.ApertusConfig, T.ApertusForCausalLM, num_key_value_heads=2, head_dim=16),
                "q/k RMSNorm per head, xIELU MLP"),
    "arcee": (lambda: _make(T.ArceeConfig, T.ArceeForCausalLM, num_key_value_heads=2, head_dim=16),
              "ReLU-squared MLP"),
    "gpt_oss": (lambda: _with_sinks(_make(
                    T.GptOssConfig, T.GptOssForCausalLM, num_key_value_heads=2, head_dim=16,
                    sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                    layer_types=SLIDING_FULL_SLIDING,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 64})),
                "learnt attention sinks (a logit per query head), cos/sin per frequency, yarn RoPE, "
                "sliding and full layers, sparse MoE MLP"),
    "glm4": (lambda: _make(T.Glm4Config, T.Glm4ForCausalLM, num_key_value_heads=2, head_dim=16,
                           partial_rotary_factor=0.5),
             "partial rotary (half) with interleaved pairs from the first half of cat(f, f) tables"),
    "ernie4_5": (lambda: _make(T.Ernie4_5Config, T.Ernie4_5ForCausalLM, num_key_value_heads=2, head_dim=16),
                 "interleaved pairs from the first half of cat(f, f) tables, RoPE in float32"),
    "glm4_moe": (lambda: _make(T.Glm4MoeConfig, T.Glm4MoeForCausalLM, num_key_value_heads=2, head_dim=16,
                               partial_rotary_factor=0.5, use_qk_norm=True, n_routed_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1),
                 "q/k RMSNorm per head, partial rotary (half), a dense first layer, then routed and shared experts"),
    "cohere2": (lambda: _make(T.Cohere2Config, T.Cohere2ForCausalLM, num_key_value_heads=2, sliding_window=WINDOW,
                              layer_types=SLIDING_FULL_SLIDING),
                "interleaved RoPE on sliding layers, full layers without RoPE, parallel attention and MLP"),
    "olmoe": (lambda: _make(T.OlmoeConfig, T.OlmoeForCausalLM, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2),
              "q/k RMSNorm over the whole projection, sparse MoE MLP"),
    "minimax_m2": (lambda: _make(T.MiniMaxM2Config, T.MiniMaxM2ForCausalLM, num_key_value_heads=2, head_dim=16,
                                 rotary_dim=8, num_local_experts=4, num_experts_per_tok=2),
                   "q/k RMSNorm over the whole projection, partial rotary (its checkpoints' rotary_dim), "
                   "sparse MoE MLP"),
    "phimoe": (lambda: _make(T.PhimoeConfig, T.PhimoeForCausalLM, num_key_value_heads=2, sliding_window=WINDOW,
                             num_local_experts=4, num_experts_per_tok=2),
               "LayerNorm, sliding window on every layer, sparse MoE MLP"),
    "nemotron": (lambda: _make(T.NemotronConfig, T.NemotronForCausalLM, num_key_value_heads=2, head_dim=16),
                 "partial rotary (half), LayerNorm1P, squared-ReLU MLP"),
    "granitemoe": (lambda: _make(T.GraniteMoeConfig, T.GraniteMoeForCausalLM, num_key_value_heads=2,
                                 num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.05),
                   "attention scale 0.05, sparse MoE MLP"),
    "exaone_moe": (lambda: _make(T.ExaoneMoeConfig, T.ExaoneMoeForCausalLM, num_key_value_heads=2, head_dim=16,
                                 sliding_window=WINDOW, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32,
                                 layer_types=SLIDING_FULL_SLIDING),
                   "q/k RMSNorm per head, sliding layers with RoPE and global layers without, MoE MLP"),
    "ministral3": (lambda: _make(T.Ministral3Config, T.Ministral3ForCausalLM, num_key_value_heads=2, head_dim=16),
                   "GQA, yarn-scaled RoPE and a position-scaled query"),
    "vaultgemma": (lambda: _make(T.VaultGemmaConfig, T.VaultGemmaForCausalLM, num_key_value_heads=1, head_dim=32,
                                 sliding_window=WINDOW,
                                 layer_types=SLIDING_FULL_SLIDING),
                   "MQA, sliding and global layers, attention softcapping"),
    "glm": (lambda: _make(T.GlmConfig, T.GlmForCausalLM, num_key_value_heads=2, head_dim=16),
            "partial rotary (half) with interleaved pairs from the first half of cat(f, f) tables"),
    "ernie4_5_moe": (lambda: _make(T.Ernie4_5_MoeConfig, T.Ernie4_5_MoeForCausalLM, num_key_value_heads=2,
                                   moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
                     "interleaved pairs from cat(f, f) tables, MoE MLP from its first layer"),
    "flex_olmo": (lambda: _make(T.FlexOlmoConfig, T.FlexOlmoForCausalLM, num_key_value_heads=2, num_experts=4,
                                num_experts_per_tok=2),
                  "q/k RMSNorm over the whole projection, sparse MoE MLP"),
    "bitnet": (lambda: _make(T.BitNetConfig, T.BitNetForCausalLM, num_key_value_heads=2),
               "sub-layer norm before the output projection, squared-ReLU MLP"),
    "persimmon": (lambda: _make(T.PersimmonConfig, T.PersimmonForCausalLM, partial_rotary_factor=0.5),
                  "MHA, fused qkv, q/k LayerNorm, partial rotary (half)"),
    "gemma4_text": (lambda: _make(T.Gemma4TextConfig, T.Gemma4ForCausalLM, num_key_value_heads=2, head_dim=16,
                                  sliding_window=WINDOW, num_hidden_layers=5, num_kv_shared_layers=2,
                                  layer_types=SHARED_FIVE, per_layer_config={}, hidden_size_per_layer_input=16,
                                  vocab_size_per_layer_input=VOCAB),
                    "q/k RMSNorm and a scale-free v norm, RoPE by one call per tensor, `proportional` RoPE "
                    "(a quarter) on full layers, per-layer inputs; KV sharing (the last two layers attend over "
                    "the rows of the last sliding and full layers before them); one head_dim here"),
    "gemma3n_text": (lambda: _make(T.Gemma3nTextConfig, T.Gemma3nForCausalLM, num_key_value_heads=2, head_dim=16,
                                   sliding_window=WINDOW, num_hidden_layers=5, num_kv_shared_layers=2,
                                   layer_types=SHARED_FIVE, hidden_size_per_layer_input=16,
                                   vocab_size_per_layer_input=VOCAB, laurel_rank=8, altup_num_inputs=2,
                                   activation_sparsity_pattern=[0.0] * 5, intermediate_size=[128] * 5),
                     "q/k RMSNorm and a scale-free v norm, RoPE by one call per tensor, AltUp and LAuReL "
                     "blocks, per-layer inputs; KV sharing as Gemma 4's"),
    # Hybrids: layers without K/V rows (recurrent, state-space or convolution state; MLP-only)
    # between the attention layers, kept as transformers keeps them.
    "qwen3_next": (lambda: _make(T.Qwen3NextConfig, T.Qwen3NextForCausalLM, num_key_value_heads=2, head_dim=16,
                                 layer_types=LINEAR_FULL_LINEAR, **_DELTANET, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=32),
                   "hybrid: Gated DeltaNet layers, gated attention with q/k RMSNorm and partial rotary (a quarter), MoE MLP"),
    "qwen3_5_text": (lambda: _make(T.Qwen3_5TextConfig, T.Qwen3_5ForCausalLM, num_key_value_heads=2, head_dim=16,
                                   layer_types=LINEAR_FULL_LINEAR, **_DELTANET),
                     "hybrid: Gated DeltaNet layers, gated attention with q/k RMSNorm and partial rotary (a quarter)"),
    "olmo_hybrid": (lambda: _make(T.OlmoHybridConfig, T.OlmoHybridForCausalLM, num_key_value_heads=2,
                                  layer_types=LINEAR_FULL_LINEAR),
                    "hybrid: Gated DeltaNet layers, attention with q/k RMSNorm over the whole projection"),
    "jamba": (lambda: _make(T.JambaConfig, T.JambaForCausalLM, num_key_value_heads=2, attn_layer_period=2,
                            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                            mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
              "hybrid: Mamba layers, attention without positional encoding, MoE MLP"),
    "bamba": (lambda: _make(T.BambaConfig, T.BambaForCausalLM, num_key_value_heads=2, attn_layer_indices=[1],
                            **_MAMBA2),
              "hybrid: Mamba-2 layers, partial rotary (half)"),
    "granitemoehybrid": (lambda: _make(T.GraniteMoeHybridConfig, T.GraniteMoeHybridForCausalLM,
                                       num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
                                       num_local_experts=2, num_experts_per_tok=1, **_MAMBA2),
                         "hybrid (Granite 4): Mamba-2 layers, attention without positional encoding, MoE MLP"),
    "nemotron_h": (lambda: _make(T.NemotronHConfig, T.NemotronHForCausalLM, num_key_value_heads=2, head_dim=16,
                                 hybrid_override_pattern="M*-", mamba_num_heads=4, mamba_head_dim=16,
                                 ssm_state_size=8, n_groups=1),
                   "hybrid: a Mamba-2 layer, an attention layer without positional encoding, an MLP-only layer (no cache)"),
    "falcon_h1": (lambda: _make(T.FalconH1Config, T.FalconH1ForCausalLM, num_key_value_heads=2, head_dim=16,
                                mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1),
                  "hybrid in every layer: attention and a Mamba-2 mixer side by side, the layer's cache holding "
                  "K/V rows and the mixer's states together; MuP multipliers"),
    "lfm2": (lambda: _make(T.Lfm2Config, T.Lfm2ForCausalLM, num_key_value_heads=2,
                           layer_types=["conv", "full_attention", "conv"]),
             "hybrid: short-convolution layers, attention with q/k RMSNorm per head"),
    "lfm2_moe": (lambda: _make(T.Lfm2MoeConfig, T.Lfm2MoeForCausalLM, num_key_value_heads=2,
                               layer_types=["conv", "full_attention", "conv"], num_experts=2,
                               num_experts_per_tok=1, moe_intermediate_size=32, num_dense_layers=1),
                 "hybrid: short-convolution layers, attention with q/k RMSNorm per head, MoE MLP"),
}


_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16)
_ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
               n_group=1, topk_group=1)

_DSA = dict(index_head_dim=16, index_n_heads=4, index_topk=8)  # top 8 rows: prompts of 30 tokens skip some

#: Multi-head latent attention: each layer caches a latent row (32 wide here, no RoPE) as keys and
#: the rotated key part (8 wide) as values. Served by codecs of the cached rows (not calibrated).
MLA: Dict[str, Tuple[Callable[[], Any], str]] = {
    "deepseek_v3": (lambda: _make(T.DeepseekV3Config, T.DeepseekV3ForCausalLM, **_MLA, **_ROUTED),
                    "MLA, routed and shared experts"),
    "deepseek_v2": (lambda: _make(T.DeepseekV2Config, T.DeepseekV2ForCausalLM, **_MLA, **_ROUTED),
                    "MLA, routed and shared experts"),
    "glm4_moe_lite": (lambda: _make(T.Glm4MoeLiteConfig, T.Glm4MoeLiteForCausalLM, **_MLA, **_ROUTED),
                      "MLA (GLM-4.7-Flash), routed and shared experts"),
    "minicpm3": (lambda: _make(T.MiniCPM3Config, T.MiniCPM3ForCausalLM, **dict(_MLA, q_lora_rank=16)),
                 "MLA with a low-rank query"),
    "youtu": (lambda: _make(T.YoutuConfig, T.YoutuForCausalLM, **dict(_MLA, q_lora_rank=16)),
              "MLA with a low-rank query"),
    "deepseek_v32": (lambda: _make(T.DeepseekV32Config, T.DeepseekV32ForCausalLM, **_DSA, **_ROUTED,
                                   **dict(_MLA, q_lora_rank=16)),
                     "MLA with dynamic sparse attention: an indexer's keys cached beside the rows, which pick "
                     "the rows each query attends to"),
    "glm_moe_dsa": (lambda: _make(T.GlmMoeDsaConfig, T.GlmMoeDsaForCausalLM, **_DSA, **_ROUTED,
                                  **dict(_MLA, q_lora_rank=16)),
                    "MLA with dynamic sparse attention (GLM-5)"),
    "kimi_linear": (lambda: _make(T.KimiLinearConfig, T.KimiLinearForCausalLM, layer_types=LINEAR_FULL_LINEAR,
                                  linear_head_dim=16, linear_num_heads=4, **_MLA),
                    "hybrid: Kimi Delta Attention layers around an MLA layer"),
}


#: Families whose keys' RoPE cannot be taken off (so only recipes that code keys after RoPE are
#: calibrated for them).
AFTER_ROPE: Dict[str, Tuple[Callable[[], Any], str]] = {
    "llama4_text": (lambda: _make(T.Llama4TextConfig, T.Llama4ForCausalLM, num_key_value_heads=2, head_dim=16,
                                  intermediate_size_mlp=128, num_hidden_layers=4, attention_chunk_size=WINDOW,
                                  num_local_experts=2, num_experts_per_tok=1, no_rope_layers=[1, 1, 1, 0],
                                  interleave_moe_layer_step=2),
                    "chunked attention (chunks of 8), a NoPE global layer, complex-valued RoPE, MoE MLP"),
}


def build(name: str) -> Any:
    return (FAMILIES.get(name) or MLA.get(name) or AFTER_ROPE[name])[0]()


def family_prompt(batch: int = 1, t: int = T_PROMPT, seed: int = 1) -> torch.Tensor:
    """Token ids of ``batch`` prompts of ``t`` tokens (above the special ids 0 to 2)."""
    return torch.randint(3, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


def rope_calls(model: Any, monkeypatch: Any) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Patches the family's own ``apply_rotary_pos_emb`` to record, per call (one per layer that
    applies RoPE, in layer order), ``(q, k)`` going in and ``cos, sin``."""
    mod = sys.modules[type(model).__module__]
    calls: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    orig = getattr(mod, "apply_rotary_pos_emb", None)
    if orig is None:  # a family without RoPE
        return calls
    hq = model.config.get_text_config(decoder=True).num_attention_heads
    query: List[torch.Tensor] = []  # Gemma 4 rotates one tensor per call: the queries, then the keys

    def spy(*a: Any, **kw: Any) -> Any:
        out = orig(*a, **kw)  # type: ignore[misc]
        if isinstance(out, tuple):
            calls.append((a[0].detach().clone(), a[1].detach().clone(), a[2], a[3]))
            return out
        if (a[3] if len(a) > 3 else kw.get("unsqueeze_dim", 1)) != 2:
            return out  # not the model's own call ([batch, rows, heads, D]): describe's probe
        x = a[0].detach().clone().transpose(1, 2)
        if x.shape[1] == hq:  # queries (a layer sharing K/V rotates only these)
            query[:] = [x]
        elif query:
            calls.append((query[0], x, a[1], a[2]))
        return out

    monkeypatch.setattr(mod, "apply_rotary_pos_emb", spy)
    return calls
