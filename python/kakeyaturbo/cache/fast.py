"""Generation through the codes: attention of a :class:`~kakeyaturbo.cache.KakeyaCache` layer
computed by :func:`kakeyaturbo.decode_attention` over its sealed blocks, never decoding them.

transformers looks a layer's attention function up by the name in the model's config at every
call (``AttentionInterface``). :func:`install` registers two names, one per implementation it
can stand in for (``sdpa`` and ``eager``, each with that implementation's mask function), and
points the model at the one of its own implementation. The function registered there
(:func:`attention`) looks at the key tensor it is handed:

- the tensor a fast :class:`~kakeyaturbo.cache.layer.KakeyaLayer` returned from ``update`` (it
  carries the layer): that layer staged the call's rows without sealing them, so attention runs
  over the layer's :class:`~kakeyaturbo.LayerCodes` (its sealed blocks), its raw sink rows and
  its staging rows (which end with the call's own), and then the layer seals what filled;
- any other key (another cache, a layer the fast path does not cover): the model's own
  implementation, unchanged.

Keys coded after RoPE (``[k] rope = "after"``) are in the queries' domain: each score is a
sum of table look-ups. Keys coded before RoPE (the shipped recipes) are synthesised per tile
inside the kernel and rotated with the cos/sin of their positions (:func:`rope_table`: one
table per rotary module, shared by every layer and cache that uses it), then dotted with the
rotated queries. Unsupported cases fall back to decoding the sealed blocks and running the
model's own implementation (:meth:`KakeyaLayer.materialize`).

Multi-head latent attention (:data:`LATENT`: DeepSeek V2/V3/V3.2, GLM-4.7-Flash, GLM-5, MiniCPM3,
Youtu, HY-V4, LongCat-Flash, Sarvam, A.X-K1/K2, dots.llm3) caches a latent row and a rotated key
part per token and expands them into every head's keys and values (``expand_kv``, the value
projection ``kv_b_proj``) before attention. For those, :func:`install` also wraps each attention
module's ``expand_kv`` so that the rows a fast layer returned pass through unexpanded, and
:func:`attention` computes the absorbed form: each head's query moved into the latent space
(``W_uk^T q_nope``), scores from both streams' codes, the weighted sum of the latent codes, then
the head's value projection (``W_uv``) on it (:func:`_attend_latent`; learnt sinks, HY-V4's, as
for the other layers). Dynamic sparse attention's picks (``indices``) are folded into the mask,
as the model does for eager and sdpa. The Rust kernel only: on a GPU these layers take the slow path.
"""

from __future__ import annotations

import math
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..codec.attention import RopeTable, additive_mask, sink_logits_array, with_sink_logits
from ..families.capture import sparse_mask
from ..families.layout import model_type, text_config
from ..families.rope import LayerRope, kernel_rows, tabulated_rows, unscale_keys
from .padding import causal_mask, move_sinks

#: Implementation name the cache registers in transformers' attention interfaces, by the
#: implementation it stands in for.
NAMES = {"sdpa": "kakeyaturbo_codes_sdpa", "eager": "kakeyaturbo_codes_eager"}

#: Multi-head latent attention families whose attention modules expand the cached rows with
#: ``expand_kv`` (wrapped by :func:`install`; checked on a tiny model of each in
#: ``tests/cache/test_mla.py``).
LATENT = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
                    "minicpm3", "youtu", "hy_v4", "longcat_flash", "sarvam_mla", "axk1", "axk2",
                    "dots3_note_text", "hy_v4_vl_text"})

