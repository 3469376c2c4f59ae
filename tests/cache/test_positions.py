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


def test_cos_sin_is_computed_once_per_forward_pass_and_rotation() -> None:
    from kakeyaturbo.families.rope import FnRope

    calls = []

    def rope(p):
        calls.append(p.clone())
        return _mrope(p)

    s = Positions()
    layer_a, layer_b, other = FnRope(rope), FnRope(rope), FnRope(lambda p: rope(p))
    _record(s, [[[0, 1, 2, 3]]] * 3)
    first = s.cos_sin(layer_a, 1, 3)
    assert all(torch.equal(x, y) for x, y in zip(first, _mrope(s.get(1, 3))))
    # Another layer of the same rotation reading the same rows shares it; other rows or
    # another rotation have their own.
    assert s.cos_sin(layer_b, 1, 3) is first and len(calls) == 1
    assert s.cos_sin(layer_a, 0, 3) is not first and len(calls) == 2
    assert s.cos_sin(other, 1, 3) is not first and len(calls) == 3
    # Held while kept: positions (int32) and three pairs of [1, 3, 8] float32.
    assert s.nbytes() == 4 * 4 + 3 * 2 * 3 * 8 * 4
    _record(s, [[[4]]] * 3)  # the next forward pass
    assert s.cos_sin(layer_a, 1, 3) is not first and len(calls) == 4
    assert s.nbytes() == 5 * 4 + 2 * 3 * 8 * 4
    s.pos = s.pos.clone()  # positions replaced (beam reordering, crop)
    s.cos_sin(layer_a, 1, 3)
    assert len(calls) == 5
    s.end_pass()  # the model's forward call ended: nothing held past it
    assert s.nbytes() == 5 * 4
