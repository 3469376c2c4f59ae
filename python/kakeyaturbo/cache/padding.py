"""The sink of a left-padded batch: each row keeps its first real tokens raw, not its padding.

transformers left-pads the prompts of a batch: a shorter row's first positions are padding,
which the model's mask hides, and its first real token (the one attention leans on, as the sink
keeps it raw) lies further on, where the blocks would code it. So a layer's sink holds, per
batch row, that row's first ``n_sink`` real tokens (``sink_at[b]``: the position of row ``b``'s
first sink row) and attention reads them from there: decoded rows are overwritten with them
(:func:`sink_in_place`), and attention over the codes moves each one's mask entry to its sink
column and masks its coded copy (:func:`move_sinks`). A sliding-window layer does so while no
query lies a window past position 0 (its rows then lie at their positions, as the kernel's window
counts them); from then on, and after a crop back into a padded row's sink, every row's sink holds
positions ``0 ..`` again (:func:`sink_unpadded`).
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import torch


def first_real(ids: Optional[torch.Tensor], batch: int) -> Optional[List[int]]:
    """Per batch row, the padding before its first real token, from the ``position_ids``
    ``[batch, q]`` of a layer's first call; None where no row is padded or the positions are not
    known. transformers 5.25 gives a left-padded row's padding position 0, as its first token
    (the first token: the last of the leading run of its first position); earlier versions gave
    the padding 1 (the first token: the first of the row's least position)."""
    if ids is None or ids.ndim != 2 or ids.shape[0] != batch or not ids.shape[1]:
        return None
    first = []
    for row in ids.tolist():
        low = min(row)
        if low < row[0]:
            first.append(row.index(low))
        else:
            run = next((i for i, x in enumerate(row) if x != row[0]), len(row))
            first.append(run - 1)
    return first if any(first) else None


def sink_in_place(sink: torch.Tensor, sink_at: Optional[List[int]], full: torch.Tensor) -> torch.Tensor:
    """``full`` (a stream's rows of positions ``0 ..``, a tensor of its own) with each padded
    row's sink rows written over their positions; the sink's own places hold padding there,
    which the model's mask hides."""
    if sink_at is not None:
        n = sink.shape[-2]
        for b, p in enumerate(sink_at):
            if p:
                full[b, :, p:p + n] = sink[b]
    return full


def causal_mask(batch: int, n_q: int, total: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The boolean mask ``[batch, 1, n_q, total]`` (True: attend) of queries that are the last
    ``n_q`` of ``total`` positions, each seeing those up to its own: what attention without a mask
    computes, for :func:`move_sinks` to change."""
    cols = torch.arange(total, device=device)
    seen = cols[None, :] <= (total - n_q + torch.arange(n_q, device=device))[:, None]
    return seen.expand(batch, 1, n_q, total).clone()


def move_sinks(m: Any, sink_at: List[int], n: int, masked: Any) -> Any:
    """``m``, a mask of its own (boolean or additive, numpy or torch, ``[B, ..., total]`` over a
    layer's positions ``0 ..``, none dropped, whose first ``n`` are its sink rows), changed in
    place for sinks at ``sink_at``: row ``b``'s sink column ``j`` takes the entry of position
    ``sink_at[b] + j``, whose copy past the sink becomes ``masked``."""
    for b, p in enumerate(sink_at):
        if p:
            src = m[b, ..., p:p + n]
            m[b, ..., :n] = src.copy() if isinstance(src, np.ndarray) else src.clone()
            m[b, ..., max(p, n):p + n] = masked
    return m


def sink_unpadded(sink: torch.Tensor, sink_at: List[int]) -> torch.Tensor:
    """The sink as rows of positions ``0 .. n-1`` for every batch row (a crop back into the
    padded rows' sinks): a row's rows that are its padding come back as zeros, which the model's
    mask hides."""
    out = torch.zeros_like(sink)
    n = sink.shape[-2]
    for b, p in enumerate(sink_at):
        if p < n:
            out[b, :, p:] = sink[b, :, :n - p]
    return out
