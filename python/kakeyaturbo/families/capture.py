"""Seeing every attention layer of a model at work, family-agnostically: a function registered in
transformers' ``AttentionInterface`` receives each layer's queries, keys and values exactly as
the model hands them to attention (after any q/k norm and after RoPE; keys and values as the
cache holds them), lets a handler look at or replace them, and runs the model's own attention.

transformers looks the attention function up by name in the config at every call, so
:class:`AttentionCapture` registers one name (:data:`NAME`), points the model at it while open
and restores the model's own implementation on exit.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ..errors import UnsupportedModelError
from .layout import attention_modules_by_index, model_type

#: The implementation name the capture registers in transformers' attention interfaces.
NAME = "kakeyaturbo_capture"

#: ``handler(layer, module, query, key, value, mask, kwargs, attend) -> (output, weights)``:
#: ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]`` as the model passes them;
#: ``attend(query, key, value)`` runs the model's own attention (with the mask and keyword
#: arguments of this call) and returns ``(output, weights)``; ``weights`` are the attention
#: probabilities ``[B, Hq, T, T]`` when the capture was opened with ``weights=True``.
Handler = Callable[..., Tuple[Any, Any]]

_active: Optional["AttentionCapture"] = None


def _dispatch(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
              **kwargs: Any) -> Tuple[Any, Any]:
    cap = _active
    if cap is None:
        raise RuntimeError(f"attention implementation {NAME!r} called outside an AttentionCapture")
    return cap._call(module, query, key, value, attention_mask, kwargs)


def _eager(module: Any) -> Callable[..., Tuple[Any, Any]]:
    """The eager attention of the module's own modeling file (it honours softcapping, sinks and
    whatever else that family adds), else transformers' generic one."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if callable(fn):
        return fn
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