#: Model types whose attention hands the tensor ``update`` returned straight to the attention
#: function (checked on a tiny model of each in ``tests/cache/test_fast.py``).
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
                      "olmo2", "cohere", "smollm3", "mixtral", "qwen2_moe", "qwen3_moe", "granite",
                      "olmo3", "starcoder2", "stablelm", "exaone4", "ministral", "seed_oss", "apertus",
                      "arcee", "gpt_oss", "glm4", "ernie4_5", "glm4_moe", "cohere2", "olmoe", "minimax_m2",
                      "phimoe", "nemotron", "granitemoe", "exaone_moe", "ministral3", "vaultgemma", "glm",
                      "ernie4_5_moe", "flex_olmo", "bitnet", "persimmon", "gemma4_text", "gemma3n_text",
                      "llama4_text", "gemma", "olmo", "opt", "biogpt", "gpt_bigcode", "dbrx", "gptj", "codegen",
                      "granitemoeshared", "granite_swa", "granitemoe_swa", "solar_open", "jais2",
                      "apertus1p5_text", "hyperclovax", "minimax_m3_vl_text", "cwm", "dots1", "helium",
                      "hunyuan_v1_moe", "hunyuan_v1_dense", "nanochat", "cohere_compass_text", "mimo_v2_flash",
                      "laguna", "hy_v3", "dory",
                      "falcon",  # not with ALiBi (:func:`install` refuses it: the bias rides in the mask)
                      "ergo", "minicpm5_moe", "param2moe", "exaone", "internlm3", "iquestcoder", "sarvam_moe",
                      "mellum", "aria_text", "gemma4_unified_text", "modernbert-decoder",
                      "emu3_text_model", "beam", "mllama_text_model", "ctrl", "phi4_multimodal",
                      "gpt2", "gpt_neox", "phi",
                      # multimodal checkpoints' decoders (tests/cache/test_multimodal*.py)
                      "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text",
                      "qwen2_5_omni_text", "qwen3_omni_moe_text", "cosmos3_edge_text", "hunyuan_vl_text",
                      "glm4v_text", "glm4v_moe_text", "glm_ocr_text", "glm_image_text", "ernie4_5_vl_moe_text",
                      "paddleocr_vl_text",
                      # hybrids: recurrent, state-space or convolution layers beside the attention
                      "qwen3_next", "qwen3_5_text", "olmo_hybrid", "jamba", "bamba", "granitemoehybrid",
                      "nemotron_h", "lfm2", "lfm2_moe", "falcon_h1", "qwen3_5_moe_text", "qwen4_exp_text",
                      "lfm3", "lara_mini", "zaya"}) | LATENT

#: The attribute of a key tensor that names the layer which returned it.
TAG = "_kakeyaturbo_layer"

_registered = False

#: Rope tables by rotary module (weakly: a table goes with its model), then (layer type, style,
#: reverse).
_TABLES: "weakref.WeakKeyDictionary[Any, Dict[Tuple[Any, str, bool], RopeTable]]" = weakref.WeakKeyDictionary()

#: The fewest rows a rope table has; past it, a table holds a multiple of :data:`TABLE_STEP`
#: positions, grown when a position passes its end.
TABLE_ROWS = 256
TABLE_STEP = 1024
#: The most positions a rope table covers (8 bytes per position and rotary frequency: 1 GiB
#: for 64 frequencies); a sealed row at a later position (a model past such a context, or
#: position ids far past the tokens) is attended by the slow path instead.
TABLE_MAX = 1 << 21


def dynamic_rope(rope: Optional[LayerRope]) -> Optional[str]:
    """Why ``rope``'s cos/sin cannot be tabulated once per position (``dynamic`` rope types,
    whose frequencies follow the sequence length, where no limit below which they do not is
    known), else None. ``longrope`` has two tables, one per set of factors (:func:`rope_table`,
    :meth:`~kakeyaturbo.cache.positions.Positions.rotation`); a dynamic rope type's is the
    original frequencies' below :attr:`~kakeyaturbo.families.rope.LayerRope.static_until`."""
    if rope is None or rope.static_until is not None:
        return None
    kind = getattr(rope.module, "rope_type", "default")
    if isinstance(kind, dict):
        kind = kind.get(rope.layer_type, "default")
    if isinstance(kind, str) and "dynamic" in kind:
        return f"rope type {kind!r} changes its frequencies with the length: sealed keys are decoded, then attended"
    return None


