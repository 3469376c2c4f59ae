"""Undoing what a cache layer took (:class:`Rollback`, a part of
:class:`~kakeyaturbo.cache.layer.KakeyaLayer`): ``crop`` (exact while recording the past, as
assisted and prompt-lookup decoding ask), a snapshot of the layer that a refused forward
call is rolled back to, and the state a saved file holds (``export_state`` / ``import_state``)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..codec import _checks
from ..errors import InvalidParameterError
from .codecs import STREAMS


def crop_count(tokens_to_remove: Any) -> int:
    """The number of tokens ``crop(tokens_to_remove)`` removes: transformers passes a
    non-positive count (InvalidParameterError for another, TypeError for a non-integer)."""
    tokens_to_remove = _checks.integer(tokens_to_remove, "crop's count of tokens to remove")
    if tokens_to_remove > 0:
        raise InvalidParameterError(f"crop takes a non-positive count of tokens to remove, got {tokens_to_remove}")
    return -tokens_to_remove


#: What :meth:`Rollback.snapshot` keeps of a stream (references: the layer replaces these
#: tensors and lists, it never changes them in place).
_FIELDS = ("sink", "sink_start", "sink_at", "staging", "staging_start")


class Rollback:
    """The layer's crop, past recording, snapshots and saved state (see the module)."""

    # Attributes of the layer (KakeyaLayer.__init__ sets them).
    record_past: bool
    _recorded: int

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` puts the layer back exactly as it was: while recording the past.
        (Cropping into a sealed block reads it back through the codec, lossy for a lossy codec;
        a sliding layer cannot get back what it dropped.)"""
        return self.record_past

    def activate_past_recording(self, **kwargs: Any) -> None:
        """From now on (transformers calls it before assisted or prompt-lookup decoding) the rows
        of each call are sealed, and a sliding layer's rows that left its window dropped, only at
        the next :meth:`crop`, which first removes the rejected draft rows exactly. Keywords are
        for other layers (transformers 5.25 passes its linear layers ``recurrent_states_to_keep``):
        the raw rows kept until the crop are this layer's whole history."""
        self.record_past = True
        self._recorded = 0

    @property
    def draft_pending(self) -> bool:
        """Whether rows were taken while recording the past and no crop has answered them yet
        (inside a draft's check)."""
        return self.record_past and self._recorded > 0

    def end_past_recording(self) -> None:
        """Stops recording the past: what is due is sealed or dropped now, later calls as they
        come. transformers turns recording on for assisted and prompt-lookup decoding, crops
        after every draft it checks and never turns it off (it does so only where it defers its
        stop test, on "mps"): so :meth:`update` ends the recording when a call follows one that
        no crop answered, as ordinary decoding does, and :meth:`reset` and a save end it too.
        Without that a reused cache would never seal another block."""
        self.record_past = False
        self._recorded = 0
        if self.is_initialized and not self._pending:
            for name in STREAMS:
                self._settle(name)

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last ``-tokens_to_remove`` tokens (a non-positive count, as in transformers).

        Inside staging this is exact; reaching into a sealed block decodes it back into staging
        (lossy for a lossy codec). A sliding layer that already dropped tokens cannot roll back
        (as transformers' ``DynamicSlidingWindowLayer``): RuntimeError, and nothing changes.
        While recording the past, the rows taken since the last crop are all held raw (a crop of
        at most those is exact, also for a sliding layer); the crop then seals and drops what
        is due."""
        r = crop_count(tokens_to_remove)
        if not self.is_initialized:
            return
        refusal = self.crop_refusal(r)
        if refusal is not None:
            raise RuntimeError(refusal)
        self.settle()
        if r:
            self._remove_last(r)
        if self.record_past:
            self._recorded = 0
            for name in STREAMS:
                self._settle(name)

    def crop_refusal(self, r: int) -> Optional[str]:
        """Why removing the last ``r`` tokens cannot be done, or None."""
        if (r and self.is_initialized and self.window is not None and self.seen >= self.window
                and not (self.record_past and r <= self._recorded)):
            return (f"layer {self.index} is sliding-window and already dropped tokens out of its window: it "
                    "cannot be cropped (activate_past_recording() before the calls to undo)")
        return None

    def _remove_last(self, r: int) -> None:
        """Drops the last ``r`` tokens (crop)."""
        r = min(r, self.seen)
        self.seen -= r
        for name in STREAMS:
            st = self._s[name]
            while st.starts and st.starts[-1] >= self.seen:
                self._unseal_last(name)
            if st.starts and st.staging_start > self.seen:
                self._unseal_last(name)
            keep = max(self.seen - st.staging_start, 0)
            st.staging = st.staging[..., :keep, :].clone()
            if st.sink_at is not None and self.seen < max(st.sink_at) + st.sink.shape[-2]:
                self._unpin()  # back into a padded row's sink: every row's sink holds positions 0 .. again
            if self.seen < st.sink_start + st.sink.shape[-2]:
                st.sink = st.sink[..., :max(self.seen - st.sink_start, 0), :].clone()
                st.staging_start = self.seen if not st.starts else st.staging_start

    def snapshot(self) -> Any:
        """What :meth:`restore` puts back: the layer's length, its raw rows and the lists of its
        sealed blocks, held by reference (cheap: no row is copied)."""
        if not self.is_initialized:
            return None
        streams = {name: (tuple(getattr(st, f) for f in _FIELDS), list(st.blocks), list(st.starts),
                          list(st.decoded)) for name, st in self._s.items()}
        return self.seen, self._recorded, streams

    def restore(self, snap: Any) -> None:
        """The layer as :meth:`snapshot` saw it (a layer not yet initialised then is reset)."""
        if snap is None:
            self.reset()
            return
        self.seen, self._recorded, streams = snap
        self._pending = self._reads = 0
        self._codes.forget()
        for name, (fields, blocks, starts, decoded) in streams.items():
            st = self._s[name]
            for f, v in zip(_FIELDS, fields):
                setattr(st, f, v)
            st.blocks, st.starts, st.decoded = list(blocks), list(starts), list(decoded)

    # --- persistence (kakeyaturbo.cache.persist) -----------------------------------------------

    def export_state(self) -> Dict[str, Any]:
        """What the layer holds, as it holds it (no copy, no re-coding): ``seen`` and per stream
        the raw ``sink`` and ``staging`` rows ``[B, H, n, D]`` with their start positions (the
        sink's per batch row, ``sink_at``, in a left-padded batch, else None), and
        the sealed blocks' blobs ``[block][batch][head]`` with theirs. Empty before the first
        update."""
        if not self.is_initialized:
            return {"seen": 0, "streams": {}}
        self.settle()
        return {"seen": self.seen, "streams": {
            name: {"sink": st.sink, "sink_start": st.sink_start, "sink_at": st.sink_at, "staging": st.staging,
                   "staging_start": st.staging_start, "blocks": st.blocks, "starts": st.starts}
            for name, st in self._s.items()}}

    def import_state(self, state: Dict[str, Any]) -> None:
        """Takes over a state :meth:`export_state` gave (of a layer with the same settings);
        with ``keep_decoded`` the sealed blocks are decoded once."""
        streams = state["streams"]
        if not streams:
            self.reset()
            return
        self.lazy_initialization(streams["k"]["staging"], streams["v"]["staging"])
        self._codes.forget()
        self._pending = 0
        self.seen = int(state["seen"])
        for name, part in streams.items():
            st = self._s[name]
            st.sink, st.sink_start = part["sink"], int(part["sink_start"])
            at = part.get("sink_at")
            st.sink_at = None if at is None else [int(x) for x in at]
            st.staging, st.staging_start = part["staging"], int(part["staging_start"])
            st.blocks, st.starts = [list(b) for b in part["blocks"]], [int(x) for x in part["starts"]]
            st.decoded = []
            if self.keep_decoded:
                st.decoded = [self._block(name, j) for j in range(len(st.blocks))]

    def _unseal_last(self, name: str) -> None:
        """The last sealed block decoded back into staging (crop)."""
        self._codes.forget()
        st = self._s[name]
        dec = self._block(name, len(st.blocks) - 1)
        st.staging = torch.cat([dec, st.staging], dim=-2)
        st.staging_start = st.starts.pop()
        st.blocks.pop()
        if st.decoded:
            st.decoded.pop()
