"""What a loaded decoder looks like to the cache, per layer: attention kind (full or sliding
window), head counts, the RoPE its keys carry; and what cannot work, refused up front with a
typed error naming the model type and the reason."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..errors import UnsupportedModelError
from .counts import check_heads, check_layers, layer_count, modules_by_layer
from .heads import layer_heads, per_layer
from .keynorm import key_norms
from .readers import cross_layers, kv_sources
from .detect import detect_complex_rope, detect_rope
from .rope import LayerRope, ModelRope

#: Cache layer types whose K/V rows are the keys and values of one token each, as
#: transformers' ``DynamicCache`` holds them: every full-attention token, or the last
#: ``window - 1`` tokens of a sliding-window layer.
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding",
                  "indexed_attention")
#: Of those, the layers that also hold a recurrent or convolution state beside their K/V rows
#: (Falcon-H1's attention and Mamba-2 mixer side by side); the cache keeps the state as
#: transformers does.
STATEFUL_KV_TYPES = ("hybrid", "hybrid_sliding")
#: K/V layer types with a sliding window (or a chunk: the cache keeps as much for either).
_SLIDING_TYPES = ("sliding_attention", "hybrid_sliding", "chunked_attention")
#: Cache layer types of hybrid models that hold no K/V rows but a fixed-size state (a linear
#: attention's or state-space model's recurrent state, a short convolution's), and ``dummy``
#: (a layer without attention, an MLP block: nothing cached). The cache keeps them as
#: transformers keeps them; only the K/V layers are coded.
STATE_LAYER_TYPES = ("linear_attention", "conv", "dummy")
#: Cache layer types of compressed attention (DeepSeek V4): a sliding window of K=V rows and,
#: beside it, entries the model's compressor emits, one per ``compress_rates[type]`` tokens
#: (CSA: 4, with a lightning indexer's entries of its own; HCA: 128), read as keys and values.
COMPRESSED_LAYER_TYPES = ("compressed_sparse_attention", "heavily_compressed_attention")
#: The key in such a layer's ``compressed_kv`` of the entries attention reads (the lightning
#: indexer's are under ``"indexer"``).
COMPRESSOR = "compressor"

#: Names of the attention output projection (``[hidden, q_heads * head_dim]``), by family.
_OUTPUT_PROJECTIONS = ("o_proj", "dense", "out_proj", "c_proj", "wo", "Wo")


@dataclass(frozen=True)
class LayerSpec:
    """One layer, by ``kind``:

    - ``"full"``, ``"sliding"`` (a query at position ``p`` sees keys ``p - window + 1 .. p``; the
      cache holds the last ``window - 1`` tokens) or ``"chunked"`` attention (Llama 4: a query
      sees the earlier keys of its chunk of ``window`` tokens, all within the last ``window``
      positions; the cache holds as much as a sliding layer of that window, and the model's
      mask marks the chunks), with the head counts and
      ``head_dim`` of its cached rows (``v_dim`` the values' width where it differs: multi-head
      latent attention), and ``states`` conv/recurrent states beside them where ``cache_type``
      (the transformers cache layer type) is ``hybrid`` (Falcon-H1);
    - ``"state"``: a hybrid model's layer that holds no K/V rows but ``states`` conv/recurrent
      states (``cache_type`` ``linear_attention`` or ``conv``) or nothing (``dummy``: an MLP
      block); head counts 0;
    - ``"shared"``: an attention layer that caches nothing and attends over the K/V rows of layer
      ``reads`` (Gemma 3n's and Gemma 4's KV sharing; its heads and ``window`` are its own);
    - ``"cross"``: cross-attention (Llama 3.2 Vision's, ``mllama``: ``config.cross_attention_layers``):
      its text queries attend over K/V rows computed from an image's vision features, not from
      the tokens, without RoPE; a text-only forward skips the layer, so calibration text gives it
      no statistics. The cache holds its rows beside the tokens' (:meth:`ModelLayout.kv_layers`
      leaves it out);
    - ``"compressed"``: compressed attention (DeepSeek V4's CSA and HCA layers, ``cache_type``
      one of :data:`COMPRESSED_LAYER_TYPES`): the last ``window - 1`` tokens' K=V rows (one
      kv-head) and one compressed entry per ``rate`` tokens, which grow with the context. What
      is coded is the entries, split as multi-head latent attention's rows are: their channels
      without RoPE as the "keys" (``head_dim`` wide), the rotated channels as the "values"
      (``v_dim`` wide); window rows and entries are ``head_dim + v_dim`` wide."""

    index: int
    kind: str
    window: Optional[int]
    q_heads: int
    kv_heads: int
    head_dim: int
    cache_type: str = ""
    states: int = 0
    reads: Optional[int] = None
    #: Width of the cached values where it is not ``head_dim`` (multi-head latent attention;
    #: MiMo-V2-Flash's narrower values, its config's ``v_head_dim``).
    v_dim: Optional[int] = None
    #: Compressed attention: source tokens per compressed entry.
    rate: Optional[int] = None

    @property
    def is_sliding(self) -> bool:
        return self.kind == "sliding"

    @property
    def has_kv(self) -> bool:
        """Whether the layer caches K/V rows (full, sliding or chunked attention; compressed
        attention's entries)."""
        return self.kind in ("full", "sliding", "chunked", "compressed")

    @property
    def is_cross(self) -> bool:
        """Whether the layer attends over an image's K/V rows (cross-attention), not the tokens'."""
        return self.kind == "cross"

    @property
    def attends(self) -> bool:
        """Whether the layer runs attention (over its own K/V rows or, shared, another's)."""
        return self.kind != "state"


@dataclass(frozen=True)
class ModelLayout:
    """A loaded model as :func:`describe` found it: ``model_type``, one :class:`LayerSpec` per
    layer, and the RoPE of each layer's keys (``rope``; None with ``rope_error`` saying why the
    rotation cannot be recomputed from the positions)."""

    model_type: str
    layers: Tuple[LayerSpec, ...]
    rope: Optional[ModelRope]
    rope_error: Optional[str]
    #: Multi-head latent attention (DeepSeek V2/V3, GLM-4.7-Flash, ...): each layer caches one
    #: latent row per token as its "keys" (``head_dim`` wide, no RoPE: ``rope`` holds no rotation
    #: for it) and the rotated key part shared by every head as its "values" (``v_dim`` wide,
    #: RoPE applied, coded as cached).
    latent: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def sliding(self) -> Tuple[bool, ...]:
        return tuple(s.is_sliding for s in self.layers)

    @property
    def stateful(self) -> bool:
        """Whether a layer holds a recurrent or convolution state (a hybrid model), which a cache
        computes once over the cached positions."""
        return any(s.states for s in self.layers)

    @property
    def kv_layers(self) -> Tuple[int, ...]:
        """Indices of the layers that cache K/V rows (every layer but a hybrid model's state
        layers), in order: the layers statistics, codecs and sealed blocks are kept for."""
        return tuple(s.index for s in self.layers if s.has_kv)

    def require_rope(self) -> ModelRope:
        """The RoPE of every layer; UnsupportedModelError (naming the model type and the reason)
        when the keys' rotation cannot be removed and re-applied from the positions alone."""
        if self.rope is None:
            raise UnsupportedModelError(
                f"model type {self.model_type!r}: keys without RoPE are not available: {self.rope_error}")
        return self.rope

    def shape_groups(self) -> Tuple[Tuple[Tuple[int, ...], Tuple[int, int, int]], ...]:
        """Every K/V layer, grouped by ``(q_heads, kv_heads, head_dim)``: ``((layers, shape),
        ...)``, the :meth:`calibration_group` first (one group where the layers share a shape;
        Gemma 4: its full layers, then its sliding ones). Each group's statistics are stacked
        alike; UnsupportedModelError as :meth:`calibration_group`."""
        first = self.calibration_group()
        rest: Dict[Tuple[int, int, int], List[int]] = {}
        # Beside compressed attention (DeepSeek V4) sliding layers hold at most window - 1 rows:
        # they stay raw, no group of their own.
        compressed = any(s.kind == "compressed" for s in self.layers)
        for s in self.layers:
            if s.has_kv and s.index not in first[0] and not compressed:
                rest.setdefault((s.q_heads, s.kv_heads, s.head_dim), []).append(s.index)
        return (first,) + tuple((tuple(v), k) for k, v in rest.items())

    def calibration_group(self) -> Tuple[Tuple[int, ...], Tuple[int, int, int]]:
        """``(layers, (q_heads, kv_heads, head_dim))``: the K/V layers calibration statistics are
        stacked over (one shape) and their shape. Every K/V layer where they share one shape;
        where they do not (Gemma 4's full layers have another head_dim than its sliding ones),
        the layers of the full-attention layers' shape, provided every full-attention layer has
        it: the layers whose cache grows with the context. The other K/V layers (sliding, within
        their window) stay raw in a calibrated recipe's cache unless the calibration holds their
        group too (:meth:`shape_groups`; ``kakeyaturbo calibrate`` and ``eval`` collect every group).
        UnsupportedModelError when no such group exists."""
        kv = [s for s in self.layers if s.has_kv]
        shape = {s.index: (s.q_heads, s.kv_heads, s.head_dim) for s in kv}
        shapes = set(shape.values())
        if len(shapes) == 1:
            return tuple(shape), next(iter(shapes))
        full = {shape[s.index] for s in kv if not s.is_sliding}
        if len(full) == 1:
            want = next(iter(full))
            return tuple(i for i, sh in shape.items() if sh == want), want
        raise UnsupportedModelError(
            f"model type {self.model_type!r}: layers differ in heads or head_dim {sorted(shapes)} "
            "((q_heads, kv_heads, head_dim)), full-attention layers among them; calibration "
            "statistics need one shape (per-block recipes and the identity codec serve any)")


def text_config(model: Any) -> Any:
    """The decoder's config (the text config of a multimodal model)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers model (it has no config)")
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if callable(get) else cfg


def model_type(model: Any) -> str:
    """The ``model_type`` of the decoder's config (the family), else the class name."""
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg = text_config(model)
    return str(getattr(cfg, "model_type", None) or type(model).__name__)


def _refuse(mt: str, reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"model type {mt!r}: {reason}")


def _layer_types(cfg: Any, mt: str) -> Tuple[List[str], List[Dict[str, Any]]]:
    from transformers.cache_utils import get_layer_types_and_kwargs

    n = int(cfg.num_hidden_layers)
    try:
        types, kwargs = get_layer_types_and_kwargs(cfg)
    except Exception:  # configs without per-layer configs: one type for all
        window = getattr(cfg, "sliding_window", None)
        types = ["sliding_attention" if window else "full_attention"] * n
        kwargs = [{"sliding_window": window} if window else {} for _ in range(n)]
    types, kwargs = list(types)[:n], list(kwargs)[:n]
    if len(types) != n:
        raise _refuse(mt, f"{len(types)} layer types for {n} layers")
    return types, kwargs


def _check_kv(model: Any, cfg: Any, mt: str, types: List[str]) -> None:
    """Refuses what does not keep one standard K/V row per token and head."""
    if getattr(cfg, "is_encoder_decoder", False):
        raise _refuse(mt, "encoder-decoder models keep a cross-attention cache; only decoders are supported")
    bad = sorted(set(types) - set(KV_LAYER_TYPES) - set(STATE_LAYER_TYPES) - set(COMPRESSED_LAYER_TYPES))
    if bad:
        reasons = "; ".join(f"layer type {t!r}" for t in bad)
        raise _refuse(mt, f"not a standard K/V cache: {reasons}")
    shares = getattr(cfg, "num_kv_shared_layers", 0) or getattr(cfg, "kv_source_layers", None) is not None
    if shares and kv_sources(cfg) is None:  # (Gemma's num_kv_shared_layers, Kolibri 1.1's kv_source_layers)
        raise _refuse(mt, "layers share another layer's K/V cache, by no rule kakeyaturbo reads")
    loops = getattr(cfg, "n_recurrent_loops", None)
    if isinstance(loops, int) and loops > 1:
        raise _refuse(mt, f"layers run {loops} times per forward pass (Dory's recurrent loops): the later loops' "
                          "K/V go to cache layers appended past the config's ('per_loop') or are read from the "
                          "cache's tensors directly ('last_loop'), and one attention module serves every loop")
    own = _own_cache_class(model)
    if own is not None:
        raise _refuse(mt, f"its modeling code keeps a cache class of its own ({own}) and takes no other")
    if not any(t in KV_LAYER_TYPES + COMPRESSED_LAYER_TYPES for t in types):
        raise _refuse(mt, "no layer caches K/V rows (a recurrent or state-space model): nothing to compress")
    # "vision" (Gemma 4 Unified's default): image tokens attend both ways within a prompt, by the
    # model's mask; text is causal, and the cache holds rows as it does for Gemma 3's images.
    both_ways = getattr(cfg, "use_bidirectional_attention", False)
    if (both_ways and both_ways != "vision") or not getattr(cfg, "is_causal", True):
        raise _refuse(mt, "bidirectional attention: not a causal decoder")


def _own_cache_class(model: Any) -> Optional[str]:
    """The name of a ``Cache`` subclass the model's modeling module defines (MiniMax's, which its
    forward requires), or None."""
    from transformers.cache_utils import Cache

    mod = sys.modules.get(type(model).__module__)
    for name, obj in vars(mod or object()).items():
        if isinstance(obj, type) and issubclass(obj, Cache) and obj.__module__ == getattr(mod, "__name__", None):
            return name
    return None


def attention_modules_by_index(model: Any) -> Dict[int, List[Any]]:
    """Every attention module of a decoder (named ``*Attention`` or ``*MLA``, with a
    ``layer_idx``) by ``layer_idx``, in the order ``model.modules()`` gives them."""
    return modules_by_layer(model, ("layer_idx",))


def attention_modules(model: Any) -> Dict[int, Any]:
    """The attention module of a decoder by ``layer_idx`` (the first where several carry one)."""
    return {idx: mods[0] for idx, mods in attention_modules_by_index(model).items()}


def output_projection(module: Any, q_heads: int, head_dim: int) -> Any:
    """The linear map from the concatenated attention heads to the hidden state (``o_proj``,
    GPT-NeoX's ``dense``, ..., or the ``linear`` inside such a module: Inkling 2's gated output
    projection); its weight is ``[hidden, q_heads * head_dim]``."""
    for name in _OUTPUT_PROJECTIONS:
        lin = getattr(module, name, None)
        if lin is not None and getattr(lin, "weight", None) is None:  # a gated projection's own linear (Inkling 2)
            lin = getattr(lin, "linear", None)
        w = getattr(lin, "weight", None)
        if w is not None and w.ndim == 2 and w.shape[1] == q_heads * head_dim:
            return lin
    raise _refuse(getattr(getattr(module, "config", None), "model_type", type(module).__name__),
                  f"no output projection among {_OUTPUT_PROJECTIONS} of {type(module).__name__}")


def _rotary_module(model: Any) -> Any:
    base = getattr(model, "base_model", model)
    for owner in (base, getattr(base, "language_model", None), getattr(base, "text_model", None),  # Emu3's
                  getattr(model, "model", None), model):
        mod = getattr(owner, "rotary_emb", None) if owner is not None else None
        if mod is not None:
            return mod
        mod = getattr(owner, "pos_emb", None) if owner is not None else None  # LFM2-MoE's name
        if mod is not None and "Rotary" in type(mod).__name__:
            return mod
    return None


def _rotary_by_theta(model: Any, cfg: Any) -> Optional[List[Any]]:
    """Per layer, the rotary module of its own base frequency where the config sets one per layer
    (Granite SWA's ``layer_rope_theta``, one module per distinct non-zero theta in ``rotary_embs``;
    theta 0 is a layer without RoPE), None for a layer without RoPE or without such a module; None
    where the config sets no theta per layer (every layer uses :func:`_rotary_module`'s)."""
    thetas = getattr(cfg, "layer_rope_theta", None)
    if not isinstance(thetas, (list, tuple)):
        return None
    base = getattr(model, "base_model", model)
    mods = {}
    for mod in getattr(base, "rotary_embs", None) or ():
        params = getattr(getattr(mod, "config", None), "rope_parameters", None) or {}
        mods[params.get("rope_theta")] = mod
    return [mods.get(t) if t else None for t in thetas]


def rope_module(model: Any) -> Any:
    """The modeling module that defines the model's ``apply_rotary_pos_emb`` (its attention's,
    else the model's), or None."""
    mods = [type(m).__module__ for m in attention_modules(model).values()][:1] + [type(model).__module__]
    for name in mods:
        mod = sys.modules.get(name)
        if callable(getattr(mod, "apply_rotary_pos_emb", None)):
            return mod
    return None


def _apply_fn(model: Any) -> Any:
    """The modeling module's own ``apply_rotary_pos_emb`` (the oracle of the pairing)."""
    mod = rope_module(model)
    return None if mod is None else mod.apply_rotary_pos_emb


def _mentions_rotary(model: Any) -> bool:
    """Whether the modeling modules of the model or its attention define anything rotary."""
    names = {type(m).__module__ for m in attention_modules(model).values()} | {type(model).__module__}
    for name in names:
        mod = sys.modules.get(name)
        if mod is None or any("rotary" in a.lower() or "rope" in a.lower() for a in vars(mod)):
            return True
    return False


def _config_rotates(cfg: Any) -> bool:
    """Whether the config sets up a rotary embedding (``rope_parameters``, or an entry naming a
    rotary width as GPT-J's ``rotary_dim``). A modeling module may define
    ``apply_rotary_pos_emb`` without calling it (Jamba, Nemotron-H copy it in unused)."""
    if getattr(cfg, "position_embedding_type", "rope") not in ("rope", "rotary"):
        return False  # Granite 4 hybrids: rope parameters, but position_embedding_type None (NoPE)
    if getattr(cfg, "rope_parameters", None) is not None:
        return True
    to_dict = getattr(cfg, "to_dict", None)
    names = to_dict() if callable(to_dict) else vars(cfg)
    return any("rot" in k or "rope" in k for k in names)


#: Families whose attention applies RoPE on some layers only, by a test of the attention module's
#: own attributes, as their modeling code writes it (global layers without RoPE).
_ROPE_IF: Dict[str, Callable[[Any], bool]] = {
    "cohere2": lambda m: m.sliding_window is not None,
    "flint": lambda m: m.sliding_window is not None,
    "cohere2_moe": lambda m: m.sliding_window is not None or bool(m.force_rope),
    "exaone4": lambda m: m.sliding_window is None or bool(m.is_sliding),
    "exaone_moe": lambda m: m.sliding_window is None or bool(m.is_sliding),
    "kolibri1": lambda m: m.sliding_window is None or bool(m.is_sliding),
    "kolibri1_1": lambda m: bool(m.is_sliding),  # indexed-attention layers: NoPE
    "afmoe": lambda m: bool(m.is_local_attention),
    "lara_mini": lambda m: m.sliding_window is not None,
}


def _applies_rope(model: Any, mt: str) -> Dict[int, bool]:
    """Per layer index, whether its attention applies RoPE, for the families of :data:`_ROPE_IF`
    (empty for the others: every layer does, unless the config says otherwise)."""
    test = _ROPE_IF.get(mt)
    return {} if test is None else {i: bool(test(m)) for i, m in attention_modules(model).items()}


def _rope(model: Any, cfg: Any, types: List[str]) -> Tuple[Optional[ModelRope], Optional[str]]:
    if any(t in COMPRESSED_LAYER_TYPES for t in types):
        # DeepSeek V4: the entries' keys (their channels without RoPE) carry no rotation, their
        # rotated channels (the "values") are coded as cached, as multi-head latent attention's;
        # its sliding layers' few rows too, were a codec to code them (calibrations do not).
        return ModelRope([None] * len(types)), None
    if getattr(cfg, "alibi", False) is True:  # Falcon with ALiBi: a rotary module built, never applied
        return ModelRope([None] * len(types)), None
    module = _rotary_module(model)
    if module is None:
        # Positions by other means (GPT-2's learnt embeddings, a hybrid model's recurrent layers:
        # Jamba): keys carry no rotation.
        if not _mentions_rotary(model) or not _config_rotates(cfg):
            return ModelRope([None] * len(types)), None
        return None, "no rotary embedding module (model.model.rotary_emb) to recompute the rotation from"
    try:
        per_type = "layer_type" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        per_type = False
    rope_type = getattr(module, "rope_type", "default")
    uses = getattr(cfg, "no_rope_layers", None)  # SmolLM3: 1 = the layer applies RoPE
    applies = _applies_rope(model, model_type(model))
    apply_fn = _apply_fn(model)
    by_theta = _rotary_by_theta(model, cfg)
    # Layer types whose rope parameters the config sets to None apply no RoPE (Cohere Compass).
    params = getattr(cfg, "rope_parameters", None)
    nope_types = {t for t, p in params.items() if p is None and t in types} if isinstance(params, dict) else set()
    found: Dict[Tuple[Any, Optional[str], int], LayerRope] = {}
    layers: List[Optional[LayerRope]] = []
    for i, lt in enumerate(types):
        if lt not in KV_LAYER_TYPES or (isinstance(uses, (list, tuple)) and i < len(uses) and not uses[i]) \
                or not applies.get(i, True) or (by_theta is not None and not cfg.layer_rope_theta[i]) \
                or (per_type and lt in nope_types):
            layers.append(None)
            continue
        mod = module if by_theta is None else by_theta[i]
        if mod is None:
            return None, f"no rotary module (rotary_embs) for layer {i}'s rope theta {cfg.layer_rope_theta[i]}"
        key = lt if per_type else None
        rt = rope_type.get(lt) if isinstance(rope_type, dict) else rope_type
        if not isinstance(rt, str):
            return None, f"no rope type for layer type {lt!r}"
        # (longrope has two sets of factors: the cache records which a token got; dynamic ones are
        # the original frequencies below max_position_embeddings: LayerRope.static_until)
        if "dynamic" in rt and LayerRope(mod, key, "half").static_until is None:
            return None, (f"rope type {rt!r} recomputes its frequencies from the longest position of each "
                          "forward call, so the rotation a cached key received is not a function of its "
                          "position alone")
        d = layer_heads(cfg, i, model_type(model), lt)[2]
        if (id(mod), key, d) not in found:
            complex_fn = getattr(sys.modules.get(type(mod).__module__), "apply_rotary_emb", None)
            if apply_fn is not None:
                rope = detect_rope(apply_fn, mod, key, d)
            elif callable(complex_fn):  # Llama 4: its module gives complex rotations (freqs_cis)
                rope = detect_complex_rope(complex_fn, mod, key, d)
            else:
                return None, "no apply_rotary_pos_emb in its modeling module to check the pairing against"
            if rope is None:
                return None, ("its apply_rotary_pos_emb (apply_rotary_emb) pairs channels in a way kakeyaturbo "
                              "does not reproduce bit for bit (neither rotate_half nor interleaved)")
            found[(id(mod), key, d)] = rope
        layers.append(found[(id(mod), key, d)])
    return ModelRope(layers), None


def describe(model: Any) -> ModelLayout:
    """The :class:`ModelLayout` of a loaded transformers decoder.

    A hybrid model's layers without K/V rows (linear attention, state-space or convolution
    state, MLP-only blocks) are ``"state"`` layers: kept by the cache as transformers keeps them,
    never coded (:attr:`ModelLayout.kv_layers` lists the others).

    Multi-head latent attention is described as it caches (:attr:`ModelLayout.latent`: one
    latent row as keys, the rotated key part as values, one "head" each); the latent carries no
    RoPE, so codecs of keys without RoPE code it as cached.

    Raises UnsupportedModelError (an InvalidParameterError, so a ValueError) naming the model type
    and the reason when its K/V layers do not hold one K/V row per token and head
    (encoder-decoders, KV sharing by a rule it does not read, a modeling module
    that takes only its own cache class) or no layer holds K/V rows, and where its config says other
    layers or heads than its modules hold (:mod:`~kakeyaturbo.families.counts`). A RoPE that cannot be
    recomputed from positions alone (``dynamic`` without a known limit below which it is static,
    an unknown pairing) is not refused
    here but recorded in ``rope_error``: only codecs that code keys without RoPE need it
    (:meth:`ModelLayout.require_rope`).
    """
    cfg = text_config(model)
    mt = model_type(model)
    if not hasattr(cfg, "num_hidden_layers"):
        raise _refuse(mt, "no num_hidden_layers in its config: not a transformers decoder")
    layer_count(cfg, mt)  # a count past MAX_LAYERS is refused before any per-layer work
    types, kwargs = _layer_types(cfg, mt)
    _check_kv(model, cfg, mt, types)
    by = modules_by_layer(model)  # the layers and heads the model has, against what its config says
    check_layers(model, by, mt, len(types), [i for i, t in enumerate(types) if t not in STATE_LAYER_TYPES])
    shared = kv_sources(cfg) or {}
    # Multi-head latent attention: the latent and rotated widths of each layer (its per-layer
    # config's where the config has one: dots.llm3's sliding layers have widths of their own)
    widths = [(per_layer(cfg, i, "kv_lora_rank"), per_layer(cfg, i, "qk_rope_head_dim")) for i in range(len(types))]
    latent = any(r and dr for r, dr in widths)
    cross = cross_layers(cfg, mt, len(types))
    specs: List[LayerSpec] = []
    for i, (lt, kw) in enumerate(zip(types, kwargs)):
        if i in cross:  # attends over an image's rows (mllama), no RoPE, skipped by text-only forwards
            hq, hkv, d = layer_heads(cfg, i, mt, lt)
            specs.append(LayerSpec(i, "cross", None, hq, hkv, d, lt))
            continue
        if i in shared:  # attends over the K/V rows of an earlier layer of its type
            src = specs[shared[i]]
            hq, hkv, d = layer_heads(cfg, i, mt, lt)
            specs.append(LayerSpec(i, "shared", src.window, hq, hkv, d, lt, reads=src.index))
            continue
        if lt in STATE_LAYER_TYPES:
            specs.append(LayerSpec(i, "state", None, 0, 0, 0, lt, int(kw.get("number_of_states", 0))))
            continue
        if lt in COMPRESSED_LAYER_TYPES:  # the entries' channels without RoPE, then the rotated ones
            hq, hkv, d = layer_heads(cfg, i, mt, lt)
            dr = int(cfg.qk_rope_head_dim)
            specs.append(LayerSpec(i, "compressed", int(cfg.sliding_window), hq, hkv, d - dr, lt, v_dim=dr,
                                   rate=int(cfg.compress_rates[lt])))
            continue
        window = kw.get("sliding_window") if lt in _SLIDING_TYPES else None
        if lt in _SLIDING_TYPES and not (isinstance(window, int) and window >= 1):
            raise _refuse(mt, f"layer {i} is sliding-window or chunked attention without a window size")
        hq, hkv, d = layer_heads(cfg, i, mt, lt)
        kind = "chunked" if lt == "chunked_attention" else "sliding" if window else "full"
        if latent:  # one latent row (keys) and one rotated key row (values) per token
            specs.append(LayerSpec(i, kind, window, hq, 1, int(widths[i][0]), lt, v_dim=int(widths[i][1])))
            continue
        states = int(kw.get("number_of_states", 1)) if lt in STATEFUL_KV_TYPES else 0
        dv = per_layer(cfg, i, "v_head_dim")  # values of another width (MiMo-V2-Flash)
        specs.append(LayerSpec(i, kind, window, hq, hkv, d, lt, states,
                               v_dim=int(dv) if isinstance(dv, int) and dv != d else None))
    check_heads(by, mt, specs, latent)
    if latent:  # the latent keys carry no rotation: nothing to take off or put back
        return ModelLayout(mt, tuple(specs), ModelRope([None] * len(specs)), None, latent=True)
    rope, err = _rope(model, cfg, types)
    if rope is not None:  # a norm after RoPE whose weight comes off before it (HunYuan)
        rope, err = key_norms(mt, rope, attention_modules(model), {s.index: s.head_dim for s in specs})
    if rope is not None and cross:  # the image's keys carry no rotation
        rope = ModelRope([None if i in cross else rope.layer(i) for i in range(len(types))])
    if rope is not None and shared:  # a shared layer's keys carry its producer's RoPE
        rope = ModelRope([rope.layer(shared.get(i, i)) for i in range(len(types))])
    return ModelLayout(mt, tuple(specs), rope, err)


def rope_for(model: Any) -> ModelRope:
    """The :class:`~kakeyaturbo.families.rope.ModelRope` of a model's keys: ``describe(model)
    .require_rope()``. Raises UnsupportedModelError as :func:`describe` does, and when the
    keys' rotation is not a function of the position alone."""
    return describe(model).require_rope()
