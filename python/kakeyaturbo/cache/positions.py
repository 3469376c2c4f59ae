"""The RoPE positions of the tokens a generation cache holds (:class:`Positions`, shared by
its layers) and the ``position_ids`` a layer's ``update`` receives (:func:`position_ids`)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch


class Positions:
    """The RoPE position of every token the cache saw, ``int32 [batch, T]``, shared by all
    layers (kept only when the codec codes keys without RoPE). ``pending`` holds the
    ``position_ids`` of the forward call in progress when the model's own forward gave them
    (families whose attention does not forward them to the cache: GPT-NeoX)."""

    def __init__(self) -> None:
        self.pos: Optional[torch.Tensor] = None
        self.pending: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 0 if self.pos is None else self.pos.shape[1]

    def record(self, start: int, q: int, batch: int, position_ids: Optional[torch.Tensor]) -> None:
        """Tokens ``start .. start+q`` of a layer's update; the first layer to see them records them."""
        have = len(self)
        if start + q <= have:
            return
        if start != have:
            raise RuntimeError(f"positions recorded up to {have}, a layer appends at {start}")
        if position_ids is None and isinstance(self.pending, torch.Tensor) and self.pending.shape[-1] == q:
            position_ids = self.pending
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
        self.pending = None


def position_ids(kwargs: Dict[str, Any], q: int) -> Optional[torch.Tensor]:
    """``position_ids`` ``[1 or batch, q]`` as the attention module forwards them to ``update``
    (most families pass ``kwargs=kwargs``), or None."""
    for d in (kwargs, kwargs.get("kwargs"), kwargs.get("cache_kwargs")):
        if isinstance(d, dict):
            p = d.get("position_ids")
            if isinstance(p, torch.Tensor) and p.ndim == 2 and p.shape[-1] == q:
                return p
    return None
