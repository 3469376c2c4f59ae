"""Tiny random-weight decoders of every family the cache supports, built from a transformers config
(no download), with what sets each apart: sliding windows (8 tokens, so prompts cross them),
q/k norms, MQA, head_dim 256, per-layer-type RoPE, partial rotary, interleaved RoPE, NoPE layers,
attention softcapping, learnt attention sinks, ALiBi and absolute positions; hybrids whose
recurrent, state-space or convolution layers hold no K/V rows. The families with multi-head latent
attention, and those that rotate keys with a function of their own, are in ``families_latent.py``; what they
are all built from in ``family_base.py``."""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Tuple

import torch
import transformers as T

from .families_latent import MLA, OWN_ROTATION
from .family_base import (_DELTANET, _MAMBA2, LINEAR_FULL_LINEAR, SHARED_FIVE, SLIDING_FULL_SLIDING, T_PROMPT,
                          VOCAB, WINDOW, _make, _with_dynamic_mask, _with_key_scale, _with_norm_weights,
                          _with_sinks)


#: Kolibri 1.1's six layers: indexed-attention layers (an indexer picks each query's keys) around sliding ones.
_KOLIBRI1_1_LAYERS = ["sliding_attention", "indexed_attention", "indexed_attention", "sliding_attention",
                      "indexed_attention", "indexed_attention"]

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
    "gemma4_unified_text": (lambda: _make(T.Gemma4UnifiedTextConfig, T.Gemma4UnifiedForCausalLM, num_key_value_heads=2,
                                          head_dim=16, sliding_window=WINDOW, per_layer_config={},
                                          # (its config makes the last layer full)
                                          layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
                            "Gemma 4 Unified's decoder: Gemma 4's attention (q/k RMSNorm, a scale-free v norm, "
                            "`proportional` RoPE on full layers), sliding and full layers, image tokens attending "
                            "both ways by the model's mask (`use_bidirectional_attention=\"vision\"`: text causal)"),
    "gemma3n_text": (lambda: _make(T.Gemma3nTextConfig, T.Gemma3nForCausalLM, num_key_value_heads=2, head_dim=16,
                                   sliding_window=WINDOW, num_hidden_layers=5, num_kv_shared_layers=2,
                                   layer_types=SHARED_FIVE, hidden_size_per_layer_input=16,
                                   vocab_size_per_layer_input=VOCAB, laurel_rank=8, altup_num_inputs=2,
                                   activation_sparsity_pattern=[0.0] * 5, intermediate_size=[128] * 5),
                     "q/k RMSNorm and a scale-free v norm, RoPE by one call per tensor, AltUp and LAuReL "
                     "blocks, per-layer inputs; KV sharing as Gemma 4's"),
    "gemma": (lambda: _make(T.GemmaConfig, T.GemmaForCausalLM, num_key_value_heads=1, head_dim=32),
              "MQA, head_dim 32 apart from hidden / heads, scaled embeddings, GeGLU MLP"),
    "olmo": (lambda: _make(T.OlmoConfig, T.OlmoForCausalLM, num_key_value_heads=2, clip_qkv=0.5),
             "q/k/v clipped (clip_qkv), LayerNorm without parameters"),
    "opt": (lambda: _make(T.OPTConfig, T.OPTForCausalLM, ffn_dim=128, word_embed_proj_dim=32,
                          do_layer_norm_before=False),
            "learned absolute positions, queries scaled before attention (scale 1 there), "
            "LayerNorm after each block, embeddings projected in and out"),
    "biogpt": (lambda: _make(T.BioGptConfig, T.BioGptForCausalLM),
               "learned absolute positions, scaled embeddings"),
    "gpt_bigcode": (lambda: _make(T.GPTBigCodeConfig, T.GPTBigCodeForCausalLM, n_embd=64, n_layer=3, n_head=4,
                                  n_positions=256, multi_query=True),
                    "MQA, fused qkv, learned absolute positions"),
    "dbrx": (lambda: _make(T.DbrxConfig, T.DbrxForCausalLM, d_model=64, n_heads=4, n_layers=3,
                           attn_config={"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 10000.0},
                           ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
             "GQA, fused qkv clipped (clip_qkv), LayerNorm without bias, sparse MoE MLP (4 experts, 2 per token)"),
    "gptj": (lambda: _make(T.GPTJConfig, T.GPTJForCausalLM, n_embd=64, n_layer=3, n_head=4, rotary_dim=8),
             "partial rotary (half) split off by the attention, interleaved pairs, a sin/cos table per "
             "frequency handed over as (sin, cos), RoPE on rows [batch, T, heads, D], keys before queries, "
             "parallel attention and MLP"),
    "codegen": (lambda: _make(T.CodeGenConfig, T.CodeGenForCausalLM, n_embd=64, n_layer=3, n_head=4, n_ctx=256,
                              rotary_dim=8),
                "GPT-J's RoPE, fused qkv interleaved over 4 model-parallel shards"),
    "granitemoeshared": (lambda: _make(T.GraniteMoeSharedConfig, T.GraniteMoeSharedForCausalLM, num_key_value_heads=2,
                                       num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                                       attention_multiplier=0.05),
                         "attention scale 0.05, sparse MoE MLP with a shared expert"),
    "granite_swa": (lambda: _with_sinks(_make(T.GraniteSWAConfig, T.GraniteSWAForCausalLM, num_key_value_heads=2,
                                              sliding_window=WINDOW, layer_types=SLIDING_FULL_SLIDING,
                                              layer_rope_theta=[10000.0, 0, 500000.0], attention_multiplier=0.05)),
                    "learnt attention sinks (scaling the output by sigmoid(lse - sink)), sliding and full layers, "
                    "a rope theta per layer (a NoPE full layer), attention scale 0.05"),
    "granitemoe_swa": (lambda: _with_sinks(_make(T.GraniteMoeSWAConfig, T.GraniteMoeSWAForCausalLM,
                                                 num_key_value_heads=2, sliding_window=WINDOW,
                                                 layer_types=SLIDING_FULL_SLIDING, num_local_experts=4,
                                                 num_experts_per_tok=2, shared_intermediate_size=64)),
                       "learnt attention sinks, sliding and full layers, sparse MoE MLP with a shared expert"),
    "solar_open": (lambda: _make(T.SolarOpenConfig, T.SolarOpenForCausalLM, num_key_value_heads=2, head_dim=16,
                                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                   "GQA, routed and shared experts"),
    "jais2": (lambda: _make(T.Jais2Config, T.Jais2ForCausalLM, num_key_value_heads=2),
              "biased projections, LayerNorm, squared-ReLU MLP"),
    "apertus1p5_text": (lambda: _make(T.Apertus1p5TextConfig, T.Apertus1p5TextForCausalLM, num_key_value_heads=2,
                                      head_dim=16,
                                      rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}),
                        "q/k RMSNorm per head, llama3-scaled RoPE, xIELU MLP"),
    "hyperclovax": (lambda: _make(T.HyperCLOVAXConfig, T.HyperCLOVAXForCausalLM, num_key_value_heads=2,
                                  attention_multiplier=0.05, embedding_multiplier=4.0, residual_multiplier=0.5,
                                  logits_scaling=2.0),
                    "attention scale 0.05, MuP multipliers, post-norms (Peri-LN)"),
    "minimax_m3_vl_text": (lambda: _make(T.MiniMaxM3VLTextConfig, T.MiniMaxM3VLForCausalLM, num_key_value_heads=2,
                                         head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         dense_intermediate_size=128, shared_intermediate_size=32,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5}),
                           "q/k Gemma-style RMSNorm per head, partial rotary (half), MoE MLP with a shared expert"),
    "cwm": (lambda: _make(T.CwmConfig, T.CwmForCausalLM, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                          layer_types=SLIDING_FULL_SLIDING,
                          rope_parameters={"rope_type": "llama3", "factor": 16.0, "rope_theta": 1000000.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64}),
            "sliding and full layers, llama3-scaled RoPE"),
    "diffllama": (lambda: _make(T.DiffLlamaConfig, T.DiffLlamaForCausalLM, num_key_value_heads=2),
                  "differential attention: two softmax attention calls over the cached rows, each with half "
                  "of the values, combined with a learnt lambda and a group norm (not the fast path)"),
    "doge": (lambda: _with_dynamic_mask(_make(T.DogeConfig, T.DogeForCausalLM, num_key_value_heads=2,
                                              keep_window_size=WINDOW)),
             "q/k RMSNorm per head, a dynamic mask: a learnt additive bias per key and kv head from the values, "
             "top 8 keys kept per query (not the fast path)"),
    "dots1": (lambda: _make(T.Dots1Config, T.Dots1ForCausalLM, num_key_value_heads=2, head_dim=16,
                            sliding_window=WINDOW, layer_types=SLIDING_FULL_SLIDING, n_routed_experts=4,
                            num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                            first_k_dense_replace=1),
              "q/k RMSNorm per head, sliding and full layers, a dense first layer, then routed and shared experts"),
    "helium": (lambda: _make(T.HeliumConfig, T.HeliumForCausalLM, num_key_value_heads=2, head_dim=16),
               "interleaved pairs from the first half of cat(f, f) tables"),
    "cohere_compass_text": (lambda: _make(T.CohereCompassTextConfig, T.CohereCompassForCausalLM, num_key_value_heads=2,
                                          sliding_window=WINDOW, layer_types=SLIDING_FULL_SLIDING,
                                          rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                                 "rope_theta": 10000.0,
                                                                                 "mrope_section": [4, 2, 2]},
                                                           "full_attention": None}),
                            "LayerNorm, parallel attention and MLP, multimodal RoPE sections on sliding layers, "
                            "full layers without RoPE (rope parameters None for their layer type)"),
    "mimo_v2_flash": (lambda: _with_sinks(_make(
                          T.MiMoV2FlashConfig, T.MiMoV2FlashForCausalLM, num_key_value_heads=2, head_dim=16,
                          v_head_dim=8, sliding_window=WINDOW,
                          layer_types=["full_attention", "sliding_attention", "full_attention"],
                          n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
                      "full layers, and a sliding layer with twice the kv heads and learnt sinks; values narrower "
                      "than keys (8 of 16) and scaled; partial rotary (a third), per-layer-type RoPE, MoE MLP"),
    "laguna": (lambda: _make(T.LagunaConfig, T.LagunaForCausalLM, num_key_value_heads=2, head_dim=16,
                             sliding_window=WINDOW, layer_types=SLIDING_FULL_SLIDING,
                             num_attention_heads_per_layer=[4, 8, 4], num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32),
               "query heads per layer (8 on the full layer, 4 on the sliding ones), q/k RMSNorm per head, "
               "a softplus gate per head after attention, per-layer-type RoPE (partial on full layers), MoE MLP"),
    "nanochat": (lambda: _make(T.NanoChatConfig, T.NanoChatForCausalLM, num_key_value_heads=2, head_dim=16),
                 "RoPE turning the other way (its rotate_half is cat(x2, -x1)), q/k RMSNorm without weights "
                 "after RoPE, final logit softcapping"),
    "hunyuan_v1_dense": (lambda: _with_norm_weights(_make(T.HunYuanDenseV1Config, T.HunYuanDenseV1ForCausalLM,
                                                          num_key_value_heads=2, head_dim=16)),
                         "q/k RMSNorm after RoPE (learnt weights: drawn in 0.5 .. 1.5)"),
    "hunyuan_v1_moe": (lambda: _with_norm_weights(_make(
        T.HunYuanMoEV1Config, T.HunYuanMoEV1ForCausalLM, num_key_value_heads=2, head_dim=16, num_experts=4, moe_topk=2,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})),
                       "q/k RMSNorm after RoPE (learnt weights: drawn in 0.5 .. 1.5), NTK-alpha RoPE (a fixed "
                       "alpha: static frequencies), MoE MLP"),
    "hy_v3": (lambda: _make(T.HYV3Config, T.HYV3ForCausalLM, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32),
              "q/k RMSNorm per head, a dense first layer, then routed and shared experts"),
    "inkling_text": (lambda: _make(T.InklingTextConfig, T.InklingForCausalLM, num_key_value_heads=2, head_dim=16,
                                   swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=32,
                                   sliding_window_size=WINDOW, d_rel=4, rel_extent=16, local_layer_ids=[0, 2],
                                   log_scaling_n_floor=4, n_routed_experts=4, num_experts_per_tok=2,
                                   n_shared_experts=1, moe_intermediate_size=32),
                     "no RoPE: a learnt relative position bias from the hidden state (over 16 tokens), keys and "
                     "values after short convolutions (their states in the layer's cache beside the rows), "
                     "q/k RMSNorm with scale 1/head_dim, log-scaled queries on full layers; sliding layers with "
                     "heads and head_dim of their own (2 query heads, 1 kv head, 32 wide)"),
    "inkling2_text": (lambda: _make(T.Inkling2TextConfig, T.Inkling2ForCausalLM, num_key_value_heads=2,
                                    head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1,
                                    swa_head_dim=32, sliding_window_size=WINDOW, d_rel=4, rel_extent=16,
                                    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                                    log_scaling_n_floor=4, n_routed_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, n_layers_per_attn_res_block=2, unpadded_vocab_size=VOCAB),
                      "Inkling's, and sink logits per query from the hidden state, L2-clipped q/k, keys and "
                      "values from a dynamic convolution on full layers, a gated output projection, block "
                      "attention residuals"),
    "hrm_text": (lambda: _make(T.HrmTextConfig, T.HrmTextForCausalLM, head_dim=16, num_hidden_layers=1,
                               H_cycles=1, L_cycles=2),
                 "looped: a low-level stack run twice, then a high-level one, each run caching its own K/V "
                 "layer; a sigmoid gate per channel, MHA"),
    "dory": (lambda: _make(T.DoryConfig, T.DoryForCausalLM, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                           layer_types=SLIDING_FULL_SLIDING, n_input_layers=1, n_output_layers=1,
                           n_recurrent_loops=1),
             "nGPT-normalised q/k with learnt scales, a sigmoid gate and a sub-norm before the output "
             "projection, sliding and full layers; its recurrent section run once (more loops are refused)"),
    "ergo": (lambda: _make(T.ErgoConfig, T.ErgoForCausalLM, drop=("intermediate_size",), num_key_value_heads=2,
                           sliding_window=WINDOW, layer_types=SLIDING_FULL_SLIDING, global_attention_scale=2.0,
                           first_dense_intermediate_size=128, moe_intermediate_size=32, shared_intermediate_size=32,
                           num_experts=4, num_experts_per_tok=2),
             "fused qkv, q/k RMSNorm per head, interleaved RoPE (float64 angles) on sliding layers, full layers "
             "without RoPE whose queries and keys are scaled by sqrt(global_attention_scale), gated residuals, "
             "a dense first layer, then MoE with a norm per expert"),
    "kolibri1_1": (lambda: _make(T.Kolibri1_1Config, T.Kolibri1_1ForCausalLM, num_hidden_layers=6,
                                 num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                 layer_types=_KOLIBRI1_1_LAYERS,
                                 index_layers=[1, 2], kv_source_layers=[0, 1, 2, 3, 2, 1], index_topk=4,
                                 index_pool_size=8, index_compression=4, index_num_heads=2, index_num_local_tokens=4,
                                 index_num_sink_tokens=1, mlp_only_layers=[0], mlp_only_intermediate_size=128,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                   "sliding layers with RoPE; indexed-attention layers without RoPE whose indexer picks the keys "
                   "each query sees (a pool of 8, top 4, 1 sink and 4 local tokens, through the mask) and which "
                   "attend over NVFP4-rounded keys and values; KV sharing by kv_source_layers (the last layer reads "
                   "the first indexed layer's rows, not the last producer's), MoE MLP"),
    "minicpm5_moe": (lambda: _make(T.MiniCPM5MoeConfig, T.MiniCPM5MoeForCausalLM, num_key_value_heads=2, head_dim=16,
                                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
                     "Llama attention with a sigmoid gate per channel from a fused query and gate projection, "
                     "a dense first layer, then DeepSeek-V3 routed and shared experts"),
    "param2moe": (lambda: _make(T.Param2MoeConfig, T.Glm4MoeForCausalLM, num_key_value_heads=2, head_dim=16,
                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                first_k_dense_replace=1),
                  "GLM-4-MoE's modeling code with Param2's config: q/k RMSNorm per head, full rotary, a dense "
                  "first layer, then routed and shared experts"),
    "falcon": (lambda: _make(T.FalconConfig, T.FalconForCausalLM, multi_query=True, parallel_attn=True),
               "MQA (Falcon-7B's multi_query), fused qkv, parallel attention and MLP"),
    "falcon_alibi": (lambda: _make(T.FalconConfig, T.FalconForCausalLM, alibi=True, multi_query=False),
                     "Falcon with ALiBi: MHA, a rotary module built but never applied (keys carry no rotation)"),
    "exaone": (lambda: _make(T.ExaoneConfig, T.LlamaForCausalLM, num_key_value_heads=2, head_dim=16),
               "EXAONE 3.x: a config of its own over Llama's modelling"),
    "internlm3": (lambda: _make(T.InternLM3Config, T.LlamaForCausalLM, num_key_value_heads=2, head_dim=16,
                                attention_bias=True, mlp_bias=True),
                  "Llama's modelling, biased projections (`qkv_bias`)"),
    "iquestcoder": (lambda: _make(T.IQuestCoderConfig, T.LlamaForCausalLM, num_key_value_heads=2, head_dim=16),
                    "a config of its own over Llama's modelling"),
    "sarvam_moe": (lambda: _make(T.SarvamMoEConfig, T.Glm4MoeForCausalLM, num_key_value_heads=2, head_dim=16,
                                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 first_k_dense_replace=1, n_group=1, topk_group=1),
                   "GLM-4.5's MoE modelling: q/k RMSNorm per head, full rotary, a dense first layer"),
    "mellum": (lambda: _make(T.MellumConfig, T.MellumForCausalLM, num_key_value_heads=2, head_dim=16,
                             sliding_window=WINDOW, layer_types=SLIDING_FULL_SLIDING, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32),
               "q/k RMSNorm per head, sliding and full layers with RoPE of their own, sparse MoE MLP"),
    "aria_text": (lambda: _make(T.AriaTextConfig, T.AriaTextForCausalLM, num_key_value_heads=2, head_dim=16,
                                moe_num_experts=4, moe_topk=2, moe_intermediate_size=32),
                  "Aria's decoder: Llama's attention, MoE MLP with shared experts"),
    "beam": (lambda: _make(T.BeamConfig, T.BeamForCausalLM, num_key_value_heads=2, head_dim=16,
                           sliding_window=WINDOW, layer_types=SLIDING_FULL_SLIDING,
                           mlp_layer_types=["dense", "sparse", "sparse"], num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, n_group=1, topk_group=1),
             "q/k RMSNorm per head, sliding and full layers, a dense first layer then grouped-routing "
             "experts, final logit softcapping"),
    "bloom": (lambda: _make(T.BloomConfig, T.BloomForCausalLM),
              "ALiBi (a per-head linear bias on the scores), fused qkv"),
    "xglm": (lambda: _make(T.XGLMConfig, T.XGLMForCausalLM, d_model=64, ffn_dim=128, num_layers=3,
                           attention_heads=4),
             "sinusoidal absolute positions, queries scaled before attention"),
    "gpt_neo": (lambda: _make(T.GPTNeoConfig, T.GPTNeoForCausalLM, num_layers=3, num_heads=4, window_size=WINDOW,
                              attention_types=[[["local", "global"], 1], [["local"], 1]]),
                "learned absolute positions, local layers (a window of 8 by the mask, every row cached), "
                "unscaled scores"),
    "ctrl": (lambda: _make(T.CTRLConfig, T.CTRLLMHeadModel, drop=("hidden_size", "intermediate_size",
                                                                  "num_hidden_layers", "num_attention_heads",
                                                                  "max_position_embeddings"),
                           n_embd=64, n_layer=3, n_head=4, dff=128, n_positions=256),
             "sinusoidal absolute positions added to the embeddings (no RoPE), projections Wq, Wk, Wv, dense"),
    "emu3_text_model": (lambda: _make(T.Emu3TextConfig, T.Emu3ForCausalLM, num_key_value_heads=2),
                        "Emu3's decoder (its text and image tokens in one vocabulary): Llama's attention"),
    "phi4_multimodal": (lambda: _make(T.Phi4MultimodalConfig, T.Phi4MultimodalForCausalLM, num_key_value_heads=2,
                                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                         num_attention_heads=2, image_size=28, patch_size=14),
                                      audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1,
                                                        num_attention_heads=2)),
                        "Phi-4-multimodal (`Phi4MultimodalForCausalLM`: its decoder with tiny vision and audio "
                        "towers; a text prompt): fused qkv, Phi-3's attention"),
    "mllama_text_model": (lambda: _make(T.MllamaTextConfig, T.MllamaForCausalLM, num_key_value_heads=2,
                                        cross_attention_layers=[1]),
                          "Llama 3.2 Vision's decoder (`MllamaForCausalLM`): Llama's self-attention and "
                          "cross-attention layers over an image's rows, which a text-only forward skips"),
    "modernbert-decoder": (lambda: _make(T.ModernBertDecoderConfig, T.ModernBertDecoderForCausalLM,
                                         local_attention=2 * WINDOW, global_attn_every_n_layers=2, cls_token_id=1,
                                         sep_token_id=2),
                           "ModernBERT as a decoder: fused qkv (`Wqkv`), output projection `Wo`, local layers (a "
                           "window of `local_attention / 2`) between global ones, RoPE of its own per kind"),
    "mpt": (lambda: _make(T.MptConfig, T.MptForCausalLM, d_model=64, n_heads=4, n_layers=3, expansion_ratio=2),
            "ALiBi (a per-head linear bias on the scores), fused qkv, no biases"),
    "gpt_neox_japanese": (lambda: _make(T.GPTNeoXJapaneseConfig, T.GPTNeoXJapaneseForCausalLM, rotary_pct=0.5),
                          "fused qkv, partial rotary (half), a bias added after the attention's dense output"),
    "jetmoe": (lambda: _make(T.JetMoeConfig, T.JetMoeForCausalLM, num_key_value_heads=2, kv_channels=16,
                             num_local_experts=4, num_experts_per_tok=2),
               "mixture of attention heads (the query and output projections routed, 2 of 4 experts; "
               "K/V heads tiled, not interleaved, over the query heads), sparse MoE MLP"),
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
    "qwen3_5_moe_text": (lambda: _make(T.Qwen3_5MoeTextConfig, T.Qwen3_5MoeForCausalLM, num_key_value_heads=2,
                                       head_dim=16, layer_types=LINEAR_FULL_LINEAR, **_DELTANET, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32),
                         "hybrid: Gated DeltaNet layers, gated attention with q/k RMSNorm and partial rotary "
                         "(a quarter), MoE MLP with a shared expert"),
    "qwen4_exp_text": (lambda: _make(T.Qwen4ExpTextConfig, T.Qwen4ExpForCausalLM, num_key_value_heads=2, head_dim=16,
                                     layer_types=LINEAR_FULL_LINEAR, **_DELTANET, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32, shared_expert_intermediate_size=32, hc_count=2,
                                     hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                                     indexer_budget=8, indexer_compress_ratio=4),
                       "hybrid: Gated DeltaNet layers, gated attention with q/k RMSNorm whose keys an indexer "
                       "picks (top 2 blocks of 4 tokens and the tail, through the mask; its keys cached beside "
                       "the rows), hyper-connections, MoE MLP"),
    "olmo_hybrid": (lambda: _make(T.OlmoHybridConfig, T.OlmoHybridForCausalLM, num_key_value_heads=2,
                                  layer_types=LINEAR_FULL_LINEAR),
                    "hybrid: Gated DeltaNet layers, attention with q/k RMSNorm over the whole projection"),
    "jamba": (lambda: _make(T.JambaConfig, T.JambaForCausalLM, num_key_value_heads=2, attn_layer_period=2,
                            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                            mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
              "hybrid: Mamba layers, attention without positional encoding, MoE MLP"),
    "zamba": (lambda: _make(T.ZambaConfig, T.ZambaForCausalLM, num_key_value_heads=4, attention_head_dim=16,
                            num_hidden_layers=6, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                            mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, n_mamba_heads=2),
              "hybrid: Mamba layers, two of them also running one attention block (its weights tied across "
              "them), no positional encoding; each keeps K/V rows and its Mamba state in one cache layer"),
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
    "zaya": (lambda: _with_key_scale(_make(
                 T.ZayaConfig, T.ZayaForCausalLM, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                 layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], num_experts=4, num_experts_per_tok=1,
                 moe_intermediate_size=32, router_hidden_size=16)),
             "compressed convolutional attention: q/k from a causal convolution (its state in the layer's cache "
             "beside the rows), values half from the previous token (a recurrent state), L2-normalised q/k "
             "with a learnt key scale per head, partial rotary (half) per layer type, sliding and full layers"),
    "lfm2": (lambda: _make(T.Lfm2Config, T.Lfm2ForCausalLM, num_key_value_heads=2,
                           layer_types=["conv", "full_attention", "conv"]),
             "hybrid: short-convolution layers, attention with q/k RMSNorm per head"),
    "lara_mini": (lambda: _make(T.LaraMiniConfig, T.LaraMiniForCausalLM, num_key_value_heads=2, head_dim=16,
                                sliding_window=WINDOW, **_DELTANET, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                layer_types=["linear_attention", "sliding_attention", "full_attention"]),
                  "hybrid: Gated DeltaNet layers, q/k RMSNorm per head, sliding layers with RoPE and full layers "
                  "without, MoE MLP"),
    "lfm3": (lambda: _make(T.Lfm3Config, T.Lfm3ForCausalLM, num_key_value_heads=2, head_dim=16,
                           sliding_window=WINDOW, layer_types=["sliding_attention", "conv", "full_attention"]),
             "hybrid: a short-convolution layer between a sliding and a full attention layer, q/k RMSNorm per "
             "head, a sigmoid gate per head, `proportional` RoPE (half) on the full layer, sandwich norms"),
    "lfm2_moe": (lambda: _make(T.Lfm2MoeConfig, T.Lfm2MoeForCausalLM, num_key_value_heads=2,
                               layer_types=["conv", "full_attention", "conv"], num_experts=2,
                               num_experts_per_tok=1, moe_intermediate_size=32, num_dense_layers=1),
                 "hybrid: short-convolution layers, attention with q/k RMSNorm per head, MoE MLP"),
}


