"""In-place prefix compression of a filled cache (the EVAL.md protocol), with all-in bit counts;
full-attention and sliding-window layers alike."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import BaseQuantizedLayer, DynamicLayer

from ..codec import _checks
from ..errors import InvalidInputError, InvalidParameterError, KakeyaError
from ..families import describe
from ..families.layout import COMPRESSOR, text_config
from .codecs import (RAW_BITS, STREAMS, StreamCodec, boundary_layers, check_codec, check_streams, codes_layer,
                     decode_rows, encode_rows, to_numpy, wants_rope)
from .padding import first_real
from .rope import layer_rope, layer_ropes, rope_for


def held_span(layer: Any) -> Tuple[int, int]:
    """``(first, held)``: the position of the first token a cache layer holds and how many it
    holds. A full-attention layer holds every token (``first = 0``); a sliding-window layer
    (``DynamicSlidingWindowLayer``) the last ``window - 1`` of the ``get_seq_length()`` it saw."""
    keys = getattr(layer, "keys", None)
    held = 0 if keys is None or keys.numel() == 0 else int(keys.shape[-2])
    seen = int(layer.get_seq_length()) if hasattr(layer, "get_seq_length") else held
    return max(seen - held, 0), held


def _positions(positions: Any, layers: Sequence[Any], rope: Any) -> torch.Tensor:
    """``positions`` checked before any layer changes: integers, ``[T]``, ``[batch, T]`` or (a
    model whose ``rope`` is multimodal) ``[3, batch, T]``, ``T`` covering every token a layer
    holds (TypeError, InvalidInputError)."""
    try:
        pos = torch.as_tensor(positions)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"positions must be integers, got {type(positions).__name__} ({e})") from None
    if pos.dtype == torch.bool or pos.is_floating_point() or pos.is_complex():
        raise TypeError(f"positions must be integers, got dtype {pos.dtype}")
    held = [(held_span(layer), layer.keys.shape[0]) for layer in layers
            if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    need = max((first + n for (first, n), _ in held), default=0)
    batch = held[0][1] if held else None
    ropes = layer_ropes(rope)
    grid = bool(ropes) and all(r.multimodal for r in ropes)
    if (pos.ndim not in (1, 2, 3) or pos.shape[-1] < need or (pos.ndim >= 2 and pos.shape[-2] != batch)
            or (pos.ndim == 3 and (pos.shape[0] != 3 or not grid))):
        also = f" or [3, batch={batch}, T]" if grid else ""
        raise InvalidInputError(f"positions must be [T] or [batch={batch}, T]{also} with T >= {need} (every "
                                f"token the cache saw), got shape {tuple(pos.shape)}")
    return pos


def sink_rows(n_sink: int, first: int, held: int) -> int:
    """How many of the ``held`` rows starting at position ``first`` are sink tokens (positions
    ``< n_sink``): a sliding layer that no longer holds position 0 has none."""
    return min(max(n_sink - first, 0), held)


def _check_layers(cache: Any) -> list:
    """The layers of ``cache`` if it is one :func:`compress_cache` can change in place: every
    layer a transformers ``DynamicLayer`` (full attention, ``DynamicSlidingWindowLayer``, a
    hybrid's attention layer) or a layer without K/V rows (a hybrid's recurrent or convolution
    state, ``DummyLayer``); TypeError otherwise, naming the layer class. A ``StaticCache`` (its
    tensors hold ``max_cache_len`` slots, the empty ones too), a ``QuantizedCache`` (its keys are
    only the recent rows) and a ``KakeyaCache`` (its keys are a computed view; it is coded as it
    fills) are refused."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"cache must be a filled transformers cache (a DynamicCache, with .layers), got "
                        f"{type(cache).__name__}")
    for i, layer in enumerate(layers):
        if getattr(layer, "keys", None) is None and getattr(layer, "values", None) is None:
            continue  # no K/V rows: nothing to code, nothing changes
        if not isinstance(layer, DynamicLayer) or isinstance(layer, BaseQuantizedLayer):
            raise TypeError(
                f"compress_cache takes a filled transformers DynamicCache (layers DynamicLayer or "
                f"DynamicSlidingWindowLayer); layer {i} of this {type(cache).__name__} is a "
                f"{type(layer).__name__}, which it cannot change in place")
    return list(layers)


