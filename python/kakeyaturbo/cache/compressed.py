"""Compressed attention in a :class:`~kakeyaturbo.cache.KakeyaCache` (DeepSeek V4's CSA and HCA
layers, :data:`~kakeyaturbo.families.layout.COMPRESSED_LAYER_TYPES`).

Such a layer holds a sliding window of K=V rows (one kv-head; the model reads one tensor as keys
and values) and, beside it, the entries its compressor emits: one per ``rate`` tokens (CSA: 4,
HCA: 128), each a softmax-gated sum of its window's projected rows, normalised and turned by RoPE
at the window's first position, read by attention as keys and values alike. The window is
bounded; the entries grow with the context, and they are what the cache codes.

The layer is the model's own cache layer class (its window, its compressor's buffers and, for
CSA, the overlap state and the lightning indexer's entries, all as transformers holds them) with
the compressor's entries taken over: :meth:`CompressedEntries.update_compressor_states` hands them
to a :class:`~kakeyaturbo.cache.layer.KakeyaLayer` of their own, split as multi-head latent
attention's rows are (:class:`~kakeyaturbo.families.LayerSpec` ``"compressed"``): the channels
without RoPE as its keys, the rotated channels (the last ``qk_rope_head_dim``) as its values,
each coded once (an entry is read as key and value alike). Its sink, sealed blocks and staging
hold them as any layer's rows: the first ``n_sink`` entries raw, every full block of
``block_size`` entries sealed (``block_size`` counts entries here: an HCA block of 512 entries
spans 65,536 tokens), the partial block raw. Attention reads them decoded (the slow path). The
indexer's entries stay raw (``memory()["indexer"]``); the window, the buffers and the overlap
state are fixed-size and count as ``memory()["state"]``.

A compressed layer cannot be cropped (the compressor emitted entries of the tokens a crop would
remove). A saved prefix holds its coded entries as a layer's rows and the rest as layer states
(:mod:`~kakeyaturbo.cache.persist_state`)."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from ..codec import _checks
from ..errors import InvalidInputError
from ..families.layout import COMPRESSOR
from .checks import batch_rows, selected_rows
from .codecs import StreamCodec
from .layer import KakeyaLayer, _tensor_bytes
from .rollback import crop_count

#: The model's cache-layer fields that hold per-name tensors, replaced (never changed in place)
#: by its methods: what a snapshot keeps and a batch selection selects.
_DICTS = ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate")


class CompressedEntries:
    """Mixed in before the model's cache layer of compressed attention (see the module)."""

    index: int
    entries: KakeyaLayer
    #: The entries' channels without RoPE (the first ``split``), coded as the keys.
    split: int

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """The model's window update, after the checks every cache layer makes (InvalidInputError,
        TypeError: nothing changes)."""
        _check_window_rows(self, key_states, value_states)
        return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[misc]

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """Appends ``[B, n, head_dim]`` entries of series ``name`` and returns all of them: the
        compressor's held by :attr:`entries` (earlier ones as stored, sealed blocks decoded; this
        call's exactly as given), the indexer's as the model's layer holds them."""
        if name != COMPRESSOR:
            return super().update_compressor_states(name, compressed)  # type: ignore[misc]
        n = compressed.shape[1] if compressed.ndim == 3 else -1
        if n < 0 or not compressed.is_floating_point():
            raise InvalidInputError(f"layer {self.index}: compressed entries must be floating-point "
                                    f"[B, n, D], got {compressed.dtype} {tuple(compressed.shape)}")
        if not n:
            if not self.entries.is_initialized:
                return compressed
            held = (self.entries.keys, self.entries.values)
        else:
            rows = compressed.unsqueeze(1)  # one "kv-head"
            held = self.entries.update(rows[..., :self.split], rows[..., self.split:])
            self.entry_count[name] += n  # type: ignore[attr-defined]
        return torch.cat(held, dim=-1)[:, 0]  # type: ignore[arg-type]

    # --- what transformers' layer API asks beyond the model's class -----------------------------

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
        self.entries.reset()

    @property
    def is_croppable(self) -> bool:
        return False

    def crop_refusal(self, r: int) -> Optional[str]:
        """Why removing the last ``r`` tokens cannot be done, or None (see the module)."""
        if r and self.get_seq_length():  # type: ignore[attr-defined]
            return (f"layer {self.index} is compressed attention (DeepSeek V4): its compressor emitted entries "
                    "of the tokens a crop would remove; it cannot be cropped")
        return None

    def crop(self, tokens_to_remove: int) -> None:
        refusal = self.crop_refusal(crop_count(tokens_to_remove))
        if refusal is not None:
            raise RuntimeError(refusal)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:  # type: ignore[attr-defined]
            self._select(batch_rows(beam_idx, self._batch(), self.index))

    def batch_repeat_interleave(self, repeats: int) -> None:
        repeats = _checks.integer(repeats, "repeats", 1)
        if self.is_initialized:  # type: ignore[attr-defined]
            self._select(torch.arange(self._batch()).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:  # type: ignore[attr-defined]
            self._select(selected_rows(indices, self._batch(), self.index))

    def offload(self) -> None:
        raise NotImplementedError("KakeyaCache does not offload")

    prefetch = offload

    # --- a refused forward call is rolled back (KakeyaCache._roll_back) --------------------------

    def snapshot(self) -> Any:
        """What :meth:`restore` puts back, by reference (the model's methods replace tensors and
        dicts' values, they never change them in place)."""
        if not self.is_initialized:  # type: ignore[attr-defined]
            return None
        dicts = {f: dict(getattr(self, f)) for f in _DICTS if hasattr(self, f)}
        return (self.keys, self.cumulative_length, dict(self.entry_count),  # type: ignore[attr-defined]
                dicts, self.entries.snapshot())

    def restore(self, snap: Any) -> None:
        if snap is None:
            self.reset()
            return
        keys, self.cumulative_length, counts, dicts, entries = snap
        self.keys = self.values = keys
        self.entry_count = dict(counts)
        for f, d in dicts.items():
            setattr(self, f, dict(d))
        self.entries.restore(entries)

    # --- accounting ---------------------------------------------------------------------------

    def memory(self) -> Dict[str, int]:
        """Bytes held, by kind: the entries' ``blobs``, ``sink``, ``staging`` and ``decoded`` (as a
        :class:`KakeyaLayer` counts its keys), the indexer's entries raw (``indexer``), and the
        fixed-size rest (``state``: the window's K=V rows, counted once, the compressor's
        buffers and the overlap state)."""
        out = dict(self.entries.memory())
        out["indexer"] = _tensor_bytes(self.compressed_kv.get("indexer"))  # type: ignore[attr-defined]
        out["state"] = self._fixed_bytes()
        return out

    def nbytes_uncompressed(self) -> int:
        """What the model's own layer would hold for the same tokens: the fixed-size part and
        every compressed entry raw, at their dtypes."""
        held = 0
        if self.entries.is_initialized:
            k, v = self.entries.raw_rows()[2:]  # staging rows [B, 1, n, width]
            held = k.shape[0] * self.entries.seen * (k.shape[3] + v.shape[3]) * k.element_size()
        indexer = _tensor_bytes(self.compressed_kv.get("indexer"))  # type: ignore[attr-defined]
        return self._fixed_bytes() + held + indexer

    # --- internals --------------------------------------------------------------------------

    def _fixed_bytes(self) -> int:
        if not self.is_initialized:  # type: ignore[attr-defined]
            return 0
        out = _tensor_bytes(self.keys)  # type: ignore[attr-defined]
        for f in ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
            out += sum(_tensor_bytes(t) for t in getattr(self, f, {}).values())
        return out

    def _batch(self) -> int:
        return int(self.keys.shape[0])  # type: ignore[attr-defined]

    def _select(self, idx: torch.Tensor) -> None:
        self.entries._select(idx)
        self.keys = self.values = self.keys.index_select(0, idx.to(self.keys.device))  # type: ignore[attr-defined]
        for f in _DICTS:
            d = getattr(self, f, None)
            for name, t in (d or {}).items():
                if t is not None:
                    d[name] = t.index_select(0, idx.to(t.device))


def rows_of(layer: Any) -> Any:
    """What holds a cache layer's K/V rows: the layer, or DeepSeek V4's coded entries."""
    return layer.entries if isinstance(layer, CompressedEntries) else layer


def _check_window_rows(layer: Any, key_states: Any, value_states: Any) -> None:
    """The rows of a compressed layer's window: floating-point ``[B, 1, q, D]``, the same tensor
    as keys and values (K=V), finite, of the batch and width held."""
    if not isinstance(key_states, torch.Tensor) or not key_states.is_floating_point():
        raise TypeError(f"key_states must be a floating-point torch tensor, got "
                        f"{getattr(key_states, 'dtype', type(key_states).__name__)}")
    if key_states.ndim != 4 or key_states.shape[1] != 1:
        raise InvalidInputError(f"layer {layer.index}: compressed attention's rows must be [B, 1, q, D], got "
                                f"shape {tuple(key_states.shape)}")
    if value_states is not key_states and not (isinstance(value_states, torch.Tensor)
                                               and value_states.shape == key_states.shape
                                               and torch.equal(value_states, key_states)):
        raise InvalidInputError(f"layer {layer.index}: compressed attention reads one tensor as keys and values")
    if layer.is_initialized:
        held = layer.keys.shape
        if (key_states.shape[0], key_states.shape[3]) != (held[0], held[3]):
            raise InvalidInputError(f"layer {layer.index}: rows of shape {tuple(key_states.shape)} for a layer "
                                    f"holding [B={held[0]}, 1, D={held[3]}]")
    if key_states.device.type == "cpu" and not math.isfinite(float(key_states.sum())) \
            and not bool(torch.isfinite(key_states).all()):
        raise InvalidInputError(f"layer {layer.index}: rows hold NaN or infinite values; the cache is unchanged")


_CLASSES: Dict[type, type] = {}


def compressed_layer(base: type, config: Any, index: int, codec: StreamCodec, *, split: int, block_size: int,
                     n_sink: int, streams: Sequence[str], keep_decoded: bool) -> Any:
    """A cache layer of compressed attention: the model's own class ``base`` (from transformers'
    ``DYNAMIC_LAYER_TYPE_MAPPING``, built with the model's ``config``) with its compressor's
    entries coded through ``codec``, the first ``split`` channels as keys, the rest as values,
    the streams in ``streams`` (none: a boundary layer's entries stay raw)."""
    cls = _CLASSES.get(base)
    if cls is None:
        # ``_layer_type`` None: transformers registers a layer class that names one as the layer of
        # that type for every DynamicCache.
        cls = _CLASSES[base] = type(f"Kakeya{base.__name__}", (CompressedEntries, base), {
            "__doc__": f"{base.__name__} whose compressor's entries a KakeyaCache codes "
                       "(kakeyaturbo.cache.compressed).", "_layer_type": None})
    layer = cls(config)
    layer.index = index
    layer.split = split
    layer.entries = KakeyaLayer(index, codec, block_size=block_size, n_sink=n_sink, streams=streams,
                                keep_decoded=keep_decoded)
    return layer
