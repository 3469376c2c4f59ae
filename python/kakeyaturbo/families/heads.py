"""Head counts and widths of each layer of a decoder, as its attention modules size their
projections: the config's, a per-layer config's (Gemma 4), or a family's own rule."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

#: Families whose layers differ in head counts or head_dim by a rule of their own config (no
#: per-layer config): ``(config, layer index, layer type) -> (q_heads, kv_heads, head_dim)``, as
#: their attention modules size their projections.
HEADS_IF: Dict[str, Callable[[Any, int, str], Tuple[int, int, int]]] = {
    # MiMo-V2-Flash: sliding layers have twice the kv heads of the full ones.
    "mimo_v2_flash": lambda c, i, lt: (c.num_attention_heads,
                                       c.num_key_value_heads * (2 if lt == "sliding_attention" else 1), c.head_dim),
    "laguna": lambda c, i, lt: (c.num_attention_heads_per_layer[i], c.num_key_value_heads, c.head_dim),
    # Inkling (1 and 2): sliding layers with heads and head_dim of their own.
    "inkling_text": lambda c, i, lt: _inkling_heads(c, lt),
    "inkling2_text": lambda c, i, lt: _inkling_heads(c, lt),
}


def _inkling_heads(c: Any, lt: str) -> Tuple[int, int, int]:
    if lt == "hybrid_sliding":
        return c.swa_num_attention_heads, c.swa_num_key_value_heads, c.swa_head_dim
    return c.num_attention_heads, c.num_key_value_heads, c.head_dim


def per_layer(cfg: Any, i: int, name: str) -> Any:
    """``name`` of layer ``i``'s per-layer config where the config has one, else the config's (None
    where it has none)."""
    try:
        lc = cfg.per_layer_config[i]
    except Exception:  # configs without per-layer views
        lc = cfg
    return getattr(lc, name, None)


def layer_heads(cfg: Any, i: int, mt: str = "", lt: str = "") -> Tuple[int, int, int]:
    """``(q_heads, kv_heads, head_dim)`` of layer ``i`` (of layer type ``lt``, model type ``mt``):
    from its per-layer config where the config has one (Gemma 4's global layers: another head_dim
    and kv-head count), by the family's rule of :data:`HEADS_IF`, else the config's."""
    hq = int(per_layer(cfg, i, "num_attention_heads") or cfg.num_attention_heads)
    hkv = per_layer(cfg, i, "num_key_value_heads")
    if hkv is None and getattr(cfg, "multi_query", False) and not getattr(cfg, "new_decoder_architecture", False):
        hkv = 1  # multi-query by a flag (Falcon-7B); Falcon-40B's new architecture caches every query head
    hkv = int(hkv or hq)
    d = int(per_layer(cfg, i, "head_dim") or cfg.hidden_size // hq)
    if mt in HEADS_IF:
        hq, hkv, d = (int(n) for n in HEADS_IF[mt](cfg, i, lt))
    return hq, hkv, d

