"""Cache layers that hold more than a :class:`~kakeyaturbo.cache.layer.KakeyaLayer`'s K/V rows:
a recurrent or convolution state beside them (Falcon-H1, :class:`KakeyaStateLayer`), or the
keys of a dynamic-sparse-attention indexer (DeepSeek V3.2, :class:`KakeyaIndexedLayer`). What
they add is held as transformers holds it, uncompressed."""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from .checks import selected_rows
from .layer import KakeyaLayer, _tensor_bytes


class KakeyaStateLayer(KakeyaLayer, LinearAttentionLayer):
    """A hybrid layer that holds K/V rows and a recurrent or convolution state together (Falcon-H1
    runs attention and a Mamba-2 mixer side by side in every layer; transformers' ``hybrid``
    layer type): the K/V rows as a :class:`KakeyaLayer` holds them, the states as transformers'
    ``LinearAttentionLayer`` does (uncompressed, fixed-size)."""

    def __init__(self, *args: Any, number_of_states: int = 1, **kwargs: Any) -> None:
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        KakeyaLayer.__init__(self, *args, **kwargs)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        # K/V rows come positionally from update(); states by keyword from update_conv_state() or
        # update_recurrent_state().
        if args:
            KakeyaLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        reset_linear(self)
        KakeyaLayer.reset(self)

    @property
    def is_croppable(self) -> bool:
        # transformers 5.25 made the linear layer's a class attribute (its states keep a history
        # while recording the past); 5.24's is a property.
        linear = inspect.getattr_static(LinearAttentionLayer, "is_croppable")
        return KakeyaLayer.is_croppable.fget(self) and bool(
            linear.fget(self) if isinstance(linear, property) else linear)

    def activate_past_recording(self, **kwargs: Any) -> None:
        KakeyaLayer.activate_past_recording(self, **kwargs)
        LinearAttentionLayer.activate_past_recording(self, **kwargs)

    def end_past_recording(self) -> None:
        KakeyaLayer.end_past_recording(self)
        end_linear_recording(self)

    # The K/V rows first: their checks (and crop_refusal, the states' too) refuse bad arguments
    # before either part changes.
    def crop(self, tokens_to_remove: int) -> None:
        KakeyaLayer.crop(self, tokens_to_remove)
        LinearAttentionLayer.crop(self, tokens_to_remove)

    def crop_refusal(self, r: int) -> Optional[str]:
        return KakeyaLayer.crop_refusal(self, r) or linear_crop_refusal(self, r, self.index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        KakeyaLayer.reorder_cache(self, beam_idx)
        LinearAttentionLayer.reorder_cache(self, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        KakeyaLayer.batch_repeat_interleave(self, repeats)
        select_states(self, "batch_repeat_interleave", repeats, self.index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        KakeyaLayer.batch_select_indices(self, indices)
        select_states(self, "batch_select_indices", indices, self.index)

    def get_max_length(self) -> int:
        return KakeyaLayer.get_max_length(self)


class KakeyaIndexedLayer(KakeyaLayer):
    """A layer of dynamic sparse attention (DeepSeek V3.2, GLM-5: transformers'
    ``indexed_attention``): its K/V rows as a :class:`KakeyaLayer` holds them, and the indexer's
    keys (``[batch, tokens, index_head_dim]``, which pick the rows each query attends to) raw,
    grown as transformers' ``DynamicIndexedLayer`` grows them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.indexer_keys: Optional[torch.Tensor] = None
        self.indexer_position_ids: Optional[torch.Tensor] = None
        self.is_indexer_initialized = False

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Appends ``[batch, q, index_head_dim]`` indexer keys; returns all of them."""
        if self.indexer_keys is None:
            self.indexer_keys = indexer_key_states[:, :0]
            self.is_indexer_initialized = True
        self.indexer_keys = torch.cat([self.indexer_keys, indexer_key_states], dim=1)
        return self.indexer_keys

    def reset(self) -> None:
        super().reset()
        self.indexer_keys = self.indexer_position_ids = None
        self.is_indexer_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if tokens_to_remove and self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :self.seen]

    def snapshot(self) -> Any:
        return super().snapshot(), self.indexer_keys, self.indexer_position_ids, self.is_indexer_initialized

    def restore(self, snap: Any) -> None:
        inner, self.indexer_keys, self.indexer_position_ids, self.is_indexer_initialized = snap
        super().restore(inner)

    def _select(self, idx: torch.Tensor) -> None:
        super()._select(idx)
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[idx.to(self.indexer_keys.device)]
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = self.indexer_position_ids[:, idx.to(self.indexer_position_ids.device)]

    def memory(self) -> Dict[str, int]:
        return dict(super().memory(), indexer=_tensor_bytes(self.indexer_keys))

    def nbytes_uncompressed(self) -> int:
        return super().nbytes_uncompressed() + _tensor_bytes(self.indexer_keys)


# transformers' linear layers (LinearAttentionLayer, and the states of a KakeyaStateLayer) as
# the cache drives them.


def reset_linear(layer: Any) -> None:
    """The states of ``layer`` as a fresh layer's: transformers' reset zeroes them in place,
    keeping their batch (a cache reused for another batch failed in the mixer, and then refused
    every call until a reset, which changed nothing) and their past recording (the convolution
    states went on growing by every token, the recurrent history by a copy per call)."""
    LinearAttentionCacheLayerMixin.__init__(layer, number_of_states=layer.number_of_states)
    for name in ("recurrent_states_history", "recurrent_states_to_keep"):
        layer.__dict__.pop(name, None)


def end_linear_recording(layer: Any) -> None:
    """Ends transformers' past recording in a layer of recurrent or convolution states, leaving
    it as a ``crop(0)`` would: each convolution state cut back to its kernel's width (it grows by
    every token recorded, and the next call that does not record copies into a state of that
    width: a RuntimeError of mismatched sizes), the recurrent states' history dropped (a copy
    per call)."""
    layer.record_past = False
    for i, k in layer.conv_kernel_size.items():
        t = layer.conv_states.get(i)
        if isinstance(t, torch.Tensor) and isinstance(k, int) and t.shape[-1] > k:
            layer.conv_states[i] = t[..., -k:].clone()
    history = getattr(layer, "recurrent_states_history", None)
    if isinstance(history, dict):
        layer.recurrent_states_history = {i: [] for i in history}


def linear_crop_refusal(layer: Any, r: int, index: int) -> Optional[str]:
    """Why the states of ``layer`` (layer ``index``) cannot drop their last ``r`` tokens, or
    None: they are cropped only while recording the past, and back to what they recorded
    (transformers' crop raised there after other layers were cropped, an IndexError past the
    recorded history)."""
    if not layer.record_past:
        return (f"layer {index} holds recurrent or convolution states, which are cropped only while "
                "recording the past (activate_past_recording() before the calls to undo)")
    history = getattr(layer, "recurrent_states_history", None) or {}
    for i in range(layer.number_of_states):
        conv, k = layer.conv_states.get(i), layer.conv_kernel_size.get(i)
        kept = [conv.shape[-1] - k] if isinstance(conv, torch.Tensor) and isinstance(k, int) else []
        if r and layer.is_recurrent_states_initialized[i]:
            kept.append(len(history.get(i) or ()))
        if kept and r > min(kept):
            return (f"layer {index} recorded the states of its last {min(kept)} tokens: it cannot "
                    f"remove {r}")
    return None


def select_states(layer: Any, op: str, arg: Any, index: int) -> None:
    """``batch_repeat_interleave(arg)`` or ``batch_select_indices(arg)`` (``op``) on the conv and
    recurrent states of ``layer``, layer ``index`` (transformers' linear layers have neither: an
    AttributeError, and a KakeyaStateLayer's states kept their batch while its rows changed)."""
    held = [t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if isinstance(t, torch.Tensor)]
    if not held:
        return
    batch = held[0].shape[0]
    rows = (torch.arange(batch).repeat_interleave(arg) if op == "batch_repeat_interleave"
            else selected_rows(arg, batch, index))
    for states in (layer.conv_states, layer.recurrent_states):
        for i, t in states.items():
            if isinstance(t, torch.Tensor):
                states[i] = t.index_select(0, rows.to(t.device))