def rope_table(rope: LayerRope, n: int) -> RopeTable:
    """The cos/sin of ``rope`` for positions ``0 .. n-1`` at least, as the model's rotary module
    gives them (one table per module, layer type and pairing, shared by every layer and cache;
    at least :data:`TABLE_ROWS` rows, then the multiple of :data:`TABLE_STEP` that covers ``n``:
    computing a table is cheap next to holding a large one). A ``longrope`` module's long
    factors (the short ones' rows are appended by the cache's positions)."""
    try:
        tables = _TABLES.setdefault(rope.module, {})
    except TypeError:  # a rotary callable that cannot be referenced weakly: kept on the layer's rope
        tables = rope.__dict__.setdefault("_kakeyaturbo_tables", {})
    key = (rope.layer_type, rope.style, rope.reverse)
    t = tables.get(key)
    if t is None or t.n_positions < n:
        rows = max(TABLE_ROWS, -(-n // TABLE_STEP) * TABLE_STEP if n > TABLE_ROWS else TABLE_ROWS)
        # a tabulated rotary (GPT-J): its rows only; a dynamic rope type: below its limit
        for limit in (tabulated_rows(rope.module), rope.static_until):
            if limit is not None and n <= limit < rows:
                rows = limit
        cos, sin = rope(torch.arange(rows)[None], long=True if rope.long_after is not None else None)
        t = RopeTable.from_full(_f32(cos[0]), _f32(sin[0]), rope.style)
        tables[key] = t
    return t


def _delegate(module: Any, base: str) -> Callable[..., Tuple[Any, Any]]:
    """The model's own attention: ``sdpa``, or the eager function of the module's family."""
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if callable(fn):
        return fn
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _make(base: str) -> Callable[..., Tuple[Any, Any]]:
    def fn(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
           **kwargs: Any) -> Tuple[Any, Any]:
        return attention(module, query, key, value, attention_mask, base=base, **kwargs)

    fn.__name__ = NAMES[base]
    return fn


def register() -> None:
    """Registers :data:`NAMES` in transformers' attention and mask interfaces (once)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for base, name in NAMES.items():
        AttentionInterface.register(name, _make(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[base])
    _registered = True


def base_of(model: Any) -> Optional[str]:
    """The implementation the model runs (``sdpa`` or ``eager``, also when it runs ours in its
    place), else None."""
    impl = getattr(model.config, "_attn_implementation", None)
    for base, name in NAMES.items():
        if impl in (base, name):
            return base
    return None


def install(model: Any) -> Optional[str]:
    """Points ``model`` at the registered stand-in of its implementation. Returns why not
    (a sentence) when it cannot: an implementation other than ``sdpa`` and ``eager``, a family
    not in :data:`FAMILIES`; None once installed. For any cache other than a fast
    :class:`~kakeyaturbo.cache.KakeyaCache` the model computes exactly as before."""
    mt = model_type(model)
    if mt not in FAMILIES:
        return f"model type {mt!r} is not among the families checked for the fast path"
    if getattr(text_config(model), "alibi", False) is True:  # Falcon with ALiBi
        return (f"model type {mt!r} with ALiBi: its position bias rides in the attention mask, which the "
                "fast path reads as which keys a query sees, not as scores to add")
    base = base_of(model)
    if base is None:
        return (f"attention implementation {model.config._attn_implementation!r}: the fast path "
                "stands in for 'sdpa' and 'eager' only")
    register()
    if model.config._attn_implementation != NAMES[base]:
        model.set_attn_implementation(NAMES[base])
    if mt in LATENT:
        for module in model.modules():
            if callable(getattr(type(module), "expand_kv", None)) and hasattr(module, "kv_b_proj"):
                if not getattr(module.__dict__.get("expand_kv"), "_kakeyaturbo", False):
                    module.expand_kv = _latent_expand(module)
    return None


def _latent_expand(module: Any) -> Callable[[Any, Any], Tuple[Any, Any]]:
    """``module.expand_kv`` that hands the rows a fast layer returned (tagged with it) to
    :func:`attention` as they are (it attends in the latent space); any others are expanded as
    the model's own ``expand_kv`` does."""
    ref = weakref.ref(module)

    def expand_kv(kv_nope: Any, k_rot: Any) -> Tuple[Any, Any]:
        if getattr(kv_nope, TAG, None) is not None:
            return kv_nope, k_rot
        m = ref()
        assert m is not None
        return type(m).expand_kv(m, kv_nope, k_rot)

    expand_kv._kakeyaturbo = True  # type: ignore[attr-defined]
    return expand_kv


def _bool_mask(mask: Any, n_q: int, total: int) -> Optional[torch.Tensor]:
    """transformers' mask ``[B, 1, n_q, kv]`` (boolean, or additive with the dtype's minimum
    where masked) as a boolean ``[B, 1, n_q, total]`` (True: attend) over the layer's held
    positions, on the mask's device: the mask covers the last ``kv`` of them; earlier ones lie
    outside every query's window and stay masked. None when there is no mask."""
    if mask is None:
        return None
    m = mask
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    m = m[..., -n_q:, :]
    if m.shape[1] != 1:
        m = m[:, :1]
    kv = m.shape[-1]
    if kv > total:
        m = m[..., kv - total:]
    elif kv < total:
        pad = torch.zeros((*m.shape[:-1], total - kv), dtype=torch.bool, device=m.device)
        m = torch.cat([pad, m], dim=-1)
    return m


def _f32(x: torch.Tensor) -> np.ndarray:
    """``x`` as a float32 C-contiguous array on the host: its own memory where it is one already
    (a float32 model's rows on the CPU), else a copy."""
    if x.dtype is torch.float32 and x.is_cpu and not x.requires_grad and x.is_contiguous():
        return x.numpy()
    return x.detach().to("cpu", torch.float32).contiguous().numpy()


#: Raw rows and queries as the kernel reads them (a bfloat16 model's as their bits: not converted
#: by torch at every step).
_rows = kernel_rows


def attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, *,
              base: str, **kwargs: Any) -> Tuple[Any, Any]:
    """The attention function of :data:`NAMES` (see the module docstring). ``query``
    ``[B, H_q, n_q, D]``; returns ``(output [B, n_q, H_q, D_v], None)`` as transformers'
    functions do."""
    layer = getattr(key, TAG, None)
    if isinstance(attention_mask, torch.Tensor):  # dynamic sparse attention's picks, as eager/sdpa take them
        attention_mask, kwargs = sparse_mask(attention_mask, kwargs, attention_mask.shape[-1])
    if layer is None:
        return _delegate(module, base)(module, query, key, value, attention_mask, **kwargs)
    try:
        codes = layer.codes()
        rot = None
        if codes is not None and codes.rows() and layer.pre_rope:
            rot = layer.key_rotation()  # None past TABLE_MAX positions
        if (codes is None or codes.rows() == 0 or not _supported(module, kwargs)
                or (layer.pre_rope and rot is None)):
            # Nothing sealed (the prompt's own attention at prefill, a layer too short to
            # seal) or a case the kernel does not cover: the rows as the slow path hands them.
            k, v = layer.materialize()
            if layer.latent:  # the cached rows, expanded as the model's expand_kv does
                k, v = type(module).expand_kv(module, k, v)
            return _delegate(module, base)(module, query, k, v, attention_mask, **kwargs)
        if layer.latent:
            return _attend_latent(layer, codes, module, query, attention_mask, kwargs)
        if layer._kernel_of(query) == "triton":
            return _attend_triton(layer, module, query, attention_mask, kwargs, rot)
        return _attend(layer, codes, module, query, attention_mask, kwargs, rot)
    finally:
        layer.read()


def _sink_logits(module: Any, kwargs: Dict[str, Any], layer: Any = None) -> Any:
    """The learnt sinks the model's attention takes (GPT-OSS passes its ``sinks`` as ``s_aux``;
    its eager function reads ``module.sinks``), or None. A module found without them is
    remembered by ``layer`` (a missing attribute of a torch module is slow to look up)."""
    s = kwargs.get("s_aux")
    if s is not None or (layer is not None and layer._sinkless is module):
        return s
    s = getattr(module, "sinks", None)
    if s is None and layer is not None:
        layer._sinkless = module
    return s


def _supported(module: Any, kwargs: Dict[str, Any]) -> bool:
    """Whether the kernel computes what the model's own attention would: causal, no dropout,
    no position bias, no attention weights asked for (learnt sinks, one logit per query head,
    are applied: :func:`_sink_logits`)."""
    if kwargs.get("dropout", 0.0) or getattr(module, "training", False):
        return False
    if kwargs.get("output_attentions") or kwargs.get("position_bias") is not None:
        return False
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        return False
    return True


def _scale_softcap(module: Any, query: torch.Tensor, kwargs: Dict[str, Any]) -> Tuple[float, Optional[float]]:
    """The family's score scale (``scaling``, else ``1/sqrt(D)``) and softcap of this call."""
    scale = kwargs.get("scaling")
    if scale is None:
        scale = getattr(module, "scaling", None)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    softcap = kwargs.get("softcap")
    return float(scale), None if softcap is None else float(softcap)


def _key_weight(layer: Any, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The weight ``w`` of a norm after RoPE on keys coded before it (HunYuan's, float32 where
    ``like`` is), else None: the codes hold ``k'``, the model's keys are ``w * R k'``, so scores
    are ``(w * q) . R k'`` and the raw rows, divided by ``w``, give ``q . k`` as before."""
    return layer.rope.key_scale(like) if layer.pre_rope and not layer.latent else None


def _kernel(layer: Any, codes: Any, module: Any, query: torch.Tensor, q: np.ndarray, mask: Any,
            kwargs: Dict[str, Any], rot: Any = None, latent: bool = False) -> np.ndarray:
    """The attention of ``q`` (the kernel's queries for the model's ``query``) over the layer's
    codes and raw rows, as :func:`decode_attention` computes it, with the family's scale and
    softcap, the layer's window, threads and synthesis, the model's mask and learnt sinks;
    ``rot``: :meth:`KakeyaLayer.key_rotation`'s table and rows (keys coded before RoPE). The
    arrays go to the kernel as they are (:meth:`LayerCodes.kernel_attend`: it checks them): at
    every decode step and layer, the public function's own checks would repeat the cache's."""
    sk, sv, tk, tv = layer.raw_rows()
    w = _key_weight(layer, sk)
    if w is not None:
        q = (_f32(query) if q.dtype == np.uint16 else q) * _f32(w)  # (bfloat16 bits: widened first)
        sk, tk = unscale_keys(sk, w), unscale_keys(tk, w)
    n_q = query.shape[-2]
    total = sk.shape[-2] + codes.rows() + tk.shape[-2]
    scale, softcap = _scale_softcap(module, query, kwargs)
    m, at = _bool_mask(mask, n_q, total), layer.sink_rows()
    if m is None and at is not None:
        m = causal_mask(codes.batch, n_q, total)
    if m is not None:
        m = additive_mask(np.ascontiguousarray(m.to("cpu").numpy()), codes.batch, n_q, total)
        if at is not None:  # a left-padded batch's sinks (additive_mask's array is its own)
            move_sinks(m, at, sk.shape[-2], -np.inf)
    sinks = _sink_logits(module, kwargs, layer)
    sinks = None if sinks is None else sink_logits_array(_f32(sinks), q.shape[1])
    rope = None if rot is None else rot[0].kernel_args(rot[1].view(np.uint32), layer.synthesis)
    # A bfloat16 model's output comes back in bfloat16 (bits) where nothing is applied after the kernel.
    out_bf16 = query.dtype is torch.bfloat16 and query.is_cpu and sinks is None and not latent
    out, lse = codes.kernel_attend(q, _rows(sk), _rows(sv), _rows(tk), _rows(tv), m, scale, softcap, layer.window,
                                   layer.threads, rope, latent, out_bf16)
    return out if sinks is None else with_sink_logits(out, lse, sinks)[0]


def _attend(layer: Any, codes: Any, module: Any, query: torch.Tensor, mask: Any,
            kwargs: Dict[str, Any], rot: Any = None) -> Tuple[torch.Tensor, None]:
    out = _kernel(layer, codes, module, query, _rows(query), mask, kwargs, rot)
    # [B, n_q, H_q, D] as transformers' functions return it (numpy's transpose and copy cost less
    # than torch's for a decode step's few rows; no copy at all for one query row)
    o = torch.from_numpy(np.ascontiguousarray(out.transpose(0, 2, 1, 3)))
    if out.dtype == np.uint16:  # bfloat16 bits (_kernel's out_bf16)
        o = o.view(torch.bfloat16)
    if o.dtype != query.dtype or not query.is_cpu:
        o = o.to(device=query.device, dtype=query.dtype)
    return o, None


def _attend_latent(layer: Any, codes: Any, module: Any, query: torch.Tensor, mask: Any,
                   kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, None]:
    """Multi-head latent attention over the codes, in its absorbed form: ``query`` is every
    head's ``[q_nope, q_rot]``; ``q_nope`` goes into the latent space through the key half of
    ``kv_b_proj`` (``W_uk^T q_nope``), the kernel scores the latent and rotated rows and sums the
    latent ones (``latent=True``), and the value half (``W_uv``) maps each head's sum to its
    values: the model's attention output without expanding a cached row."""
    heads, dn, dv = query.shape[1], module.qk_nope_head_dim, module.v_head_dim
    # Both projections in the weight's own dtype, as the model's expand_kv computes them (a
    # bfloat16 model's weights are not copied to float32 at every step).
    w = module.kv_b_proj.weight.detach().view(heads, dn + dv, -1)
    q = query.detach()
    q_lat = torch.einsum("bhnd,hdr->bhnr", q[..., :dn].to(w.dtype), w[:, :dn])
    q_all = torch.cat([q_lat, q[..., dn:].to(q_lat.dtype)], dim=-1)
    out = _kernel(layer, codes, module, query, _f32(q_all), mask, kwargs, latent=True)  # (HY-V4's learnt sinks)
    o = torch.einsum("bhnr,hvr->bhnv", torch.from_numpy(out).to(device=w.device, dtype=w.dtype), w[:, dn:])
    return o.to(device=query.device, dtype=query.dtype).transpose(1, 2).contiguous(), None


def _attend_triton(layer: Any, module: Any, query: torch.Tensor, mask: Any, kwargs: Dict[str, Any],
                   rot: Any = None) -> Tuple[torch.Tensor, None]:
    """:func:`_attend` through the Triton kernel (:func:`~kakeyaturbo.kernels.attention.
    decode_attention_triton`) on the layer's device: the sealed codes staged there once per
    change of the sealed blocks (:meth:`KakeyaLayer.device_codes`), the rope table once per
    table and device."""
    from ..kernels.attention import decode_attention_triton

    table, positions = rot if rot is not None else (None, None)
    batch, pos = layer.device_codes(positions)
    sk, sv, tk, tv = layer.raw_rows()
    q, w = query.detach().float(), _key_weight(layer, sk)
    if w is not None:
        q, sk, tk = q * w, unscale_keys(sk, w), unscale_keys(tk, w)
    n_q = query.shape[-2]
    total = sk.shape[-2] + batch.k.rows + tk.shape[-2]
    scale, softcap = _scale_softcap(module, query, kwargs)
    out, _ = decode_attention_triton(batch, q, tk, tv, sink_k=sk, sink_v=sv,
                                     scale=scale, softcap=softcap, window=layer.window,
                                     mask=_sinks_moved(layer, _bool_mask(mask, n_q, total), n_q, total,
                                                       sk.shape[-2], sk.device),
                                     rope=None if table is None else staged_rope(table, batch.device),
                                     positions=pos, synthesis=layer.synthesis,
                                     sink_logits=_sink_logits(module, kwargs, layer))
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _sinks_moved(layer: Any, m: Optional[torch.Tensor], n_q: int, total: int, n: int,
                 device: torch.device) -> Optional[torch.Tensor]:
    """The boolean mask ``m`` (None: causal) with a left-padded batch's sinks moved
    (:func:`~kakeyaturbo.cache.padding.move_sinks`), a tensor of its own; ``m`` itself where
    no row is padded."""
    at = layer.sink_rows()
    if at is None:
        return m
    m = causal_mask(len(at), n_q, total, device) if m is None else m.expand(len(at), *m.shape[1:]).clone()
    return move_sinks(m, at, n, False)


#: Rope tables staged on a device for the Triton kernel, by table (weakly) and device.
_STAGED: "weakref.WeakKeyDictionary[RopeTable, Dict[str, Any]]" = weakref.WeakKeyDictionary()


def staged_rope(table: RopeTable, device: torch.device) -> Any:
    """``table`` on ``device`` (:func:`~kakeyaturbo.kernels.attention.stack_rope`), staged once
    per table and device."""
    from ..kernels.attention import stack_rope

    per = _STAGED.setdefault(table, {})
    got = per.get(str(device))
    if got is None:
        got = per[str(device)] = stack_rope(table, device)
    return got


class SealedCodes:
    """A layer's sealed blocks as the attention kernels read them: a
    :class:`~kakeyaturbo.LayerCodes` kept in step with the blobs of its K and V streams (sharing
    their bytes objects, not copies) and, for the Triton kernel, its copy on the device. ``epoch``
    counts the changes other than blocks appended, after which the device copy is staged anew."""

    def __init__(self) -> None:
        self.codes: Any = None
        self.starts: List[int] = []  # the position each block the codes hold starts at
        self.epoch = 0
        self._device: Any = None  # (epoch, blocks, LayerBatch, positions there, positions here)

    def forget(self) -> None:
        """Drops the codes (rebuilt from the blobs on the next :meth:`sync`)."""
        self.codes = None
        self.epoch += 1

    def sync(self, k: Any, v: Any, batch: int, make: Callable[[], Any]) -> Any:
        """The codes of the K and V streams' sealed blocks (``blocks``, ``starts``): the blocks
        sealed since the last call appended, front blocks a sliding window dropped popped, and
        built anew (``make()``) for another batch or any other change."""
        if self.codes is None or self.codes.batch != batch:
            self.codes = make()
            self.starts = []
            self.epoch += 1
        cs = self.starts
        if cs == k.starts and cs == v.starts:  # unchanged: every decode step but one per block
            return self.codes
        while cs and (not k.starts or cs[0] < k.starts[0]):
            self.codes.pop_front_block()
            cs.pop(0)
            self.epoch += 1
        if cs != k.starts[:len(cs)] or k.starts != v.starts:
            self.codes.clear()
            cs.clear()
            self.epoch += 1
        for j in range(len(cs), len(k.starts)):
            for st in (k, v):  # shared with the codes only as bytes objects (not views)
                if not all(type(b) is bytes for row in st.blocks[j] for b in row):
                    st.blocks[j] = [[bytes(b) for b in row] for row in st.blocks[j]]
            self.codes.append_blocks(k.blocks[j], v.blocks[j])
            cs.append(k.starts[j])
        return self.codes

    def on_device(self, device: torch.device, positions: Optional[np.ndarray]) -> Tuple[Any, Optional[torch.Tensor]]:
        """The synced codes on ``device`` and ``positions`` there: blocks appended since the last
        call are parsed alone (:func:`~kakeyaturbo.kernels.attention.extend_layer`), any other
        change stages the layer anew (:func:`~kakeyaturbo.kernels.attention.stack_layer`)."""
        from ..kernels.attention import extend_layer, stack_layer

        n = len(self.starts)
        held = self._device
        if held is not None and held[0] == self.epoch and held[1] == n:
            batch = held[2]
            if held[4] is positions:  # the layer reads its rows' positions anew only when they change
                return batch, held[3]
        elif held is not None and held[0] == self.epoch and 0 < held[1] < n:
            batch = extend_layer(held[2], self.codes, held[1])
        else:
            batch = stack_layer(self.codes, device)
        pos = None if positions is None else torch.from_numpy(np.ascontiguousarray(positions)).to(device)
        self._device = (self.epoch, n, batch, pos, positions)
        return batch, pos