class AttentionCapture:
    """While open (``with AttentionCapture(model, handler): model(...)``), every attention layer
    of ``model`` calls ``handler`` (see :data:`Handler`).

    ``weights=True`` runs each layer's attention through its family's eager function (the only
    one that returns the probabilities); otherwise through the implementation the model was
    configured with (``sdpa``, ``eager``, ...), with that implementation's mask. On exit the
    model's implementation is restored, and :meth:`check` raises UnsupportedModelError when
    layers never called the handler (a model that does not route attention through the
    interface). A call whose query or key heads or head size are not those
    :func:`~kakeyaturbo.families.describe` read from the config (on entering; it raises
    UnsupportedModelError for a model it refuses) raises UnsupportedModelError before the
    handler sees it.
    """

    def __init__(self, model: Any, handler: Handler, *, weights: bool = False) -> None:
        self.model = model
        self.handler = handler
        self.weights = bool(weights)
        self.seen: Dict[int, Any] = {}
        self._shapes: Optional[Dict[int, Tuple[int, int, Optional[int]]]] = None
        self._orig: Optional[str] = None
        self._delegate: Dict[type, Callable[..., Tuple[Any, Any]]] = {}

    def __enter__(self) -> "AttentionCapture":
        global _active
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        if _active is not None:
            raise RuntimeError("an AttentionCapture is already open")
        if self._shapes is None:  # before any forward (describe runs the family's RoPE function)
            from .layout import describe

            layout = describe(self.model)
            by = attention_modules_by_index(self.model)
            twice = sorted(i for i, mods in by.items() if len(mods) > 1)
            if twice:
                raise UnsupportedModelError(
                    f"model type {layout.model_type!r}: attention modules share layer_idx {twice} (one "
                    "module run for several cache layers: HRM's looped stacks, Zamba 2's shared block): which "
                    "layer a call serves cannot be told, so statistics cannot be taken")
            unknown = [s.index for s in layout.layers if s.has_kv and s.index not in by]
            unnumbered = any(type(m).__name__.endswith("Attention") and getattr(m, "layer_idx", 0) is None
                             for m in self.model.modules())
            if unknown and unnumbered:
                raise UnsupportedModelError(
                    f"model type {layout.model_type!r}: no attention module carries the index of layers {unknown} "
                    "(Zamba's shared block is told its layer at each call): which layer a call serves cannot be "
                    "told, so statistics cannot be taken")
            # Multi-head latent attention hands attention keys expanded from the latent: a key
            # head per query head, of the query's size. Compressed attention (DeepSeek V4) hands
            # over whole rows (its spec splits the entries' width into keys and values).
            self._shapes = {s.index: (s.q_heads, s.q_heads, None) if layout.latent else
                            (s.q_heads, s.kv_heads, s.head_dim + (s.v_dim or 0) if s.kind == "compressed"
                             else s.head_dim) for s in layout.layers if s.attends}
        self._orig = self.model.config._attn_implementation
        orig = self._orig if self._orig in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "eager"
        mask = "eager" if self.weights else orig
        AttentionInterface.register(NAME, _dispatch)
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[mask])
        self._use_eager = self.weights or orig == "eager"
        _active = self
        try:
            self.model.set_attn_implementation(NAME)
        except Exception:
            _active = None
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        global _active
        _active = None
        if self._orig is not None:
            self.model.set_attn_implementation(self._orig)

    def _function(self, module: Any) -> Callable[..., Tuple[Any, Any]]:
        fn = self._delegate.get(type(module))
        if fn is None:
            if self._use_eager:
                fn = _eager(module)
            else:
                from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

                fn = ALL_ATTENTION_FUNCTIONS.get_interface(self._orig, _eager(module))
            self._delegate[type(module)] = fn
        return fn

    def _call(self, module: Any, query: Any, key: Any, value: Any, mask: Any,
              kwargs: Dict[str, Any]) -> Tuple[Any, Any]:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            # Attention over no cached rows (Inkling 2's block attention residuals): the model's
            # own, unchanged (a K/V layer that never comes here is refused by :meth:`check`).
            return self._function(module)(module, query, key, value, mask, **kwargs)
        self._check_shapes(layer, query, key)
        self.seen[layer] = module
        fn = self._function(module)
        mask, kwargs = sparse_mask(mask, kwargs, key.shape[2])

        def attend(q: Any, k: Any, v: Any) -> Tuple[Any, Any]:
            return fn(module, q, k, v, mask, **kwargs)

        return self.handler(layer, module, query, key, value, mask, kwargs, attend)

    def _check_shapes(self, layer: int, query: Any, key: Any) -> None:
        want = (self._shapes or {}).get(layer)
        if want is None:
            raise UnsupportedModelError(
                f"model type {model_type(self.model)!r}: an attention module with layer_idx {layer} ran, which is "
                "not an attention layer of the model's config (a block shared across layers, as Zamba's, "
                "attends for several layers by one index): its statistics cannot be told apart")
        got = (query.shape[1], key.shape[1], key.shape[-1]) if query.ndim == 4 and key.ndim == 4 else None
        if want[2] is None and got is not None:
            got = got[:2] + (None,) if key.shape[-1] == query.shape[-1] else got
        if got != want or (want[2] is not None and query.shape[-1] != want[2]):
            raise UnsupportedModelError(
                f"model type {model_type(self.model)!r}: layer {layer}'s attention receives queries "
                f"{tuple(query.shape)} and keys {tuple(key.shape)} ([batch, heads, rows, head_dim]), "
                f"but its config reads (query heads, kv-heads, head_dim) = {want}")

    def check(self, layers: Sequence[int]) -> None:
        """UnsupportedModelError unless every layer of ``layers`` (indices: the model's K/V
        layers, :attr:`~kakeyaturbo.families.ModelLayout.kv_layers`) called the handler."""
        missing = sorted(set(layers) - set(self.seen))
        if missing:
            raise UnsupportedModelError(
                f"model type {model_type(self.model)!r}: layers {missing} did not run their attention "
                "through transformers' AttentionInterface, so their queries, keys and values cannot be "
                "seen")


def sparse_mask(mask: Any, kwargs: Dict[str, Any], keys: int) -> Tuple[Any, Dict[str, Any]]:
    """Dynamic sparse attention (DeepSeek V3.2, GLM-5) hands attention functions other than
    eager and sdpa the keys each query may see as ``indices`` ``[batch, queries, top-k]``; the
    mask with them folded in, as the model does for eager and sdpa, and the rest of ``kwargs``."""
    import torch

    idx = kwargs.get("indices")
    if not isinstance(idx, torch.Tensor) or not isinstance(mask, torch.Tensor) or mask.ndim != 4:
        return mask, kwargs
    hidden = torch.ones((idx.shape[0], idx.shape[1], keys), dtype=torch.bool, device=idx.device)
    hidden = hidden.scatter(-1, idx.long(), False).unsqueeze(1)  # True: not selected
    if mask.dtype == torch.bool:
        mask = mask & ~hidden
    else:
        mask = mask.masked_fill(hidden, torch.finfo(mask.dtype).min)
    return mask, {k: v for k, v in kwargs.items() if k != "indices"}


def positions(kwargs: Dict[str, Any], batch: int, t: int) -> Any:
    """The RoPE positions ``[batch or 1, t]`` of a call's rows: the ``position_ids`` the model
    forwarded, else ``0 .. t-1`` (a forward without cache over a fresh sequence)."""
    import torch

    p = kwargs.get("position_ids")
    if isinstance(p, torch.Tensor) and p.ndim == 2 and p.shape[-1] == t:
        return p
    return torch.arange(t)[None]
