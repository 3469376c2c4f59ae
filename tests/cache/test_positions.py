"""The cache's position store with multimodal RoPE positions (:class:`Positions`): tokens whose
three positions differ get rotations of their own, appended to the rope table, and the batch
and length operations keep the three rows with the positions."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kakeyaturbo.cache.positions import Positions  # noqa: E402
from kakeyaturbo.codec.attention import RopeTable  # noqa: E402

FREQ = torch.tensor([1.0, 0.5, 0.25, 0.125])


def _mrope(p):
    """A multimodal rotation of 8 channels ("half" pairing): frequency ``f`` turns by the
    temporal position for f = 0, the height for f = 1, 2, the width for f = 3."""
    p = torch.as_tensor(p).long()
    p = p[None].expand(3, -1, -1) if p.ndim == 2 else p
    ang = torch.stack([p[0] * FREQ[0], p[1] * FREQ[1], p[1] * FREQ[2], p[2] * FREQ[3]], dim=-1).float()
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def _record(store, grid):
    store.expect(None)
    store.pending_grid = torch.tensor(grid)
    store.record(len(store), store.pending_grid.shape[-1], store.pending_grid.shape[1], None)


def test_rows_of_their_own_only_where_the_three_positions_differ() -> None:
    s = Positions()
    _record(s, [[[0, 1, 2]]] * 3)  # text: one position each, as without an image
    assert s.grid is None and s.pos.tolist() == [[0, 1, 2]]
    _record(s, [[[3, 3, 3, 5]], [[3, 3, 4, 5]], [[3, 4, 3, 5]]])  # an image, then text behind its index
    assert s.pos.tolist() == [[0, 1, 2, 3, 3, 3, 5]]
    assert s.extra.tolist() == [[-1, -1, -1, -1, 0, 1, -1]] and s.triples == [(3, 3, 4), (3, 4, 3)]
    assert torch.equal(s.get(2, 4), torch.tensor([[[2, 3, 3, 3]], [[2, 3, 3, 4]], [[2, 3, 4, 3]]], dtype=torch.int32))
    base = RopeTable.from_full(*(t[0].numpy() for t in _mrope(torch.arange(8)[None])))
    table, rows = s.rotation(_mrope, base, s.pos.numpy(), s.extra.numpy())
    assert rows.tolist() == [[0, 1, 2, 3, 8, 9, 5]]
    # every row's rotation read through the table is the one its three positions give
    want_cos, want_sin = _mrope(s.grid)
    assert np.allclose(table.cos[rows[0]], want_cos[0, :, :4].numpy())
    assert np.allclose(table.sin[rows[0]], want_sin[0, :, :4].numpy())
    assert s.rotation(_mrope, base, s.pos.numpy(), s.extra.numpy())[0] is table  # built once
    same, first = s.rotation(_mrope, base, rows[:, :4], s.extra.numpy()[:, :4])  # no image row among them
    assert same is base and np.array_equal(first, rows[:, :4])
    snap = s.snapshot()
    _record(s, [[[6]]] * 3)
    assert s.extra.tolist()[0][-1] == -1 and s.grid.shape == (3, 1, 8)
    s.restore(snap)
    assert len(s) == 7
    s.select(torch.tensor([0, 0]))
    assert s.grid.shape == (3, 2, 7) and s.extra.shape == (2, 7)
    s.crop(4)
    assert s.extra.tolist() == [[-1] * 4] * 2 and s.grid.shape == (3, 2, 4)
    s.reset()
    assert s.pos is None and s.grid is None and not s.triples
