"""The RoPE positions of the tokens a generation cache holds (:class:`Positions`, shared by
its layers), the ``position_ids`` a layer's ``update`` receives (:func:`position_ids`), and the
multimodal positions a model's rotary module is called with (:func:`watch_rotary`).

Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) rotates each token by three positions
(temporal, height, width), each for its own sections of the frequencies: they agree for text
tokens (but run behind the token's index after an image) and differ for image and video
tokens. The cache takes RoPE off with the positions the model rotated by, so that the codec
sees the model's keys before RoPE; a row whose three positions differ gets a rotation of its
own, appended to the rope table the kernel reads (:meth:`Positions.rotation`)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from ..codec.attention import RopeTable
from ..families.rope import past_static_limit


class Positions:
    """The RoPE position of every token the cache saw, ``int32 [batch, T]`` (:attr:`pos`), shared
    by all layers (kept only when the codec codes keys without RoPE). ``pending`` holds the
    ``position_ids`` of the forward call in progress when the model's own forward gave them
    (families whose attention does not forward them to the cache: GPT-NeoX), ``pending_grid``
    the multimodal ones its rotary module was called with (``[3, batch, q]``).

    Once a token's three multimodal positions differ, :attr:`grid` holds every token's
    (``int32 [3, batch, T]``; :attr:`pos` then holds the temporal one) and :attr:`extra` the
    index of each such token's triple in :attr:`triples` (``-1`` for the others).

    ``longrope`` (:attr:`long_after` set by the cache from the model's rotary module): a forward
    call whose largest position is at least ``long_after`` rotates the tokens it computes by the
    long factors. Once one has, :attr:`long` marks those tokens (``bool [T]``, one call serves
    every batch row); the others were rotated by the short ones.

    A ``dynamic`` rope type (:attr:`static_until`, set by the cache likewise): a call reaching
    that position is refused before anything of it is recorded (past it the model's
    frequencies follow each call's longest position)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        #: ``original_max_position_embeddings`` of a ``longrope`` model (kept by a reset).
        self.long_after: Optional[int] = getattr(self, "long_after", None)
        #: ``max_position_embeddings`` of a dynamic rope type (kept by a reset).
        self.static_until: Optional[int] = getattr(self, "static_until", None)
        self.long: Optional[torch.Tensor] = None
        self._pos: Optional[torch.Tensor] = None
        #: Counts the changes to positions already held (not the appends): what was read from
        #: them (:meth:`KakeyaLayer.key_rotation`) holds while it is unchanged.
        self.epoch = getattr(self, "epoch", 0) + 1
        self.grid: Optional[torch.Tensor] = None
        self.extra: Optional[torch.Tensor] = None
        self.triples: List[Tuple[int, int, int]] = []
        self._index: Dict[Tuple[int, int, int], int] = {}
        self._tables: List[Tuple[RopeTable, int, RopeTable]] = []
        self.pending: Optional[torch.Tensor] = None
        self.pending_grid: Optional[torch.Tensor] = None
        self._cos_sin: List[Tuple[Any, int, int, Tuple[torch.Tensor, torch.Tensor]]] = []

    @property
    def pos(self) -> Optional[torch.Tensor]:
        return self._pos

    @pos.setter
    def pos(self, value: Optional[torch.Tensor]) -> None:
        self._pos = value
        self.epoch += 1
        self._cos_sin = []

    def __len__(self) -> int:
        return 0 if self.pos is None else self.pos.shape[1]

    def expect(self, position_ids: Optional[torch.Tensor], last: int = -1) -> None:
        """A forward call begins: its ``position_ids`` (or None; ``last``: its last position where
        they are not given); no multimodal ones yet. Refuses a call reaching :attr:`static_until`
        before the model's rotary module runs (it would keep frequencies grown by it)."""
        if self.static_until is not None:
            self._check_static(position_ids if position_ids is not None else torch.tensor([last]))
        self.pending = position_ids
        self.pending_grid = None

    def end_pass(self) -> None:
        """A forward call has ended: the rotations its layers shared (:meth:`cos_sin`) go."""
        self._cos_sin = []

    def record(self, start: int, q: int, batch: int, position_ids: Optional[torch.Tensor]) -> None:
        """Tokens ``start .. start+q`` of a layer's update; the first layer to see them records them."""
        have = len(self)
        if start + q <= have:
            return
        if start != have:
            raise RuntimeError(f"positions recorded up to {have}, a layer appends at {start}")
        g = self.pending_grid
        if isinstance(g, torch.Tensor) and g.shape[-1] == q:
            self._check_static(g)
            self._record_grid(g.detach().to("cpu", torch.int32).expand(3, batch, q), have)
            return
        if position_ids is None and isinstance(self.pending, torch.Tensor) and self.pending.shape[-1] == q:
            position_ids = self.pending
        if position_ids is None:
            new = torch.arange(start, start + q, dtype=torch.int32)[None].expand(batch, q)
        else:
            new = position_ids.detach().to("cpu", torch.int32).expand(batch, q)
        self._check_static(new)
        self._record_long(q, int(new.max()) + 1 > self.long_after if self.long_after is not None and q else False)
        self._append(new, None if self.grid is None else new[None].expand(3, -1, -1),
                     None if self.extra is None else torch.full((batch, q), -1, dtype=torch.int32))

    def _check_static(self, new: torch.Tensor) -> None:
        limit = self.static_until
        if limit is not None and new.numel() and int(new.max()) >= limit:
            raise past_static_limit(f"a forward call reaches position {int(new.max())} (nothing of it was stored)",
                                    limit)

    def _record_long(self, q: int, long: bool) -> None:
        """The next ``q`` tokens' factors (``longrope``), before they are appended."""
        if long and self.long is None:
            self.long = torch.zeros(len(self), dtype=torch.bool)
        if self.long is not None:
            self.long = torch.cat([self.long, torch.full((q,), long, dtype=torch.bool)])

    def load(self, grid: torch.Tensor) -> None:
        """Every token's multimodal positions ``int32 [3, batch, T]`` (a saved cache's)."""
        self.reset()
        self._record_grid(grid, 0)

    def _record_grid(self, g: torch.Tensor, have: int) -> None:
        odd = (g[0] != g[1]) | (g[1] != g[2])
        if self.grid is None and not bool(odd.any()):
            self._append(g[0], None, None)
            return
        if self.grid is None:  # the first token whose positions differ: every earlier one's agree
            b = g.shape[1]
            before = self.pos if self.pos is not None else torch.zeros((b, 0), dtype=torch.int32)
            self.grid = before[None].expand(3, -1, -1).clone()
            self.extra = torch.full((b, have), -1, dtype=torch.int32)
        extra = torch.full(odd.shape, -1, dtype=torch.int32)
        if bool(odd.any()):
            ids = []
            for t in map(tuple, g.permute(1, 2, 0)[odd].tolist()):
                i = self._index.get(t)
                if i is None:
                    i = self._index[t] = len(self.triples)
                    self.triples.append(t)
                ids.append(i)
            extra[odd] = torch.tensor(ids, dtype=torch.int32)
        self._append(g[0], g, extra)

    def _append(self, pos: torch.Tensor, grid: Optional[torch.Tensor], extra: Optional[torch.Tensor]) -> None:
        self._cos_sin = []  # a new forward pass: the last one's rotations go
        self._pos = pos.clone() if self._pos is None else torch.cat([self._pos, pos], dim=1)
        if grid is not None and self.grid is not None:
            self.grid = torch.cat([self.grid, grid], dim=2)
        if extra is not None and self.extra is not None:
            self.extra = torch.cat([self.extra, extra], dim=1)

    def get(self, start: int, n: int) -> torch.Tensor:
        """The positions of tokens ``start .. start+n``: ``[batch, n]``, or ``[3, batch, n]``
        (:attr:`grid`) once a token's multimodal positions differed."""
        assert self.pos is not None and start + n <= len(self)
        return self.pos[:, start:start + n] if self.grid is None else self.grid[:, :, start:start + n]

    def cos_sin(self, rope: Any, start: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``rope(self.get(start, n))``, the cos/sin of a :class:`~kakeyaturbo.families.rope.LayerRope`
        at the positions of tokens ``start .. start+n`` (a ``longrope`` model's: each token's by
        the factors its call used), computed once for every layer that
        rotates as ``rope`` does: kept until the forward pass ends (:meth:`end_pass`), tokens are
        appended or the positions change, so that a pass's layers, which seal and decode the
        same rows, share them (:meth:`nbytes` counts them while held)."""
        for r, s0, m, cs in self._cos_sin:
            if s0 == start and m == n and r.same_as(rope):
                return cs
        pos = self.get(start, n)
        if self.long_after is None or rope.long_after is None:
            cs = rope(pos)
        else:
            long = self.long[start:start + n] if self.long is not None else torch.zeros(n, dtype=torch.bool)
            short = rope(pos.masked_fill(long, 0), long=False)  # (a long token's row is not read)
            cs = short if not bool(long.any()) else tuple(
                torch.where(long[:, None], a, b) for a, b in zip(rope(pos, long=True), short))
        self._cos_sin.append((rope, start, n, cs))
        return cs

    def rotation(self, rope: Any, table: RopeTable, rows: np.ndarray,
                 extra: Optional[np.ndarray], long: Optional[np.ndarray] = None) -> Tuple[RopeTable, np.ndarray]:
        """The rope table and rows the kernel reads for sealed rows at ``rows`` (positions into
        ``table``), ``extra`` their entries of :attr:`extra`: rows with a triple of their own
        read it from rows appended to the table (computed by ``rope``, once per table and count
        of triples). A ``longrope`` model's ``table`` holds the long factors'
        (:func:`~kakeyaturbo.cache.fast.rope_table`): the short ones' rows for positions below
        :attr:`long_after` are appended (once per table), and every row not ``long`` (its entry
        of :attr:`long`, ``bool``; None: none is) reads them."""
        if self.long_after is not None and rope.long_after is not None:
            return self._short_rows(rope, table, rows, long)
        if extra is None or not (extra >= 0).any():
            return table, rows
        k = len(self.triples)
        found = next((t for base, n, t in self._tables if base is table and n == k), None)
        if found is None:
            g = torch.tensor(self.triples, dtype=torch.long).T[:, None, :]
            cos, sin = rope(g)
            more = RopeTable.from_full(cos[0].float().cpu().numpy(), sin[0].float().cpu().numpy(), table.style)
            found = RopeTable(np.concatenate([table.cos, more.cos]), np.concatenate([table.sin, more.sin]),
                              table.style)
            self._tables = [e for e in self._tables if e[0] is not table] + [(table, k, found)]
        n = table.n_positions
        return found, np.where(extra >= 0, extra + n, rows).astype(np.int32)

    def long_runs(self) -> List[List[int]]:
        """The tokens :attr:`long` marks as runs ``[[start, end], ...]`` (none: empty)."""
        if self.long is None:
            return []
        zero = torch.zeros(1, dtype=torch.int8)
        edges = torch.diff(self.long.to(torch.int8), prepend=zero, append=zero).nonzero().flatten().tolist()
        return [[a, b] for a, b in zip(edges[0::2], edges[1::2])]

    def set_long_runs(self, runs: List[List[int]]) -> None:
        """:attr:`long` from :meth:`long_runs` (of a saved cache: positions already held)."""
        long = torch.zeros(len(self), dtype=torch.bool)
        for a, b in runs:
            long[a:b] = True
        self.long = long if bool(long.any()) else None

    def _short_rows(self, rope: Any, table: RopeTable, rows: np.ndarray,
                    long: Optional[np.ndarray]) -> Tuple[RopeTable, np.ndarray]:
        n, limit = table.n_positions, int(self.long_after or 0)
        found = next((t for base, k, t in self._tables if base is table and k == -1), None)
        if found is None:
            cos, sin = rope(torch.arange(limit)[None], long=False)
            more = RopeTable.from_full(cos[0].float().cpu().numpy(), sin[0].float().cpu().numpy(), table.style)
            found = RopeTable(np.concatenate([table.cos, more.cos]), np.concatenate([table.sin, more.sin]),
                              table.style)
            self._tables = [e for e in self._tables if e[0] is not table] + [(table, -1, found)]
        short = np.ones(rows.shape, dtype=bool) if long is None else ~np.broadcast_to(long, rows.shape)
        return found, np.where(short, rows + n, rows).astype(np.int32)

    def nbytes(self) -> int:
        held = [self.pos, self.grid, self.extra, self.long] + [t for *_, cs in self._cos_sin for t in cs]
        return sum(0 if t is None else t.numel() * t.element_size() for t in held)

    def snapshot(self) -> Tuple[Any, ...]:
        """What :meth:`restore` puts back (the tensors are replaced, never changed in place)."""
        return self.pos, self.grid, self.extra, self.long

    def restore(self, snap: Tuple[Any, ...]) -> None:
        self.pos, self.grid, self.extra, self.long = snap

    # select and crop replace pos (its setter counts the change) with grid and extra.
    def select(self, idx: torch.Tensor) -> None:
        idx = idx.to("cpu")
        if self.pos is not None:
            self.pos = self.pos.index_select(0, idx)
        if self.grid is not None and self.extra is not None:
            self.grid = self.grid.index_select(1, idx)
            self.extra = self.extra.index_select(0, idx)

    def crop(self, length: int) -> None:
        if self.long is not None:
            self.long = self.long[:length].clone() if bool(self.long[:length].any()) else None
        if self.pos is not None:
            self.pos = self.pos[:, :length].clone()
        if self.grid is not None and self.extra is not None:
            self.grid = self.grid[:, :, :length].clone()
            self.extra = self.extra[:, :length].clone()


def position_ids(kwargs: Dict[str, Any], q: int) -> Optional[torch.Tensor]:
    """``position_ids`` ``[1 or batch, q]`` as the attention module forwards them to ``update``
    (most families pass ``kwargs=kwargs``), or None."""
    for d in (kwargs, kwargs.get("kwargs"), kwargs.get("cache_kwargs")):
        if isinstance(d, dict):
            p = d.get("position_ids")
            if isinstance(p, torch.Tensor) and p.ndim == 2 and p.shape[-1] == q:
                return p
    return None


def watch_rotary(modules: Iterable[Any], positions: Callable[[], Optional[Positions]], owner: Any) -> None:
    """Hands the multimodal ``position_ids`` (``[3, batch, q]``) each rotary module in
    ``modules`` is called with to ``positions()`` (None: not inside a call of the cache's, or the
    cache is gone), as ``pending_grid``; the hooks go when ``owner`` does."""

    def hook(_module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        x = args[0] if args else kwargs.get("x")
        if isinstance(x, torch.Tensor) and x.numel() == 0:  # the cache's own call (LayerRope)
            return
        p = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if isinstance(p, torch.Tensor) and p.ndim == 3 and p.shape[0] == 3:
            store = positions()
            if store is not None:
                store.pending_grid = p

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
               for m in {id(m): m for m in modules if isinstance(m, torch.nn.Module)}.values()]
    weakref.finalize(owner, lambda: [h.remove() for h in handles])