#: Families whose attention scales the queries after RoPE (per head and channel; Dory's nGPT ``sqk``,
#: constant at initialisation, so it commutes with the rotation): layer's attention module -> the
#: factor ``[q_heads, 1, head_dim]`` the queries entering RoPE are to be multiplied by.
QUERY_SCALE: Dict[str, Callable[[Any], torch.Tensor]] = {
    "dory": lambda m: (m.sqk * m.sqk_scale).square().view(-1, 1, m.head_dim).detach(),
}

#: Families of :data:`FAMILIES` whose calibration statistics (and the attention weights they are
#: weighted by) are refused by name, and what the refusal says: attention computed by their own
#: code, not through transformers' AttentionInterface (no queries and keys to take statistics of);
#: K/V heads tiled over the query heads (JetMoE: not the grouping the statistics assume); attention
#: calls that cannot be told apart by layer (HRM's loops, Zamba's shared block).
NO_STATISTICS: Dict[str, str] = {
    **dict.fromkeys(("bloom", "xglm", "gpt_neo", "mpt", "gpt_neox_japanese"),
                    "did not run their attention through transformers' AttentionInterface"),
    "jetmoe": "attention receives queries",
    "hrm_text": "attention modules share layer_idx",
    "zamba": "no attention module carries the index of layers",
}