def _check_model(codec: StreamCodec, model: Any) -> None:
    """ModelMismatchError when ``codec`` (a calibrated ``ModelCodec``, or any codec with a
    ``check_model``) was made for another model than ``model``."""
    check = getattr(codec, "check_model", None)
    if model is not None and callable(check):
        check(model)


def _located(e: KakeyaError, where: str) -> KakeyaError:
    """``e`` as the same error type with ``where`` (layer, stream) in front of its message."""
    try:
        out = type(e)(f"{where}: {e}")
    except Exception:  # an error type that does not take one message: keep it as it is
        return e
    out.__dict__.update(e.__dict__)
    return out


def _check_finite(x: torch.Tensor, what: str, first: int) -> None:
    """InvalidInputError, ``what`` followed by the first NaN/infinity in ``x [B, H, T, D]`` (rows
    from position ``first``) and where it is."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        b, h, t, d = (int(v) for v in bad.nonzero()[0])
        raise InvalidInputError(f"{what} {float(x[b, h, t, d])} at batch row {b}, kv-head {h}, "
                                f"position {first + t}, column {d}; the cache is unchanged")


def entry_splits(model: Any) -> Dict[int, int]:
    """Per layer of compressed attention (DeepSeek V4), the channels of its entries without RoPE,
    which come first (:class:`~kakeyaturbo.families.LayerSpec` ``"compressed"``)."""
    return {s.index: s.head_dim for s in describe(model).layers if s.kind == "compressed"}


def cache_splits(cache: Any, model: Any, splits: Optional[Mapping[int, int]] = None) -> Mapping[int, int]:
    """Where the entries of each compressed-attention layer of ``cache`` split: ``splits``, else
    :func:`entry_splits` of ``model`` (read only when the cache holds such a layer);
    InvalidParameterError when such a layer has none, or one not inside its entries' width."""
    layers = getattr(cache, "layers", ())
    held = {i: e[COMPRESSOR] for i, e in enumerate(getattr(layer, "compressed_kv", None) for layer in layers)
            if isinstance(e, dict) and e.get(COMPRESSOR) is not None}
    if held and splits is None and model is not None:
        splits = entry_splits(model)
    for i, e in held.items():
        w = (splits or {}).get(i)
        if isinstance(w, bool) or not isinstance(w, int) or not 0 < w < e.shape[-1]:
            raise InvalidParameterError(
                f"layer {i} is compressed attention (DeepSeek V4): its entries are coded as keys (the channels "
                f"without RoPE) and values (the rotated ones); pass model= to find where they split, got {w!r}")
    return splits or {}


def _code(codec: StreamCodec, i: int, stream: str, t: torch.Tensor, s: int, first: int, r: Any, pos: Any,
          pending: list, pads: Optional[List[int]] = None) -> int:
    """Codes the rows of ``t`` (``[B, H, T, D]``, positions ``first ..``) after the first ``s``
    (RoPE ``r`` removed at ``pos`` first, where given), decodes them and queues the decoded rows
    for writing into ``t`` (``pending``); returns the bytes of the blobs. ``pads`` (a left-padded
    batch, :mod:`.padding`): each row's first ``s`` real tokens keep their raw rows, as a
    :class:`KakeyaCache` keeps them in its sink's places."""
    where = f"layer {i}, stream {stream!r}"
    x = t[:, :, s:]
    _check_finite(x, f"{where}: the rows to code hold", first + s)
    if r is not None:
        x = r.remove(x, pos)
    try:
        blobs = encode_rows(codec, stream, i, to_numpy(x))
        y = torch.from_numpy(decode_rows(codec, stream, i, blobs, t.shape[2] - s, t.shape[3])).to(t.device)
    except KakeyaError as e:
        raise _located(e, where) from e
    if r is not None:
        y = r.apply(y, pos)
    y = y.to(t.dtype)
    _check_finite(y, f"{where}: {codec!r}.decode returned", first + s)
    for b, p in enumerate(pads or ()):
        if p:  # positions max(p, s) .. p + s - 1, held from position s on
            y[b, :, max(p, s) - s:p] = t[b, :, max(p, s):p + s].to(y.device)
    pending.append((t, s, y.to("cpu")))
    return sum(len(blob) for row in blobs for blob in row)


