"""One attention layer of the generation cache (:class:`KakeyaLayer`): sink rows, sealed blocks
held as codec bytes and raw staging rows, for a full-attention or a sliding-window layer."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from .._extras import missing
from ..codec.attention import LayerCodes
from ..codec import _checks
from ..errors import InvalidParameterError
from ..families.rope import LayerRope, over_heads
from .checks import batch_rows, check_rows, selected_rows
from .codecs import (STREAMS, StreamCodec, decode_blocks, decode_blocks_into, decode_rows, encode_blocks, to_numpy,
                     wants_rope)
from . import fast as fast_mod
from .fast import TAG, SealedCodes, rope_table
from .padding import first_real, sink_in_place, sink_unpadded
from .positions import Positions, position_ids
from .rollback import Rollback

_HAS_TRITON = not missing(("triton",))
_CPU = torch.device("cpu")


class _Stream:
    """One stream (K or V) of one layer: ``sink`` rows, sealed ``blocks`` (blobs
    ``[batch][head]``, each starting at the token position in ``starts``) and ``staging`` rows
    from ``staging_start``; raw rows are ``[B, H, n, D]`` in the storage dtype. The sink holds
    positions ``sink_start ..`` (``< n_sink``), except where ``sink_at`` is set: batch row ``b``'s
    sink then holds its first real tokens, positions ``sink_at[b] ..`` (a left-padded batch, whose
    first positions are padding; :mod:`.padding`)."""

    def __init__(self, like: torch.Tensor) -> None:
        empty = like[..., :0, :].detach()
        self.sink = empty.clone()
        self.sink_start = 0
        self.sink_at: Optional[List[int]] = None
        self.staging = empty.clone()
        self.staging_start = 0
        self.blocks: List[List[List[bytes]]] = []
        self.starts: List[int] = []
        self.decoded: List[torch.Tensor] = []  # keep_decoded only, one per block

    def first(self) -> int:
        """The position of the first row held."""
        if self.sink.shape[-2]:
            return self.sink_start
        return self.starts[0] if self.starts else self.staging_start


class KakeyaLayer(Rollback, CacheLayerMixin):
    """One attention layer of a :class:`~kakeyaturbo.cache.KakeyaCache`.

    Tokens ``0 .. n_sink-1`` stay raw (the sink); after them every full block of ``block_size``
    tokens of a compressed stream is sealed: coded per batch row and kv-head into one blob each
    and held only as bytes; the partial block stays raw (staging). A stream not in ``streams``
    (and every stream of a boundary layer) is never sealed. In a left-padded batch a row's
    first ``n_sink`` real tokens stay raw instead of its padding (:mod:`.padding`): the sink
    holds them, attention reads them from there and not their coded copies in the blocks.

    ``fast`` (set by the cache when the codec, the layer and the model allow it; see
    :mod:`kakeyaturbo.cache.fast`): ``update`` stages the call's rows and returns them alone,
    tagged with the layer; the attention function then computes over the layer's
    :class:`~kakeyaturbo.LayerCodes` (built from the sealed blobs, which it shares: the bytes
    are held once), the raw sink and staging rows, and seals what filled (:meth:`settle`).
    The sealed blobs (``blocks``, ``starts`` of each stream) stay the source of truth.

    ``window`` (a sliding-window layer: a query at position ``p`` sees keys ``p - window + 1 ..
    p``): the layer behaves as transformers' ``DynamicSlidingWindowLayer`` towards attention
    (``update`` returns the last ``window - 1`` tokens before the call plus the call's tokens,
    ``get_mask_sizes`` says so, ``get_seq_length`` counts every token seen) and keeps only what
    the window still needs: sink rows and sealed blocks that fell out of it are dropped, and rows
    that leave the window before a block fills are never coded.
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, index: int, codec: StreamCodec, *, block_size: int, n_sink: int,
                 streams: Sequence[str], rope: Optional[LayerRope] = None,
                 positions: Optional[Positions] = None, keep_decoded: bool = False,
                 window: Optional[int] = None) -> None:
        # CacheLayerMixin.__init__ is not called: it assigns self.keys / self.values, which are
        # read-only views here (the layer never holds its full K/V as tensors).
        self.is_initialized = False
        self.index = index
        self.codec = codec
        self.block_size = block_size
        self.n_sink = n_sink
        self.streams = tuple(streams)
        self.keep_decoded = keep_decoded
        self.window = window
        self.is_sliding = window is not None
        # A layer that applies no RoPE (rope None with a pre-RoPE codec) hands keys over as they are.
        self.pre_rope = wants_rope(codec, self.streams) and rope is not None
        if self.pre_rope and positions is None:
            raise InvalidParameterError(f"{codec!r} codes keys without RoPE: the layer needs positions")
        self.rope = rope
        self.positions = positions
        self.seen = 0
        self._s: Dict[str, _Stream] = {}
        #: Attention over the codes (set by the cache); ``fast_check()`` says whether the model
        #: still runs the attention function that reads them.
        self.fast = False
        self.fast_check: Optional[Callable[[], bool]] = None
        self.threads: Optional[int] = None
        self.synthesis = "bf16"
        #: The attention kernel over the codes (set by the cache): "auto", "rust" or "triton".
        self.kernel = "auto"
        #: Multi-head latent attention (set by the cache): the K rows are the latent, the V rows
        #: the rotated key part; attention over their codes runs on the Rust kernel only.
        self.latent = False
        self._codes = SealedCodes()  # the sealed blocks as the kernels read them, built lazily
        self._pending = 0  # rows of the last update staged but not yet dropped or sealed
        #: Attention calls that read the layer's rows per forward pass: its own, and those of the
        #: layers sharing its K/V (Gemma 3n, Gemma 4; set by the cache). The last one settles.
        self.readers = 1
        self._reads = 0
        self._rope_table: Any = None  # the rope table the last fast step read (pre-RoPE keys)
        self._rotation: Any = None  # what key_rotation read, and for which sealed rows
        self._sinkless: Any = None  # the attention module last seen without learnt sinks
        #: Recording the past (assisted generation): rows are sealed or dropped only at the next
        #: crop, so that it can remove the rows taken since (``_recorded``) exactly.
        self.record_past = False
        self._recorded = 0

    def __repr__(self) -> str:
        kind = f", window={self.window}" if self.window is not None else ""
        return (f"KakeyaLayer({self.index}, streams={self.streams}{kind}, seq={self.get_seq_length()}, "
                f"sealed={self.num_sealed()})")

    # --- transformers' layer API ------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._s = {"k": _Stream(key_states), "v": _Stream(value_states)}
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Appends ``[B, H, q, D]`` keys and values; returns the K and V attention reads: every
        token of a full-attention layer, the last ``window - 1`` tokens before this call plus its
        own of a sliding one. The tokens of this call come back exactly as given (they attend to
        each other at full precision, as in a serving engine's current chunk); tokens of earlier
        calls come back as stored: sink and staging raw, sealed blocks decoded."""
        check_rows(self, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending:
            self.settle()
            raise RuntimeError(
                f"layer {self.index}: the rows of the previous update were never attended through the "
                "codes (the model's attention did not receive the key tensor the cache returned); "
                "build the cache with fast=False for this model")
        if self.draft_pending:  # no crop answered the last call: not checking drafts any more
            self.end_past_recording()
        start = self.seen
        q = key_states.shape[-2]
        ids = position_ids(kwargs, q)
        if self.positions is not None:  # (may refuse the call: before anything changes)
            self.positions.record(start, q, key_states.shape[0], ids)
        self._recorded += q if self.record_past else 0
        # The sink keeps each left-padded row's first real tokens: in a sliding layer only while no
        # query is a window past position 0 (until then its rows lie at their positions).
        pads = first_real(ids, key_states.shape[0]) if start == 0 and self.n_sink else None
        if self.window is not None and start + q > self.window:
            pads = None
            self._unpin()
        if (self.fast and self._kernel_of(key_states) is not None
                and (self.fast_check is None or self.fast_check())):
            self.seen += q
            for name, x in (("k", key_states), ("v", value_states)):
                self._stage(name, x.detach(), start, pads)
            self._pending = q
            k = key_states.view_as(key_states)
            setattr(k, TAG, self)
            return k, value_states
        visible = self._visible(start) + q
        out_k, out_v = self._read("k", key_states, visible), self._read("v", value_states, visible)
        self.seen += q
        for name, x in (("k", key_states), ("v", value_states)):
            self._append(name, x.detach(), start, pads)
        return out_k, out_v

    def _unpin(self) -> None:  # every stream's sink back to positions 0 .. (padding.sink_unpadded)
        for st in self._s.values():
            if st.sink_at is not None:
                st.sink, st.sink_at = sink_unpadded(st.sink, st.sink_at), None

    def sink_rows(self) -> Optional[List[int]]:
        """In a left-padded batch (:mod:`.padding`): per row the position of its first sink row."""
        return self._s["k"].sink_at if self.is_initialized else None

    # --- attention over the codes (kakeyaturbo.cache.fast) -----------------------------------

    def _kernel_for(self, device: torch.device) -> Optional[str]:
        """The kernel that attends over the codes for rows on ``device``: the Rust one on the
        CPU, the Triton one on a CUDA device where triton is installed (``kernel="auto"``), or
        the one asked for; None where none runs (the Rust kernel off the CPU, any other device:
        the slow path). Latent attention has the Rust kernel only (on the CPU, whichever kernel
        was asked for)."""
        if device.type == "cpu" and (self.kernel != "triton" or self.latent):
            return "rust"
        if self.latent:
            return None
        if self.kernel == "triton":
            return "triton"
        return "triton" if self.kernel == "auto" and device.type == "cuda" and _HAS_TRITON else None

    def _kernel_of(self, x: torch.Tensor) -> Optional[str]:
        """:meth:`_kernel_for` the device of ``x`` (for a CPU tensor without building its device
        object: asked for every layer at every decode step)."""
        return self._kernel_for(_CPU if x.is_cpu else x.device)

    def device_codes(self, positions: Optional[np.ndarray]) -> Tuple[Any, Optional[torch.Tensor]]:
        """The sealed codes on the layer's device for the Triton kernel and the sealed rows'
        positions there (``positions`` as :meth:`key_rotation` gives them, or None); only the
        blocks sealed since the last call are parsed (:meth:`SealedCodes.on_device`)."""
        self.codes()
        return self._codes.on_device(self.device, positions)

    def settle(self) -> None:
        """The deferred part of a fast update, once attention has read the call's rows raw: a
        sliding layer drops what left its window, full blocks are sealed."""
        self._reads = 0
        if not self._pending:
            return
        self._pending = 0
        if not self.record_past:  # else at the next crop
            for name in STREAMS:
                self._settle(name)

    def read(self) -> None:
        """One attention call has read the layer's rows of this forward pass: the last of its
        :attr:`readers` settles the update."""
        self._reads += 1
        if self._reads >= self.readers:
            self.settle()

    def materialize(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """During a fast update: the K and V the slow path would have returned for it (sealed
        blocks decoded, then sink and staging rows, the call's own last)."""
        visible = self._visible(self.seen - self._pending) + self._pending
        return self._read("k", None, visible), self._read("v", None, visible)

    def raw_rows(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sink_k, sink_v, staging_k, staging_v)`` held raw; during a fast update the staging
        rows end with the call's own."""
        k, v = self._s["k"], self._s["v"]
        return k.sink, v.sink, k.staging, v.staging

    def codes(self) -> Any:
        """The layer's :class:`~kakeyaturbo.LayerCodes`, in step with its sealed blobs (which it
        shares, not copies), or None when the layer seals no K and V (a boundary layer, a codec
        other than the calibrated one)."""
        if not self.fast or not self.is_initialized:
            return None
        k, v = self._s["k"], self._s["v"]

        def make() -> LayerCodes:
            calib = getattr(self.codec, "codecs")
            heads = range(k.staging.shape[1])
            return LayerCodes([calib[("k", self.index, h)] for h in heads],
                              [calib[("v", self.index, h)] for h in heads], batch=self._batch())

        return self._codes.sync(k, v, self._batch(), make)

    def key_rotation(self) -> Optional[Tuple[Any, np.ndarray]]:
        """Keys coded before RoPE, during a fast update: the rope table (shared, see
        :func:`~kakeyaturbo.cache.fast.rope_table`) and the position of every sealed row,
        int32 ``[B, T_c]`` in the order :meth:`codes` holds them; None when a position lies past
        :data:`~kakeyaturbo.cache.fast.TABLE_MAX` (the caller then takes the slow path)."""
        assert self.rope is not None and self.positions is not None and self.positions.pos is not None
        starts, bs = self._s["k"].starts, self.block_size
        # Read once per change of the sealed rows (a block sealed or dropped, positions changed):
        # a decode step between two seals reuses it.
        key = (self.positions.epoch, self._codes.epoch, len(starts), starts[0] if starts else -1)
        memo = self._rotation
        if memo is not None and memo[0] == key:
            self._rope_table = memo[1]
            return memo[1], memo[2]

        def sealed(x: torch.Tensor) -> np.ndarray:
            if starts and starts[-1] - starts[0] == (len(starts) - 1) * bs:
                return x[:, starts[0]:starts[0] + len(starts) * bs].numpy()
            return (torch.cat([x[:, s:s + bs] for s in starts], dim=1) if starts else x[:, :0]).numpy()

        rows = sealed(self.positions.pos)
        n = int(rows.max()) + 1 if rows.size else 1
        if n > fast_mod.TABLE_MAX:
            return None
        extra, long = self.positions.extra, self.positions.long  # (long: [T], one call serves every row)
        extra, long = (None if x is None else sealed(x.expand(len(rows), -1)) for x in (extra, long))
        table, rows = self.positions.rotation(self.rope, rope_table(self.rope, n), rows, extra, long)
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        self._rope_table = table
        self._rotation = (key, table, rows)
        return table, rows

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self._visible(self.seen) + query_length, self.seen - self._visible(self.seen)

    def get_seq_length(self) -> int:
        return self.seen if self.is_initialized else 0

    def get_max_length(self) -> int:
        return -1 if self.window is None else self.window

    def reset(self) -> None:
        self._s = {}
        self.seen = 0
        self.is_initialized = False
        self._codes.forget()
        self._pending = 0
        self.record_past, self._recorded = False, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(batch_rows(beam_idx, self._batch(), self.index))

    def batch_repeat_interleave(self, repeats: int) -> None:
        repeats = _checks.integer(repeats, "repeats", 1)
        if self.is_initialized:
            self._select(torch.arange(self._batch()).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(selected_rows(indices, self._batch(), self.index))

    def offload(self) -> None:
        """Not supported: sealed blocks are host bytes already."""
        raise NotImplementedError("KakeyaCache does not offload")

    prefetch = offload

    # --- views and accounting ---------------------------------------------------------------

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """The keys ``[B, H, T, D]`` the layer holds as attention reads them (sealed blocks
        decoded; a sliding layer: its last ``window - 1`` tokens, as transformers' layer holds)."""
        return self._held("k") if self.is_initialized else None

    @property
    def values(self) -> Optional[torch.Tensor]:
        """The values ``[B, H, T, D]`` (see :attr:`keys`)."""
        return self._held("v") if self.is_initialized else None

    def num_sealed(self) -> int:
        """Sealed blocks held by the first compressed stream (0 for a boundary layer)."""
        self.settle()
        return max((len(st.blocks) for st in self._s.values()), default=0)

    def memory(self) -> Dict[str, int]:
        """Bytes held, by kind: ``blobs``, ``sink``, ``staging``, ``decoded`` (keep_decoded). A
        blob that batch rows share (beam search and ``batch_repeat_interleave`` move sealed
        blocks as the same bytes) counts once."""
        out = {"blobs": 0, "sink": 0, "staging": 0, "decoded": 0}
        if not self.is_initialized:
            return out
        self.settle()
        for st in self._s.values():
            out["blobs"] += sum({id(b): len(b) for blk in st.blocks for row in blk for b in row}.values())
            out["sink"] += _tensor_bytes(st.sink)
            out["staging"] += _tensor_bytes(st.staging)
            out["decoded"] += sum(_tensor_bytes(t) for t in st.decoded)
        return out

    def nbytes_uncompressed(self) -> int:
        """What transformers' layer would hold for the same tokens (a ``DynamicLayer``, or the
        last ``window - 1`` tokens of a ``DynamicSlidingWindowLayer``), at the storage dtype."""
        if not self.is_initialized:
            return 0
        n = self._visible(self.seen)
        total = 0
        for st in self._s.values():
            b, h, _, d = st.staging.shape
            total += b * h * n * d * st.staging.element_size()
        return total

    # --- internals --------------------------------------------------------------------------

    def _visible(self, seen: int) -> int:
        """Tokens before position ``seen`` that the next query still sees."""
        return seen if self.window is None else min(seen, self.window - 1)

    def _batch(self) -> int:
        return self._s["k"].staging.shape[0]

    def _select(self, idx: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self.settle()
        self._codes.forget()
        rows = idx.to("cpu").tolist()
        for st in self._s.values():
            dev = st.staging.device
            st.sink = st.sink.index_select(0, idx.to(dev))
            if st.sink_at is not None:
                at = [st.sink_at[b] for b in rows]
                st.sink_at = at if any(at) else None
            st.staging = st.staging.index_select(0, idx.to(dev))
            # Sealed blocks move as bytes: no re-coding, so beam search stays exact.
            st.blocks = [[blk[b] for b in rows] for blk in st.blocks]
            st.decoded = [t.index_select(0, idx.to(t.device)) for t in st.decoded]

    def _append(self, name: str, x: torch.Tensor, start: int, pads: Optional[List[int]] = None) -> None:
        """Rows ``x`` of positions ``start ..``: to the sink while it fills, else to staging; then
        a sliding layer drops what left its window, and full blocks are sealed (at the next
        crop while recording the past)."""
        self._stage(name, x, start, pads)
        if not self.record_past:
            self._settle(name)

    def _stage(self, name: str, x: torch.Tensor, start: int, pads: Optional[List[int]] = None) -> None:
        """Rows ``x`` of positions ``start ..``: to the sink while it fills (``pads``, of a first
        call: each row's first real tokens where the call holds them all), else to staging."""
        st = self._s[name]
        if not st.staging.shape[-2] and not st.starts:
            st.staging_start = start
        if name in self.streams:
            room = self.n_sink - (st.sink_start + st.sink.shape[-2])
            if (pads is not None and room == self.n_sink and max(pads) + room <= x.shape[-2]
                    and (self.window is None or start + x.shape[-2] <= self.window)):
                # The rows after the sink (padding included) go on to staging as they are.
                st.sink = torch.stack([x[b, :, p:p + room] for b, p in enumerate(pads)])
                st.sink_at = list(pads)
                st.staging = torch.cat([st.staging, x[..., room:, :]], dim=-2)
                st.staging_start = room
                return
            if room > 0 and not st.blocks and st.staging.shape[-2] == 0:
                st.sink = torch.cat([st.sink, x[..., :room, :]], dim=-2)
                x = x[..., room:, :]
                st.staging_start = st.sink_start + st.sink.shape[-2]
        st.staging = torch.cat([st.staging, x], dim=-2)

    def _settle(self, name: str) -> None:
        """A sliding layer drops what left its window; full blocks are sealed."""
        if self.window is not None:
            self._drop(name, self.seen - self._visible(self.seen))
        if name in self.streams and self._s[name].staging.shape[-2] >= self.block_size:
            self._seal(name)

    def _drop(self, name: str, lo: int) -> None:
        """Drops what a sliding layer holds before position ``lo`` (no later query sees it):
        sink rows, whole sealed blocks, staging rows; a block straddling ``lo`` stays whole."""
        st = self._s[name]
        if st.sink_at is not None and lo > 0:
            self._unpin()
        if st.sink.shape[-2] and st.sink_start < lo:
            cut = min(lo - st.sink_start, st.sink.shape[-2])
            st.sink = st.sink[..., cut:, :].clone()
            st.sink_start += cut
        while st.starts and st.starts[0] + self.block_size <= lo:
            st.blocks.pop(0)
            st.starts.pop(0)
            if st.decoded:
                st.decoded.pop(0)
        if not st.starts and st.staging_start < lo:
            cut = min(lo - st.staging_start, st.staging.shape[-2])
            st.staging = st.staging[..., cut:, :].clone()
            st.staging_start += cut

    def _turn(self, y: torch.Tensor, start: int) -> torch.Tensor:
        """Keys ``y`` ``[B, H, n, D]`` of tokens ``start ..`` with the layer's RoPE put on, in place,
        from the cos/sin the other layers of the forward pass share (:meth:`Positions.cos_sin`);
        a key norm's weight with it (:meth:`LayerRope.turn`)."""
        assert self.positions is not None and self.rope is not None
        cs = over_heads(*self.positions.cos_sin(self.rope, start, y.shape[-2]), y)
        return self.rope.turn(y, *cs)

    def _seal(self, name: str) -> None:
        """Seals every full block of staging (one copy of the rows left, however many blocks a
        long prompt fills)."""
        st, bs, start = self._s[name], self.block_size, self._s[name].staging_start
        n = st.staging.shape[-2] // bs
        if name == "k" and self.pre_rope:  # RoPE taken off (LayerRope.remove_rows)
            assert self.positions is not None and self.rope is not None
            x = self.rope.remove_rows(st.staging, n * bs, *self.positions.cos_sin(self.rope, start, n * bs))
        else:
            x = to_numpy(st.staging[..., :n * bs, :])
        # Every block coded before the stream changes: a block the codec refuses leaves it whole.
        blobs = encode_blocks(self.codec, name, self.index, x, bs)
        st.staging = st.staging[..., n * bs:, :].clone()
        st.staging_start = start + n * bs
        for j, blob in enumerate(blobs):
            st.blocks.append(blob)
            st.starts.append(start + j * bs)
            if self.keep_decoded:
                st.decoded.append(self._block(name, len(st.blocks) - 1))

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
            y = self._turn(y, st.starts[j])
        return y.to(ref.dtype)

    def _read(self, name: str, new: Optional[torch.Tensor], visible: int) -> torch.Tensor:
        """The rows of a stream attention reads: sink, sealed blocks decoded (every block in one
        call, RoPE put back over their positions at once), staging, then ``new`` (a slow
        update's own rows) if given; the last ``visible`` of them. Float32 rows on the CPU are
        decoded straight into the tensor returned, not into one of their own then concatenated."""
        st = self._s[name]
        n, ref, more = len(st.blocks), st.staging, [] if new is None else [new]
        if not n and not more and not st.sink.shape[-2]:  # staging alone (a raw layer without sink)
            return ref[..., ref.shape[-2] - visible:, :]
        if st.decoded or not n:  # kept decoded (or nothing sealed)
            full = torch.cat([st.sink] + [self._block(name, j) for j in range(n)] + [ref] + more, dim=-2)
            return sink_in_place(st.sink, st.sink_at, full)[..., full.shape[-2] - visible:, :]
        assert st.starts[-1] - st.starts[0] == (n - 1) * self.block_size, "sealed blocks are contiguous"
        s, b, g = st.sink.shape[-2], n * self.block_size, ref.shape[-2]
        direct = ref.is_cpu and all(x.dtype == torch.float32 and not x.requires_grad for x in [ref] + more)
        if direct:
            full = torch.empty(*ref.shape[:2], s + b + g + sum(x.shape[-2] for x in more), ref.shape[-1])
            decode_blocks_into(self.codec, name, self.index, st.blocks, self.block_size, full.numpy(), s)
            y = full[..., s:s + b, :]
        else:
            y = torch.from_numpy(
                decode_blocks(self.codec, name, self.index, st.blocks, self.block_size, ref.shape[-1])
            ).to(self.device)
        if name == "k" and self.pre_rope:
            y = self._turn(y, st.starts[0])
        if direct:
            for x, at in zip([st.sink, ref] + more, (0, s + b, s + b + g)):
                full[..., at:at + x.shape[-2], :] = x
        else:
            full = torch.cat([st.sink, y.to(ref.dtype), ref] + more, dim=-2)
        return sink_in_place(st.sink, st.sink_at, full)[..., full.shape[-2] - visible:, :]

    def _held(self, name: str) -> torch.Tensor:
        self.settle()
        return self._read(name, None, self._visible(self.seen))


def _tensor_bytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()

