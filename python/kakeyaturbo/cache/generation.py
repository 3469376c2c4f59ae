"""The generation cache: a transformers ``Cache`` whose full blocks are sealed through a codec
and held as bytes (:class:`KakeyaCache`, one :class:`KakeyaLayer` per attention layer)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..codec import _checks
from ..errors import InvalidParameterError
from ..recipes import Recipe
from .codecs import (STREAMS, BlockCodec, StreamCodec, boundary_layers, check_streams, decode_rows,
                     encode_rows, to_numpy, wants_rope)
from .rope import RopeFn, apply_rope, rope_for, unapply_rope


def _position_ids(kwargs: Dict[str, Any], q: int) -> Optional[torch.Tensor]:
    """``position_ids`` ``[1 or batch, q]`` as the attention module forwards them to ``update``
    (Llama and Qwen2 pass ``kwargs=kwargs``), or None."""
    for d in (kwargs, kwargs.get("kwargs"), kwargs.get("cache_kwargs")):
        if isinstance(d, dict):
            p = d.get("position_ids")
            if isinstance(p, torch.Tensor) and p.ndim == 2 and p.shape[-1] == q:
                return p
    return None


class _Positions:
    """The RoPE position of every cached token, ``int32 [batch, T]``, shared by all layers (only
    kept when the codec codes keys without RoPE)."""

    def __init__(self) -> None:
        self.pos: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 0 if self.pos is None else self.pos.shape[1]

    def record(self, start: int, q: int, batch: int, position_ids: Optional[torch.Tensor]) -> None:
        """Tokens ``start .. start+q`` of a layer's update; the first layer to see them records them."""
        have = len(self)
        if start + q <= have:
            return
        if start != have:
            raise RuntimeError(f"positions recorded up to {have}, a layer appends at {start}")
        if position_ids is None:
            new = torch.arange(start, start + q, dtype=torch.int32)[None].expand(batch, q)
        else:
            new = position_ids.detach().to("cpu", torch.int32).expand(batch, q)
        self.pos = new.clone() if self.pos is None else torch.cat([self.pos, new], dim=1)

    def get(self, start: int, n: int) -> torch.Tensor:
        assert self.pos is not None and start + n <= len(self)
        return self.pos[:, start:start + n]

    def nbytes(self) -> int:
        return 0 if self.pos is None else self.pos.numel() * self.pos.element_size()

    def select(self, idx: torch.Tensor) -> None:
        if self.pos is not None:
            self.pos = self.pos.index_select(0, idx.to("cpu"))

    def crop(self, length: int) -> None:
        if self.pos is not None:
            self.pos = self.pos[:, :length].clone()

    def reset(self) -> None:
        self.pos = None


class _Stream:
    """One stream (K or V) of one layer: ``sink`` and ``staging`` rows ``[B, H, n, D]`` in the
    storage dtype, and sealed blocks as blobs ``[block][batch][head]``."""

    def __init__(self, like: torch.Tensor) -> None:
        empty = like[..., :0, :].detach()
        self.sink = empty.clone()
        self.staging = empty.clone()
        self.blocks: List[List[List[bytes]]] = []
        self.decoded: List[torch.Tensor] = []  # keep_decoded only, one per block

    def length(self, block_size: int) -> int:
        return self.sink.shape[-2] + len(self.blocks) * block_size + self.staging.shape[-2]


