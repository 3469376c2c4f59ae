"""Cache layers that hold more than a :class:`~kakeyaturbo.cache.layer.KakeyaLayer`'s K/V rows:
a recurrent or convolution state beside them (Falcon-H1, :class:`KakeyaStateLayer`), or the
keys of a dynamic-sparse-attention indexer (DeepSeek V3.2, :class:`KakeyaIndexedLayer`). What
they add is held as transformers holds it, uncompressed."""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional

import torch
from transformers.cache_utils import LinearAttentionLayer

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
        LinearAttentionLayer.reset(self)
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

    # The K/V rows first: their checks refuse bad arguments before either part changes.
    def crop(self, tokens_to_remove: int) -> None:
        KakeyaLayer.crop(self, tokens_to_remove)
        LinearAttentionLayer.crop(self, tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        KakeyaLayer.reorder_cache(self, beam_idx)
        LinearAttentionLayer.reorder_cache(self, beam_idx)

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
