"""What a decoder's attention modules hold, which :func:`~kakeyaturbo.families.describe` checks its
config against before reading it: a layer count the model does not have (a config edited after the
model was built, ``num_hidden_layers`` past :data:`MAX_LAYERS`), head counts or widths other than
its projections' (``num_key_value_heads`` changed in ``config.__dict__``) are refused by name, not
read as the config says."""

from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._limits import MAX_LAYERS
from ..errors import UnsupportedModelError

#: How the class names of attention modules end (LongCat-Flash's is ``LongcatFlashMLA``).
ATTENTION_NAMES = ("Attention", "MLA")
#: Attributes holding the query-head count, the kv-head count, by family.
_Q_ATTRS = ("num_heads", "num_attention_heads", "n_heads")
_KV_ATTRS = ("num_key_value_heads", "num_kv_heads")
#: Output projections (``[hidden, q_heads * v_dim]``) and fused q/k/v projections
#: (``[(q_heads + 2 kv_heads) * head_dim, hidden]``), by family.
_OUTPUT = ("o_proj", "dense", "out_proj", "wo")
_FUSED = ("qkv_proj", "query_key_value", "Wqkv", "c_attn")
#: Where a decoder keeps its layers (GPT-2's ``h``, DBRX's ``blocks``).
_LAYER_LISTS = ("layers", "h", "blocks")


def layer_count(cfg: Any, mt: str) -> int:
    """The config's ``num_hidden_layers``; UnsupportedModelError unless an integer in
    ``0 .. MAX_LAYERS``."""
    n = _int(cfg, ("num_hidden_layers",))
    if n is None or not 0 <= n <= MAX_LAYERS:
        raise UnsupportedModelError(
            f"model type {mt!r}: its config's num_hidden_layers {str(getattr(cfg, 'num_hidden_layers', None))[:40]} "
            f"is not a layer count in 0..{MAX_LAYERS}")
    return n


def _decoder_layers(model: Any, n: int, mt: str, by: Dict[int, List[Any]]) -> None:
    """UnsupportedModelError where the decoder keeps its layers in a list and ``n`` is more than it
    holds and than an attention module's ``layer_idx`` reaches (LongCat-Flash: two attention layers
    per decoder layer)."""
    try:
        dec = model.get_decoder()
    except Exception:  # a model without a decoder to name
        dec = None
    lists: List[Any] = [getattr(dec, a, None) for a in _LAYER_LISTS] if dec is not None else []
    have = [len(x) for x in lists if type(x).__name__ == "ModuleList"]
    top = max(by, default=-1)
    if have and n > max(have[0], top + 1):
        raise UnsupportedModelError(
            f"model type {mt!r}: its config's num_hidden_layers says {n} layers, but the model has {have[0]} "
            f"decoder layers" + (f" (attention modules to layer_idx {top})" if by else ""))


def _int(obj: Any, names: Sequence[str]) -> Optional[int]:
    for name in names:
        v = getattr(obj, name, None)
        if isinstance(v, numbers.Integral) and not isinstance(v, bool):
            return int(v)
    return None


def modules_by_layer(model: Any, index: Sequence[str] = ("layer_idx", "layer_id")) -> Dict[int, List[Any]]:
    """Every attention module of the model (named ``*Attention`` or ``*MLA``) by its layer index,
    the first of the attributes ``index`` it holds (GPT-Neo's is ``layer_id``), in the order
    ``model.modules()`` gives them."""
    out: Dict[int, List[Any]] = {}
    for mod in model.modules():
        idx = _int(mod, index) if type(mod).__name__.endswith(ATTENTION_NAMES) else None
        if idx is not None:
            out.setdefault(idx, []).append(mod)
    return out


def _shared(mods: List[Any]) -> bool:
    """Whether several of one index's modules are not inside one another (GPT-Neo's self-attention
    inside its attention is one layer's): one index attending for several layers."""
    inner = {id(m) for o in mods for m in o.modules() if m is not o}
    return sum(id(m) not in inner for m in mods) > 1


