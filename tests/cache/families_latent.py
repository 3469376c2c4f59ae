"""Tiny random-weight decoders of the families with multi-head latent attention (each layer
caches a latent row and the rotated key part) and of those whose modeling code rotates keys
with a function of its own, built as ``families.py``'s."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import transformers as T

from .family_base import _DSA, _MLA, _ROUTED, LINEAR_FULL_LINEAR, WINDOW, _make

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
    "hy_v4": (lambda: _make(T.HYV4Config, T.HYV4ForCausalLM, **_DSA, **_ROUTED, **dict(_MLA, q_lora_rank=16),
                            indexer_types=["full", "shared", "full"], hc_mult=2, learnable_sink_init=1.0),
              "MLA with dynamic sparse attention, the middle layer reusing the picks of the one before; learnt "
              "sinks, a sigmoid gate per channel, hyper-connections (2 channels)"),
    "longcat_flash": (lambda: _make(T.LongcatFlashConfig, T.LongcatFlashForCausalLM,
                                    drop=("intermediate_size", "num_hidden_layers"), num_layers=2,
                                    ffn_hidden_size=128, head_dim=8, n_routed_experts=4, moe_topk=2,
                                    zero_expert_num=2, expert_ffn_hidden_size=32, **dict(_MLA, q_lora_rank=16)),
                      "MLA, two attention sublayers per layer (4 cached layers), LoRA-scaled latents, interleaved "
                      "RoPE, MoE with zero experts"),
    "sarvam_mla": (lambda: _make(T.SarvamMLAConfig, T.DeepseekV3ForCausalLM, **_MLA, **_ROUTED),
                   "DeepSeek-V3's modeling code with Sarvam's config: MLA, interleaved RoPE, routed and shared "
                   "experts"),
    "axk1": (lambda: _make(T.AXK1Config, T.AXK1ForCausalLM, **_ROUTED, **dict(_MLA, q_lora_rank=16)),
             "MLA with a low-rank query, routed and shared experts"),
    "axk2": (lambda: _make(T.AXK2Config, T.AXK2ForCausalLM, **_DSA, **_ROUTED, **dict(_MLA, q_lora_rank=16),
                           gated_norm_rank=4),
             "MLA with dynamic sparse attention, a fused query and sigmoid-gate projection, interleaved RoPE"),
    "bailing_hybrid": (lambda: _make(T.BailingHybridConfig, T.BailingHybridForCausalLM, layer_types=LINEAR_FULL_LINEAR,
                                     head_dim=16, num_local_experts=4, num_mtp_layers=0, **_ROUTED, **_MLA),
                       "hybrid: Kimi Delta Attention layers around an MLA layer (Ling 2.5), routed and shared "
                       "experts"),
    "dots3_note_text": (lambda: _make(T.Dots3NoteTextConfig, T.Dots3NoteForCausalLM, **_DSA, **_ROUTED,
                                      **dict(_MLA, q_lora_rank=16), head_dim=24, shared_experts_intermediate_size=32,
                                      sliding_window=WINDOW,
                                      layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
                                      swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=16,
                                      swa_kv_lora_rank=16, swa_head_dim=24, swa_qk_nope_head_dim=16,
                                      swa_v_head_dim=16),
                        "MLA with dynamic sparse attention, and a sliding MLA layer with a latent of its own (16 "
                        "wide: per-layer config), LoRA-scaled latents, a normed rotated key part, a gate per head"),
    "kimi_linear": (lambda: _make(T.KimiLinearConfig, T.KimiLinearForCausalLM, layer_types=LINEAR_FULL_LINEAR,
                                  linear_head_dim=16, linear_num_heads=4, **_MLA),
                    "hybrid: Kimi Delta Attention layers around an MLA layer"),
}


#: Families whose modeling code rotates keys with a function of its own, not
#: ``apply_rotary_pos_emb`` (Llama 4: complex products by ``freqs_cis``), which the battery of
#: ``test_families.py`` records: tested by ``test_family_layouts.py`` and the fast path's test.
OWN_ROTATION: Dict[str, Tuple[Callable[[], Any], str]] = {
    "llama4_text": (lambda: _make(T.Llama4TextConfig, T.Llama4ForCausalLM, num_key_value_heads=2, head_dim=16,
                                  intermediate_size_mlp=128, num_hidden_layers=4, attention_chunk_size=WINDOW,
                                  num_local_experts=2, num_experts_per_tok=1, no_rope_layers=[1, 1, 1, 0],
                                  interleave_moe_layer_step=2),
                    "chunked attention (chunks of 8), a NoPE global layer, complex-valued RoPE, an L2 q/k norm "
                    "after it, MoE MLP"),
}
