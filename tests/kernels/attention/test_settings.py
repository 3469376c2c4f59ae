"""Launch sizing of the attention split kernel on a GPU (no GPU needed: the device's
multiprocessor count is given)."""

from __future__ import annotations

import pytest
import triton

from kakeyaturbo.kernels.attention import split


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    def settings(tc: int, bh: int, mp: int, sms: int = 132):
        monkeypatch.setattr(split, "is_interpreter", lambda: False)
        monkeypatch.setattr(split, "_multiprocessors", lambda dev: sms)
        return split._settings(tc, bh, mp, "cuda")
    return settings


@pytest.mark.parametrize("tc", [1, 63, 64, 1000, 8192, 32768, 131072])
@pytest.mark.parametrize("bh", [1, 3, 8, 64, 1024])
def test_pieces_cover_the_rows_in_whole_tiles(gpu, tc: int, bh: int) -> None:
    st = gpu(tc, bh, 64)
    assert st["SPLIT"] % st["BN"] == 0 and st["SPLIT"] >= 4 * st["BN"]
    pieces = triton.cdiv(tc, st["SPLIT"])
    assert (pieces - 1) * st["SPLIT"] < tc <= pieces * st["SPLIT"]
    # About two programs per multiprocessor where the rows allow it (pieces rounded up to whole
    # tiles of 16 rows, at least 64: at most a fifth fewer), never pieces under 64 rows.
    if tc >= 64 * 2 * 132:
        assert 0.8 * 2 * 132 <= bh * pieces < 2 * 132 + 2 * bh


def test_default_shape_at_8k(gpu) -> None:
    st = gpu(8192, 3, 64)
    assert (st["BN"], st["SPLIT"], st["num_warps"], st["MMA"]) == (16, 96, 8, False)


def test_tensor_cores_past_64_slots_only(gpu) -> None:
    assert [gpu(8192, 8, mp)["MMA"] for mp in (32, 64, 128, 256)] == [False, False, True, True]


def test_no_pairs_does_not_divide_by_zero(gpu) -> None:
    assert gpu(8192, 0, 64)["SPLIT"] >= 64
