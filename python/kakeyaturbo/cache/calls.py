"""Around every forward call of a model through a :class:`~kakeyaturbo.cache.KakeyaCache`
(:func:`watch_calls`): the checks before the layers run, the snapshot a refused call is rolled
back to, the positions handed to the cache's position store, the rows an assistant drafts from."""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

import torch

from ..errors import InvalidInputError
from .fast import TAG
from .positions import Positions, watch_rotary
from .rope import layer_ropes


def held_shared_rows(result: Any) -> None:
    """Gemma 4's assistant drafts from the K/V the main model's forward hands back
    (``shared_kv_states``, asked for with ``return_shared_kv_states=True``): the tensors its
    attention read, which through the codes are only the call's own rows, tagged with their
    layer. Those become the rows the layer holds, its sealed blocks decoded (a sliding layer's
    last ``window - 1``), in place in ``result``."""
    shared = getattr(result, "shared_kv_states", None)
    if shared is None:
        return
    for key in list(shared.keys()):
        rows = shared[key]
        layer = getattr(rows[0], TAG, None) if isinstance(rows, tuple) and rows else None
        if layer is not None:
            shared[key] = (layer.keys, layer.values)


def watch_calls(model: Any, cache: Any) -> None:
    """Around every forward call of ``model`` through ``cache``. Before the layers run: refuses
    (InvalidInputError) a call with no new token on a filled cache, a first call on a loaded
    one whose positions start within the prefix (``generate`` given ids shorter than the prefix
    the cache holds feeds none or their tail again, which would fail deep in the model or
    silently continue from the wrong tokens), the first call of assisted decoding on a cache
    that holds tokens (transformers 5.25 feeds them again:
    :meth:`KakeyaCache.activate_past_recording`), and a call on a cache a refused call left
    unusable; ends past recording where no crop answered the last call (no draft is checked
    any more: ``KakeyaCache.end_past_recording``); hands the call's ``position_ids`` to the
    cache's position store (some families, GPT-NeoX, do not forward them to the cache), and the
    multimodal positions the model's
    rotary modules are called with (:func:`~kakeyaturbo.cache.positions.watch_rotary`); takes a
    snapshot of the layers. After: a call that raised (a later layer refused its rows, say) is
    rolled back, so that the cache is as it was; a loaded prefix is continued only once a call
    went through; the K/V rows the call hands back for an assistant are the layers' whole rows
    (:func:`held_shared_rows`). The hooks hold the cache weakly and go when the cache does."""
    ref = weakref.ref(cache)

    def ours(kwargs: Dict[str, Any]) -> Any:
        c = ref()
        return c if c is not None and (kwargs.get("cache") is c or kwargs.get("past_key_values") is c) else None

    def before(_module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        c = ours(kwargs)
        if c is None:
            return
        if c._broken is not None:
            raise InvalidInputError(c._broken)
        if c.draft_pending:  # no crop answered the last call: no draft is checked any more
            c.end_past_recording()
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        p = kwargs.get("position_ids")
        p = p if isinstance(p, torch.Tensor) and p.ndim == 2 else None
        empty = isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] == 0
        resume = getattr(c, "_resume", None)
        assist, c._assist_from = getattr(c, "_assist_from", None), None
        mask = kwargs.get("attention_mask")
        if assist and p is not None and _goes_back(p, assist, *(resume or (assist, None)), mask):
            c.end_past_recording()  # as it was before transformers turned it on
            raise InvalidInputError(
                "transformers' assisted decoding (assistant_model=, prompt_lookup_num_tokens=, use_mtp=True) feeds "
                f"the whole sequence again at its first call, the {assist} tokens the cache holds included, which "
                "it would then hold and attend to twice (DynamicCache does, and goes on from the wrong rows): give "
                "assisted decoding a cache that holds no tokens, or continue this one without drafts")
        if empty or (resume is not None and p is not None):
            held = c.get_seq_length()
            if held and (empty or _goes_back(p, held, *resume, mask)):
                raise InvalidInputError(
                    f"the ids do not continue the {held} tokens the cache holds (a prefix, e.g. loaded from a "
                    f"file): give ids that begin with those {held} tokens and go on past them")
        if c._positions is not None:  # (positions counted on from those held where not given)
            q = x.shape[1] if isinstance(x, torch.Tensor) and x.ndim >= 2 else 0
            c._positions.expect(p, c.get_seq_length() + q - 1)
        c._forward_ids = p
        c._undo = c._snapshot()

    def after(_module: Any, _args: Any, kwargs: Dict[str, Any], result: Any) -> None:
        c = ours(kwargs)
        if c is None or c._undo is None:
            return
        if c._positions is not None:
            c._positions.end_pass()
        undo, c._undo = c._undo, None
        c._forward_ids = None
        if result is None:  # the call raised (torch runs this hook then with no result)
            c._roll_back(undo)
        else:
            c._resume = None
            held_shared_rows(result)

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True, always_call=True)]
    weakref.finalize(cache, lambda: [h.remove() for h in handles])
    if cache._positions is not None:  # inside a call of the cache's: its position store

        def live() -> Optional[Positions]:
            c = ref()
            return c._positions if c is not None and c._undo is not None else None

        watch_rotary([r.module for r in layer_ropes(cache.rope) if r.multimodal], live, cache)


def _goes_back(p: torch.Tensor, held: int, seen: int, last: Optional[torch.Tensor],
               mask: Any = None) -> bool:
    """Whether the first call on a loaded cache (``seen`` tokens) starts at or before a position
    it holds: ``generate`` given ids shorter than the prefix feeds their tail again. Each row's
    last position is ``last`` where the file stored positions, else counted from the call's
    ``[B, >= seen]`` attention ``mask`` as ``generate`` counts positions (a left-padded row's
    padding takes none), else ``seen - 1``."""
    if held != seen or not p.numel():
        return False
    first = p[:, 0].cpu()
    if last is not None:
        floor = last.to(first.dtype)
    elif isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[1] > seen:
        floor = mask[:, :seen].cpu().to(first.dtype).sum(dim=1) - 1
    else:
        floor = torch.full_like(first, seen - 1)
    return floor.shape == first.shape and bool((first <= floor).any())