def check_layers(model: Any, by: Dict[int, List[Any]], mt: str, n: int, attending: Sequence[int]) -> None:
    """UnsupportedModelError where the config's ``n`` layers are more than the model has (its
    decoder's list of layers, its attention modules' ``layer_idx``), or a layer of ``attending``
    (those that run attention) has no attention module of its index in ``by``
    (:func:`modules_by_layer`); the latter unchecked where the model has none with an index, or
    modules shared across layers (Zamba 2's block, index -1; HRM's loops, one index twice). Fewer
    layers than the model has are not refused: a model runs ``layers[:num_hidden_layers]``, and MTP
    layers past the config's are not run."""
    _decoder_layers(model, n, mt, by)
    if not by or any(i < 0 or _shared(mods) for i, mods in by.items()):
        return
    missing = [i for i in attending if i not in by]
    if missing:
        have = sorted(by)
        raise UnsupportedModelError(
            f"model type {mt!r}: its config says {len(attending)} of its {n} layers attend, but the model has "
            f"attention modules for {len(have)} (layer_idx {have[0]}..{have[-1]}): none for layer {missing[0]}")


def _expected(spec: Any, latent: bool) -> List[Tuple[str, Tuple[str, ...], int]]:
    """``(what, attribute or projection names, count)`` a layer's attention module holds where the
    layer is as ``spec`` says; ``what`` is ``attr`` (an attribute), ``out``/``in`` (a linear
    projection's ``out_features``/``in_features``)."""
    hq, hkv, d = spec.q_heads, spec.kv_heads, spec.head_dim
    if latent:  # multi-head latent attention: the latent and the rotated key part, one projection
        return [("attr", _Q_ATTRS, hq), ("out", ("kv_a_proj_with_mqa",), d + (spec.v_dim or 0))]
    if spec.kind == "compressed":  # DeepSeek V4: K=V rows of head_dim + v_dim channels
        return [("attr", _Q_ATTRS, hq), ("attr", ("head_dim",), d + (spec.v_dim or 0))]
    dv = spec.v_dim or d
    return [("attr", _Q_ATTRS, hq), ("attr", _KV_ATTRS, hkv), ("attr", ("head_dim", "head_size"), d),
            ("out", ("k_proj",), hkv * d), ("out", ("v_proj",), hkv * dv), ("in", _OUTPUT, hq * dv),
            ("out", _FUSED, (hq + 2 * hkv) * d)]


def _held(mod: Any, what: str, names: Tuple[str, ...]) -> Optional[Tuple[str, int]]:
    """``(name, count)`` of the first of ``names`` the module holds, None where it holds none."""
    for name in names:
        if what == "attr":
            v = _int(mod, (name,))
        else:
            v = _int(getattr(mod, name, None), ("out_features" if what == "out" else "in_features",))
        if v is not None:
            return (name if what == "attr" else f"{name}.{what}_features"), v
    return None


def _mismatches(mod: Any, spec: Any, latent: bool) -> Optional[List[str]]:
    """What ``mod`` holds other than ``spec`` says (empty: it agrees), None where it holds nothing."""
    found = [(h, n) for what, names, n in _expected(spec, latent) if (h := _held(mod, what, names)) is not None]
    if not found:
        return None
    return [f"{name} {got} (the config's: {n})" for (name, got), n in found if got != n]


def check_heads(by: Dict[int, List[Any]], mt: str, specs: Sequence[Any], latent: bool) -> None:
    """UnsupportedModelError where every attention module of a layer's index that holds its head
    counts or widths (attributes, projection shapes) holds others than the layer's ``spec`` (a
    :class:`~kakeyaturbo.families.LayerSpec`, read from the config) says; layers without such a
    module are not checked."""
    for s in specs:
        if not s.attends:
            continue
        seen = [(m, bad) for m in by.get(s.index, ()) if (bad := _mismatches(m, s, latent)) is not None]
        if seen and all(bad for _, bad in seen):
            mod, bad = seen[0]
            raise UnsupportedModelError(
                f"model type {mt!r}: layer {s.index}'s attention receives other heads than its config reads, "
                f"(q_heads, kv_heads, head_dim) = {(s.q_heads, s.kv_heads, s.head_dim)}: its "
                f"{type(mod).__name__} holds {', '.join(bad)}")