class KakeyaLayer(CacheLayerMixin):
    """One attention layer of a :class:`KakeyaCache`.

    Tokens ``0 .. n_sink-1`` stay raw (the sink); after them every full block of
    ``block_size`` tokens of a compressed stream is sealed: coded per batch row and kv-head into
    one blob each and held only as bytes; the partial block stays raw (staging). A stream not
    in ``streams`` (and every stream of a boundary layer) is never sealed.
    """

    is_sliding = False
    # Cropping into a sealed block reads it back through the codec, so a rollback past a block
    # boundary is not exact for a lossy codec.
    is_croppable = False
    is_compileable = False

    def __init__(self, index: int, codec: StreamCodec, *, block_size: int, n_sink: int,
                 streams: Sequence[str], rope: Optional[RopeFn] = None,
                 positions: Optional[_Positions] = None, keep_decoded: bool = False) -> None:
        # CacheLayerMixin.__init__ is not called: it assigns self.keys / self.values, which are
        # read-only views here (the layer never holds its full K/V as tensors).
        self.is_initialized = False
        self.index = index
        self.codec = codec
        self.block_size = block_size
        self.n_sink = n_sink
        self.streams = tuple(streams)
        self.keep_decoded = keep_decoded
        self.pre_rope = wants_rope(codec, self.streams)
        if self.pre_rope and (rope is None or positions is None):
            raise InvalidParameterError(f"{codec!r} codes keys without RoPE: the layer needs rope and positions")
        self.rope = rope
        self.positions = positions
        self._s: Dict[str, _Stream] = {}

    def __repr__(self) -> str:
        return (f"KakeyaLayer({self.index}, streams={self.streams}, seq={self.get_seq_length()}, "
                f"sealed={len(self._s['k'].blocks)})")

    # --- transformers' layer API ------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._s = {"k": _Stream(key_states), "v": _Stream(value_states)}
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Appends ``[B, H, q, D]`` keys and values; returns the layer's full K and V.

        The tokens of this call come back exactly as given (they attend to each other at full
        precision, as in a serving engine's current chunk); tokens of earlier calls come back
        as stored: sink and staging raw, sealed blocks decoded.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        q = key_states.shape[-2]
        if self.positions is not None:
            self.positions.record(start, q, key_states.shape[0], _position_ids(kwargs, q))
        out_k = torch.cat(self._parts("k") + [key_states], dim=-2)
        out_v = torch.cat(self._parts("v") + [value_states], dim=-2)
        for name, x in (("k", key_states), ("v", value_states)):
            self._append(name, x.detach())
        return out_k, out_v

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self._s["k"].length(self.block_size)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._s = {}
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last ``-tokens_to_remove`` tokens (a non-positive count, as in transformers).

        Inside staging this is exact; reaching into a sealed block decodes it back into staging
        (lossy for a lossy codec)."""
        if tokens_to_remove > 0:
            raise InvalidParameterError(f"crop takes a non-positive count of tokens to remove, got {tokens_to_remove}")
        r = -tokens_to_remove
        if r == 0 or not self.is_initialized:
            return
        for name in STREAMS:
            st = self._s[name]
            while r > st.staging.shape[-2] and st.blocks:
                dec = self._block(name, len(st.blocks) - 1)
                st.blocks.pop()
                if st.decoded:
                    st.decoded.pop()
                st.staging = torch.cat([dec, st.staging], dim=-2)
            keep = st.staging.shape[-2] - r
            if keep >= 0:
                st.staging = st.staging[..., :keep, :].clone()
            else:
                st.staging = st.staging[..., :0, :].clone()
                st.sink = st.sink[..., :max(st.sink.shape[-2] + keep, 0), :].clone()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self._batch()).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(torch.arange(self._batch())[indices.to("cpu")])

    def offload(self) -> None:
        """Not supported: sealed blocks are host bytes already."""
        raise NotImplementedError("KakeyaCache does not offload")

    prefetch = offload

    # --- views and accounting ---------------------------------------------------------------

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """The full keys ``[B, H, T, D]`` as attention reads them (sealed blocks decoded)."""
        return self._full("k") if self.is_initialized else None

    @property
    def values(self) -> Optional[torch.Tensor]:
        """The full values ``[B, H, T, D]`` as attention reads them (sealed blocks decoded)."""
        return self._full("v") if self.is_initialized else None

    def num_sealed(self) -> int:
        """Sealed blocks of the first compressed stream (0 for a boundary layer)."""
        return max((len(st.blocks) for st in self._s.values()), default=0)

    def memory(self) -> Dict[str, int]:
        """Bytes held, by kind: ``blobs``, ``sink``, ``staging``, ``decoded`` (keep_decoded)."""
        out = {"blobs": 0, "sink": 0, "staging": 0, "decoded": 0}
        if not self.is_initialized:
            return out
        for st in self._s.values():
            out["blobs"] += sum(len(b) for blk in st.blocks for row in blk for b in row)
            out["sink"] += _tensor_bytes(st.sink)
            out["staging"] += _tensor_bytes(st.staging)
            out["decoded"] += sum(_tensor_bytes(t) for t in st.decoded)
        return out

    def nbytes_uncompressed(self) -> int:
        """What a ``DynamicLayer`` would hold for the same tokens, at the storage dtype."""
        if not self.is_initialized:
            return 0
        n = self.get_seq_length()
        total = 0
        for st in self._s.values():
            b, h, _, d = st.staging.shape
            total += b * h * n * d * st.staging.element_size()
        return total

    # --- internals --------------------------------------------------------------------------

    def _batch(self) -> int:
        return self._s["k"].staging.shape[0]

    def _select(self, idx: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        rows = idx.to("cpu").tolist()
        for st in self._s.values():
            dev = st.staging.device
            st.sink = st.sink.index_select(0, idx.to(dev))
            st.staging = st.staging.index_select(0, idx.to(dev))
            # Sealed blocks move as bytes: no re-coding, so beam search stays exact.
            st.blocks = [[blk[b] for b in rows] for blk in st.blocks]
            st.decoded = [t.index_select(0, idx.to(t.device)) for t in st.decoded]

    def _append(self, name: str, x: torch.Tensor) -> None:
        st = self._s[name]
        if name in self.streams:
            room = self.n_sink - st.sink.shape[-2]
            if room > 0 and not st.blocks and st.staging.shape[-2] == 0:
                st.sink = torch.cat([st.sink, x[..., :room, :]], dim=-2)
                x = x[..., room:, :]
        st.staging = torch.cat([st.staging, x], dim=-2)
        if name in self.streams:
            while st.staging.shape[-2] >= self.block_size:
                self._seal(name)

    def _block_start(self, name: str, j: int) -> int:
        return self._s[name].sink.shape[-2] + j * self.block_size

    def _rope(self, start: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B or 1, 1, block_size, rot]`` (float32) of the block starting at ``start``."""
        cos, sin = self.rope(self.positions.get(start, self.block_size))
        return cos.float().to(self.device)[:, None], sin.float().to(self.device)[:, None]

    def _seal(self, name: str) -> None:
        st = self._s[name]
        j = len(st.blocks)
        rows = st.staging[..., :self.block_size, :]
        st.staging = st.staging[..., self.block_size:, :].clone()
        if name == "k" and self.pre_rope:
            rows = unapply_rope(rows, *self._rope(self._block_start(name, j)))
        st.blocks.append(encode_rows(self.codec, name, self.index, to_numpy(rows)))
        if self.keep_decoded:
            st.decoded.append(self._block(name, j))

    def _block(self, name: str, j: int) -> torch.Tensor:
        """Sealed block ``j`` decoded: ``[B, H, block_size, D]`` in the storage dtype."""
        st = self._s[name]
        if j < len(st.decoded):
            return st.decoded[j]
        ref = st.staging
        y = torch.from_numpy(
            decode_rows(self.codec, name, self.index, st.blocks[j], self.block_size, ref.shape[-1])
        ).to(self.device)
        if name == "k" and self.pre_rope:
            y = apply_rope(y, *self._rope(self._block_start(name, j)))
        return y.to(ref.dtype)

    def _parts(self, name: str) -> List[torch.Tensor]:
        st = self._s[name]
        return [st.sink] + [self._block(name, j) for j in range(len(st.blocks))] + [st.staging]

    def _full(self, name: str) -> torch.Tensor:
        return torch.cat(self._parts(name), dim=-2)


def _tensor_bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class KakeyaCache(Cache):
    """A transformers ``Cache`` whose full blocks are held as codec bytes.

    ``model.generate(ids, cache=KakeyaCache(codec, model=model))`` (``past_key_values=`` before
    transformers 5.24). Per layer: the first ``n_sink`` tokens stay raw; then every full block
    of ``block_size`` tokens of each stream in ``streams`` is sealed through ``codec`` (one blob
    per batch row and kv-head) and held only as bytes; the last partial block stays raw
    (staging); ``boundary`` layers (negative indices count from the last layer) are never
    sealed. Attention reads sealed blocks by decoding them at every step; ``keep_decoded=True``
    keeps the decoded tensors instead, trading memory back for speed (they count in
    :meth:`nbytes`). Raw rows keep the dtype the model hands over.

    ``model`` gives the number of layers (for negative boundary indices), checks that every
    layer is full attention, and gives RoPE (:func:`kakeyaturbo.cache.rope.rope_for`) when
    ``codec.pre_rope_keys``; without a model pass ``num_layers`` / ``rope``. RoPE positions are
    the ``position_ids`` the attention forwards to the cache (so left-padded batches are right),
    else the token index.

    Raises InvalidParameterError (a ValueError) on a bad setting, a non-full-attention model, or a codec that needs RoPE
    without ``model`` or ``rope``.
    """

    def __init__(self, codec: StreamCodec, *, model: Any = None, num_layers: Optional[int] = None,
                 block_size: int = 512, n_sink: int = 0, boundary: Sequence[int] = (),
                 streams: Sequence[str] = STREAMS, rope: Optional[RopeFn] = None,
                 keep_decoded: bool = False) -> None:
        block_size = _checks.integer(block_size, "block_size", 1)
        n_sink = _checks.integer(n_sink, "n_sink", 0)
        for attr in ("encode", "decode"):
            if not callable(getattr(codec, attr, None)):
                raise TypeError(f"codec must implement StreamCodec ({attr} missing): {codec!r}")
        if model is not None:
            cfg = model.config.get_text_config(decoder=True)
            n = int(cfg.num_hidden_layers)
            if num_layers is not None and num_layers != n:
                raise InvalidParameterError(f"num_layers={num_layers} but the model has {n} layers")
            num_layers = n
            kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
            if kinds != {"full_attention"}:
                raise InvalidParameterError(
                    f"KakeyaCache supports full-attention layers only, the model has {sorted(kinds)}")
        self.codec = codec
        self.block_size = block_size
        self.n_sink = n_sink
        self.streams = check_streams(streams)
        self.boundary = boundary_layers(boundary, num_layers)
        self.keep_decoded = bool(keep_decoded)
        self._positions: Optional[_Positions] = None
        if wants_rope(codec, self.streams):
            if rope is None:
                if model is None:
                    raise InvalidParameterError(f"{codec!r} codes keys without RoPE: pass model= or rope=")
                rope = rope_for(model)
            self._positions = _Positions()
        self.rope = rope
        layers = [self._new_layer(i) for i in range(num_layers or 0)]
        super().__init__(layers=layers)

    @classmethod
    def from_recipe(cls, recipe: Recipe, *, model: Any = None, pre_rope_keys: bool = False,
                    threads: Optional[int] = None, **kwargs: Any) -> "KakeyaCache":
        """A cache with :class:`BlockCodec` of ``recipe`` and the recipe's ``n_sink``,
        ``boundary_layers`` and ``streams``; other keyword arguments as in the constructor."""
        kwargs.setdefault("n_sink", recipe.n_sink)
        kwargs.setdefault("boundary", recipe.boundary_layers)
        kwargs.setdefault("streams", recipe.streams)
        return cls(BlockCodec(recipe, pre_rope_keys=pre_rope_keys, threads=threads), model=model, **kwargs)

    def _new_layer(self, i: int) -> KakeyaLayer:
        return KakeyaLayer(i, self.codec, block_size=self.block_size, n_sink=self.n_sink,
                           streams=() if i in self.boundary else self.streams, rope=self.rope,
                           positions=self._positions, keep_decoded=self.keep_decoded)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:
            self.layers.append(self._new_layer(len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    # The position store is shared by the layers, so the batch and length operations that
    # transformers applies layer by layer apply to it once here.

    def reset(self) -> None:
        super().reset()
        if self._positions is not None:
            self._positions.reset()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self._positions is not None:
            self._positions.crop(self.get_seq_length())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self._positions is not None:
            self._positions.select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._positions is not None and self._positions.pos is not None:
            self._positions.select(torch.arange(self._positions.pos.shape[0]).repeat_interleave(repeats))
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._positions is not None and self._positions.pos is not None:
            self._positions.select(torch.arange(self._positions.pos.shape[0])[indices.to("cpu")])
        super().batch_select_indices(indices)

    # --- accounting ---------------------------------------------------------------------------

    def memory(self) -> Dict[str, int]:
        """Bytes held, by kind: ``blobs`` (sealed blocks), ``sink``, ``staging``, ``decoded``
        (only with keep_decoded) and ``positions`` (int32 per token and batch row, only when
        the codec codes keys without RoPE)."""
        out = {"blobs": 0, "sink": 0, "staging": 0, "decoded": 0}
        for layer in self.layers:
            for key, n in layer.memory().items():
                out[key] += n
        out["positions"] = self._positions.nbytes() if self._positions is not None else 0
        return out

    def nbytes(self) -> int:
        """Bytes this cache holds: compressed blobs + raw sink and staging rows at their dtype
        (+ decoded blocks with keep_decoded, + positions for pre-RoPE codecs)."""
        return sum(self.memory().values())

    def nbytes_uncompressed(self) -> int:
        """Bytes a ``DynamicCache`` would hold for the same tokens at the same dtype."""
        return sum(layer.nbytes_uncompressed() for layer in self.layers)