def compress_cache(cache: Any, codec: StreamCodec, *, n_sink: int = 0, boundary: Sequence[int] = (),
                   streams: Sequence[str] = STREAMS, rope: Any = None, positions: Any = None,
                   model: Any = None, splits: Optional[Mapping[int, int]] = None) -> Dict[str, Any]:
    """Replaces the K and V of every compressed layer of ``cache`` by their decoded values, in place.

    ``cache``: a filled transformers ``DynamicCache`` (``cache.layers[i].keys`` / ``.values``,
    each ``[batch, kv_heads, T_i, head_dim]``; any batch size). A sliding-window layer holds only
    its last ``window - 1`` tokens (``T_i`` rows from position ``seen - T_i``); its rows are coded
    as held, and its state (the count of tokens seen) is left alone. Per layer, stream, batch row
    and kv-head, the rows after the sink go through ``codec.encode`` / ``codec.decode`` as one blob
    and the decoded rows are written back into the same tensors (in the tensors' dtype).
    Untouched, bit for bit: sink tokens (positions ``< n_sink`` still held; in a left-padded
    batch, ``positions`` ``[batch, T]`` given, also each row's first ``n_sink`` real tokens, which
    a :class:`KakeyaCache` keeps in its sink's places: :mod:`.padding`), the ``boundary``
    layers (negative indices count from the last layer), layers a codec that names its layers
    (``codec.layers``) was not fitted for, and streams not in ``streams``. A cross-attention
    layer's rows (an image's, mllama's; known from ``model``) have no sink. ``longrope`` (Phi-3.5,
    Phi-4-mini): a filled cache does not record which forward call computed each key, so every
    key of a layer is taken as rotated by the long factors when the layer holds a position at
    or past ``original_max_position_embeddings``, by the short ones otherwise: as one prefill
    call, or transformers' ``generate`` (which recomputes the sequence in one call when it
    crosses that limit), leaves them; a cache filled by calls on both sides of it is not (a
    :class:`KakeyaCache` records each token's factors).

    A compressed-attention layer (DeepSeek V4's CSA and HCA: the model's own layer, with
    ``compressed_kv``) holds its window as one tensor read as keys and values: it stays raw, as
    do the indexer's entries; the compressor's entries after the first ``n_sink`` are coded as
    :class:`~kakeyaturbo.cache.KakeyaCache` codes them (:mod:`~kakeyaturbo.cache.compressed`):
    their first ``splits[layer]`` channels (those without RoPE; default from ``model``) as keys,
    the rest as values. Each held tensor counts once in ``elements``. The indexer's keys of dynamic
    sparse attention (DeepSeek V3.2, GLM-5: ``indexer_keys``) stay raw and count in ``elements``
    too, as in :meth:`KakeyaCache.nbytes`.

    When ``codec.pre_rope_keys``, keys are handed over with RoPE removed and RoPE is re-applied to
    the decoded keys with each layer's own rotation: ``rope`` is the model's
    (:func:`kakeyaturbo.cache.rope.rope_for`; a plain ``positions -> (cos, sin)`` callable applies
    to every layer), or found from ``model``. ``positions`` (``[T]`` or ``[batch, T]`` over every
    token the cache saw; default ``0 .. T-1``) are the tokens' RoPE positions; for multimodal RoPE
    (Qwen2-VL and its successors) after an image, the ``[3, batch, T]`` the model rotated by (its
    ``get_rope_index``). With ``model``, a
    codec that has a ``check_model`` (a calibrated ``ModelCodec``) is checked against it first.

    Every layer is coded and decoded before any is written (the decoded rows wait on the CPU), so
    a refused call leaves the cache as it was.

    Returns ``bits`` (all-in: ``8 * len(blob)`` for every blob plus 16 bits per element kept
    uncompressed), ``elements`` (K and V elements the layers hold), ``bits_per_element``,
    ``blob_bytes``, ``raw_elements`` and ``compressed_layers``.
    Raises TypeError for a cache other than a ``DynamicCache`` of ``DynamicLayer`` /
    ``DynamicSlidingWindowLayer`` (a ``StaticCache``, ``QuantizedCache`` or ``KakeyaCache``);
    ModelMismatchError for a codec made for another model than ``model``; InvalidInputError
    naming the layer and stream for rows to code that hold NaN or infinity, or a codec that decodes
    them to NaN or infinity (codec errors are raised with the layer and stream in front);
    InvalidParameterError (a ValueError) on a bad stream name, a negative ``n_sink``, a codec that
    needs RoPE without ``rope`` or ``model`` (UnsupportedModelError when the model's RoPE cannot be
    removed), a compressed-attention layer without ``splits`` or ``model``, or a codec that
    decodes to the wrong shape.
    """
    check_codec(codec)
    layers = _check_layers(cache)
    streams = check_streams(streams)
    n_sink = _checks.integer(n_sink, "n_sink", 0)
    _check_model(codec, model)
    splits = cache_splits(cache, model, splits)
    skip = boundary_layers(boundary, len(layers))
    want_rope = wants_rope(codec, streams)
    if want_rope and rope is None:
        if model is None:
            raise InvalidParameterError(f"{codec!r} codes keys without RoPE: pass model= or rope=rope_for(model)")
        rope = rope_for(model)
    # An image's rows for cross-attention (mllama) are no tokens: no sink, as KakeyaCache holds them.
    cross = ({s.index for s in describe(model).layers if s.is_cross}
             if model is not None and getattr(text_config(model), "cross_attention_layers", None) else set())
    pads = None
    if positions is not None:
        positions = _positions(positions, layers, rope)
        if n_sink:
            pads = first_real(positions[0] if positions.ndim == 3 else positions,
                              positions.shape[-2] if positions.ndim > 1 else 0)
    elems = blob_bytes = raw = 0
    done, pending = [], []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if k is None or v is None or k.numel() == 0:
                continue
            span = None
            indexer = getattr(layer, "indexer_keys", None)  # dynamic sparse attention: held raw
            if isinstance(indexer, torch.Tensor):
                elems += indexer.numel()
                raw += indexer.numel()
            entries = getattr(layer, "compressed_kv", None)
            if isinstance(entries, dict):  # compressed attention (DeepSeek V4): K=V window, entries
                held = [k] + [t for name, t in entries.items() if name != COMPRESSOR and t is not None]
                elems += sum(t.numel() for t in held)
                raw += sum(t.numel() for t in held)
                e = entries.get(COMPRESSOR)
                if e is None or e.numel() == 0:
                    continue
                e = e.unsqueeze(1)  # [B, 1, entries, D]; the views below are written through
                k, v = e[..., :splits[i]], e[..., splits[i]:]
                span = (0, e.shape[2])
            elems += k.numel() + v.numel()
            if i in skip or not codes_layer(codec, i):
                raw += k.numel() + v.numel()
                continue
            done.append(i)
            first, n = span or held_span(layer)
            s = 0 if i in cross else sink_rows(n_sink, first, n)
            for stream, t in (("k", k), ("v", v)):
                b, h, _, d = t.shape
                if stream not in streams or s == n:
                    raw += t.numel()
                    continue
                raw += b * h * s * d
                r = layer_rope(rope, i) if stream == "k" and want_rope else None
                pos = None
                if r is not None:
                    pos = torch.arange(first + n) if positions is None else positions
                    pos = pos[..., first + s:first + n]
                blob_bytes += _code(codec, i, stream, t, s, first, r, pos, pending,
                                    pads if span is None and first == 0 and s == n_sink else None)
        # Every layer coded: only now is the cache changed.
        for t, s, y in pending:
            t[:, :, s:] = y
    bits = 8 * blob_bytes + RAW_BITS * raw
    return {
        "bits": bits,
        "elements": elems,
        "bits_per_element": bits / elems if elems else 0.0,
        "blob_bytes": blob_bytes,
        "raw_elements": raw,
        "compressed_layers": done,
    }