#: Families of ``fast.FAMILIES`` whose checkpoints are multimodal and tested as such elsewhere
#: (``test_multimodal.py``: the decoder inside its ``...ForConditionalGeneration``), not built here.
ELSEWHERE = frozenset({"qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text", "qwen2_5_omni_text",
                       "qwen3_omni_moe_text", "cosmos3_edge_text", "hunyuan_vl_text", "hy_v4_vl_text", "glm4v_text",
                       "glm4v_moe_text", "glm_ocr_text", "glm_image_text", "ernie4_5_vl_moe_text",
                       "paddleocr_vl_text"})


def build(name: str) -> Any:
    return (FAMILIES.get(name) or MLA.get(name) or OWN_ROTATION[name])[0]()


def family_prompt(batch: int = 1, t: int = T_PROMPT, seed: int = 1) -> torch.Tensor:
    """Token ids of ``batch`` prompts of ``t`` tokens (above the special ids 0 to 2)."""
    return torch.randint(3, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


def rope_calls(model: Any, monkeypatch: Any) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Patches the family's own ``apply_rotary_pos_emb`` to record, per call (one per layer that
    applies RoPE, in layer order), ``(q, k)`` going in and ``cos, sin`` (GPT-J's and CodeGen's:
    one call per tensor, the keys first, on rows ``[batch, T, heads, D]``, with ``(sin, cos)``)."""
    mod = sys.modules[type(model).__module__]
    calls: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    orig = getattr(mod, "apply_rotary_pos_emb", None)
    if orig is None:  # a family without RoPE
        return calls
    hq = model.config.get_text_config(decoder=True).num_attention_heads
    query: List[torch.Tensor] = []  # Gemma 4 rotates one tensor per call: the queries, then the keys
    key: List[torch.Tensor] = []  # GPT-J: the keys, then the queries

    def spy(*a: Any, **kw: Any) -> Any:
        out = orig(*a, **kw)  # type: ignore[misc]
        if isinstance(out, tuple):
            calls.append((a[0].detach().clone(), a[1].detach().clone(), a[2], a[3]))
            return out
        if len(a) == 3 and not kw and a[1].shape[-1] * 2 == a[0].shape[-1]:  # GPT-J: (x, sin, cos)
            x = a[0].detach().clone().transpose(1, 2)
            if x.shape[1] == hq:  # (describe's probe has 2 heads)
                if key:
                    calls.append((x, key.pop(), a[2], a[1]))
                else:
                    key.append(x)
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
