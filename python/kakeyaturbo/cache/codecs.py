"""What the cache asks of a codec, the codecs it ships, and the ONE place a recipe becomes a codec.

- :class:`StreamCodec`, the small protocol every codec mode implements: ``encode`` one
  (stream, layer, kv-head) slice of float32 ``[T, D]`` rows into bytes and ``decode`` them back.
- :class:`BlockCodec` runs a per-block recipe; :class:`~kakeyaturbo.calibration.ModelCodec`
  (from statistics) a calibrated one; :class:`IdentityCodec` stores raw float32 (exact; for
  tests and as a reference). :func:`codec_for` picks and builds the right one for a recipe.
- Helpers shared by the prefix compression and the generation cache: blobs of a
  ``[B, H, T, D]`` tensor and back, stream and boundary checks.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any, Dict, FrozenSet, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from ..calibration import AttentionStats, ModelCodec, Sensitivity
from ..codec import _checks, perblock
from ..errors import CorruptDataError, InvalidInputError, InvalidParameterError
from ..recipes import Recipe

__all__ = ["STREAMS", "RAW_BITS", "StreamCodec", "IdentityCodec", "BlockCodec", "codec_for"]

STREAMS = ("k", "v")

#: Bits charged per element that is kept uncompressed (bf16, whatever the cache's dtype).
RAW_BITS = 16


class StreamCodec(Protocol):
    """What the cache asks of a codec. One call codes one (stream, layer, kv-head) slice.

    ``pre_rope_keys``: True when keys must be handed to :meth:`encode` without RoPE (and come
    back from :meth:`decode` without it); values never carry RoPE.
    """

    pre_rope_keys: bool

    def encode(self, stream: str, layer: int, head: int, x: np.ndarray) -> bytes:
        """``stream`` is ``"k"`` or ``"v"``; ``x`` is C-contiguous float32 ``[T, D]``, ``T >= 1``."""
        ...

    def decode(self, stream: str, layer: int, head: int, blob: bytes) -> np.ndarray:
        """The float32 ``[T, D]`` rows that :meth:`encode` turned into ``blob``."""
        ...


def check_stream(stream: str) -> str:
    """``stream`` if it is ``"k"`` or ``"v"``; else TypeError / InvalidParameterError."""
    return _checks.choice(stream, "stream", STREAMS)


class IdentityCodec:
    """Stores the rows as raw little-endian float32 after a 4-byte ``D`` header; decodes exactly."""

    def __init__(self, *, pre_rope_keys: bool = False) -> None:
        self.pre_rope_keys = _checks.boolean(pre_rope_keys, "pre_rope_keys")

    def __repr__(self) -> str:
        return f"IdentityCodec(pre_rope_keys={self.pre_rope_keys})"

    def encode(self, stream: str, layer: int, head: int, x: np.ndarray) -> bytes:
        check_stream(stream)
        x = np.asarray(x)
        if x.ndim != 2:
            raise InvalidInputError(f"x must be [T, D], got shape {x.shape}")
        return struct.pack("<I", x.shape[1]) + np.ascontiguousarray(x, dtype="<f4").tobytes()

    def decode(self, stream: str, layer: int, head: int, blob: bytes) -> np.ndarray:
        check_stream(stream)
        blob = _checks.buffer(blob)
        d = struct.unpack_from("<I", blob)[0] if len(blob) >= 4 else 0
        if d == 0 or (len(blob) - 4) % (4 * d):
            raise CorruptDataError(f"not an IdentityCodec blob ({len(blob)} bytes)")
        return np.frombuffer(blob, dtype="<f4", offset=4).reshape(-1, d).astype(np.float32)


class BlockCodec:
    """A recipe's per-block codec: ``encode_layer(x, **recipe.k)`` for keys, ``recipe.v`` for values.

    Each call makes one self-describing container (FORMAT.md), so a blob decodes on its own.
    ``pre_rope_keys``: code the keys without RoPE (the cache removes and re-applies it).
    ``threads``: passed to ``encode_layer``/``decode_layer`` (None: all cores).
    The recipe's ``boundary_layers``, ``n_sink`` and ``streams`` are cache settings, not codec
    ones: :meth:`KakeyaCache.from_recipe` and :func:`compress_cache` take them.
    """

    def __init__(self, recipe: Recipe, *, pre_rope_keys: bool = False, threads: Optional[int] = None) -> None:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a kakeyaturbo.recipes.Recipe, got {type(recipe).__name__}")
        if recipe.mode != "block":
            raise InvalidParameterError(f"recipe {recipe.name!r} is {recipe.mode}, not per-block: "
                                        "use codec_for(recipe, stats=...)")
        # The recipe's parameters were checked when it was made.
        self.recipe = recipe
        self.pre_rope_keys = _checks.boolean(pre_rope_keys, "pre_rope_keys")
        self.threads = _checks.threads(threads)

    def __repr__(self) -> str:
        return f"BlockCodec({self.recipe.name!r}, pre_rope_keys={self.pre_rope_keys})"

    def params(self, stream: str) -> Dict[str, Any]:
        """The codec keyword arguments of ``stream``."""
        return dict(self.recipe.k if check_stream(stream) == "k" else self.recipe.v)

    def encode(self, stream: str, layer: int, head: int, x: np.ndarray) -> bytes:
        return perblock.encode_layer(x, threads=self.threads, **self.params(stream))

    def decode(self, stream: str, layer: int, head: int, blob: bytes) -> np.ndarray:
        check_stream(stream)
        return perblock.decode_layer(blob, threads=self.threads)

    def encode_blocks(self, stream: str, layer: int, x: np.ndarray, block_rows: int) -> List[List[List[bytes]]]:
        """Every block of ``block_rows`` rows of float32 ``x [B, H, T, D]`` (``T`` a multiple):
        the blobs ``[block][batch][head]``, each :meth:`encode`'s, in one call over the codec's
        threads (:func:`~kakeyaturbo.codec.perblock.encode_blocks`)."""
        b, h = x.shape[:2]
        flat = perblock.encode_blocks(x.reshape(b * h, *x.shape[2:]), block_rows, threads=self.threads,
                                      **self.params(stream))
        return [[blobs[i * h:(i + 1) * h] for i in range(b)] for blobs in flat]

    def decode_blocks(self, stream: str, layer: int, blobs: Sequence[Sequence[Sequence[bytes]]],
                      block_rows: int) -> np.ndarray:
        """The blobs ``[block][batch][head]`` (at least one block, each of ``block_rows`` rows)
        decoded: float32 ``[B, H, blocks * block_rows, D]``, each block as :meth:`decode` gives
        it, in one call over the codec's threads (:func:`~kakeyaturbo.codec.perblock.decode_blocks`)."""
        check_stream(stream)
        b, h = len(blobs[0]), len(blobs[0][0])
        y = perblock.decode_blocks([[blob for row in block for blob in row] for block in blobs], block_rows,
                                   threads=self.threads)
        return y.reshape(b, h, *y.shape[1:])

    def decode_blocks_into(self, stream: str, layer: int, blobs: Sequence[Sequence[Sequence[bytes]]],
                           block_rows: int, out: np.ndarray, at: int) -> None:
        """:meth:`decode_blocks` into rows ``at ..`` of ``out``, float32 ``[B, H, rows, D]``
        C-contiguous (the rest of it left as it is;
        :func:`~kakeyaturbo.codec.perblock.decode_blocks_into`)."""
        check_stream(stream)
        flat = _checks.out_heads(out, len(blobs[0]), len(blobs[0][0]))
        perblock.decode_blocks_into([[blob for row in block for blob in row] for block in blobs], block_rows,
                                    flat, at, threads=self.threads)


def codec_for(recipe: Recipe, *, stats: Optional[AttentionStats] = None,
              sensitivity: Optional[Sensitivity] = None, threads: Optional[int] = None,
              pre_rope_keys: bool = False,
              groups: Sequence[Tuple[AttentionStats, Optional[Sensitivity]]] = ()) -> StreamCodec:
    """The codec of a recipe: a :class:`BlockCodec` for a per-block recipe (``pre_rope_keys``:
    code its keys without RoPE), a :class:`~kakeyaturbo.calibration.ModelCodec` fitted from
    ``stats`` (and ``sensitivity`` where the recipe asks) for a calibrated one (keys always
    without RoPE, as calibrated), and from each ``(stats, sensitivity)`` of ``groups`` for the
    model's other groups of K/V layers of one shape (Gemma 4's sliding layers), merged into one.
    ``threads``: for the core (None: all cores). The statistics of a model come from
    :func:`kakeyaturbo.calibration.for_recipe` (every group:
    :func:`~kakeyaturbo.calibration.for_recipe_groups`)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a kakeyaturbo.recipes.Recipe, got {type(recipe).__name__}")
    if recipe.mode == "block":
        return BlockCodec(recipe, pre_rope_keys=pre_rope_keys, threads=threads)
    if stats is None:
        raise InvalidParameterError(
            f"recipe {recipe.name!r} is calibrated: give its statistics "
            "(kakeyaturbo.calibration.for_recipe or AttentionStats.load)")
    parts = [(stats, sensitivity), *groups]
    return ModelCodec.merged([ModelCodec(st, recipe, threads=threads, sensitivity=se) for st, se in parts])


#: The library's own codecs (exactly these classes, not subclasses that may decode otherwise):
#: their decoded rows are not checked again (:func:`decode_rows`).
TRUSTED = (IdentityCodec, BlockCodec, ModelCodec)


def check_streams(streams: Sequence[str]) -> Tuple[str, ...]:
    """The stream names as a tuple (a single name allowed), each checked, none twice."""
    if isinstance(streams, str):
        streams = (streams,)
    if isinstance(streams, dict):
        raise TypeError(f"streams must be a sequence of names, got a dict {streams!r}")
    out = tuple(streams)
    for s in out:
        check_stream(s)
    if len(set(out)) != len(out):
        raise InvalidParameterError(f"streams {list(out)} name a stream twice")
    return out


def check_codec(codec: Any) -> None:
    """TypeError unless ``codec`` is an instance implementing :class:`StreamCodec` (``encode``
    and ``decode``; ``pre_rope_keys``, where it has one, a bool)."""
    if isinstance(codec, type):
        raise TypeError(f"codec must be a StreamCodec instance, got the class {codec.__name__}: "
                        f"pass {codec.__name__}(...)")
    for attr in ("encode", "decode"):
        if not callable(getattr(codec, attr, None)):
            raise TypeError(f"codec must implement StreamCodec ({attr} missing): {codec!r}")
    pre = getattr(codec, "pre_rope_keys", False)
    if not isinstance(pre, (bool, np.bool_)):
        raise TypeError(f"{codec!r}.pre_rope_keys must be a bool, got {type(pre).__name__} {pre!r}")


def boundary_layers(boundary: Sequence[int], num_layers: Optional[int]) -> FrozenSet[int]:
    """Layer indices, negative ones counted from the end (needs ``num_layers``). Where the layer
    count is known, an index outside ``[-num_layers, num_layers)`` is an InvalidParameterError
    (a recipe's indices for models of any depth are resolved by :meth:`Recipe.boundary` first);
    a ``boundary`` that is not a collection of ints, a TypeError naming it."""
    if isinstance(boundary, (str, bytes, Mapping, bool, np.bool_)) or not isinstance(boundary, Iterable):
        raise TypeError(f"boundary must be a sequence of layer indices (ints), got {type(boundary).__name__} "
                        f"{boundary!r}")
    out = set()
    for i in boundary:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"boundary layers must be ints, got {i!r}")
        i = int(i)
        if num_layers is not None and not -num_layers <= i < num_layers:
            raise InvalidParameterError(f"boundary layer {i} is out of range: boundary indices must be in "
                                        f"[-{num_layers}, {num_layers}) for {num_layers} layers")
        if i < 0:
            if num_layers is None:
                raise InvalidParameterError(
                    f"boundary layer {i} counts from the end: give the model or num_layers"
                )
            i += num_layers
        out.add(i)
    return frozenset(out)


def codes_layer(codec: StreamCodec, layer: int) -> bool:
    """Whether ``codec`` codes ``layer``: any layer, unless it names the layers it was fitted for
    (``codec.layers``: a calibrated codec of Gemma 4's full-attention layers leaves its sliding
    layers of another head size raw)."""
    layers = getattr(codec, "layers", None)
    return layers is None or layer in layers


def wants_rope(codec: StreamCodec, streams: Sequence[str]) -> bool:
    """Whether keys are compressed by a codec that codes them without RoPE."""
    return bool(getattr(codec, "pre_rope_keys", False)) and "k" in streams  # a bool: check_codec


def encode_rows(codec: StreamCodec, stream: str, layer: int, x: np.ndarray) -> List[List[bytes]]:
    """Blobs ``[batch][head]`` of float32 ``x [B, H, T, D]``."""
    out = []
    for b in range(x.shape[0]):
        row = []
        for h in range(x.shape[1]):
            blob = codec.encode(stream, layer, h, np.ascontiguousarray(x[b, h]))
            if not isinstance(blob, (bytes, bytearray)):
                raise TypeError(f"{codec!r}.encode must return bytes, got {type(blob).__name__}")
            row.append(bytes(blob))
        out.append(row)
    return out


def encode_blocks(codec: StreamCodec, stream: str, layer: int, x: np.ndarray, block: int) -> List[List[List[bytes]]]:
    """Blobs ``[block][batch][head]`` of float32 ``x [B, H, T, D]`` in blocks of ``block`` rows
    (``T`` a multiple): a calibrated or per-block codec codes them all in one call over its
    threads (:meth:`~kakeyaturbo.calibration.ModelCodec.encode_blocks`,
    :meth:`BlockCodec.encode_blocks`), any other codec block by block (:func:`encode_rows`)."""
    if isinstance(codec, (ModelCodec, BlockCodec)):
        return codec.encode_blocks(stream, layer, x, block)
    return [encode_rows(codec, stream, layer, x[:, :, j * block:(j + 1) * block])
            for j in range(x.shape[2] // block)]


def decode_blocks(codec: StreamCodec, stream: str, layer: int, blobs: List[List[List[bytes]]], t: int,
                  d: int) -> np.ndarray:
    """float32 ``[B, H, blocks * t, d]`` from the blobs ``[block][batch][head]`` (at least one
    block) of ``t`` rows each: a calibrated or per-block codec decodes them all in one call over
    its threads (:meth:`~kakeyaturbo.calibration.ModelCodec.decode_blocks`,
    :meth:`BlockCodec.decode_blocks`), any other codec block by block (:func:`decode_rows`)."""
    if isinstance(codec, (ModelCodec, BlockCodec)):
        y = codec.decode_blocks(stream, layer, blobs, t)
        if y.shape[-1] != d:
            raise InvalidParameterError(f"{codec!r} decodes rows of {y.shape[-1]} channels for stream "
                                        f"{stream!r}, layer {layer}; expected {d}")
        return y
    return np.concatenate([decode_rows(codec, stream, layer, b, t, d) for b in blobs], axis=2)


def decode_blocks_into(codec: StreamCodec, stream: str, layer: int, blobs: List[List[List[bytes]]], t: int,
                       out: np.ndarray, at: int) -> None:
    """:func:`decode_blocks` into rows ``at ..`` of ``out``, float32 ``[B, H, rows, d]``
    C-contiguous: a calibrated or per-block codec decodes straight into it
    (:meth:`~kakeyaturbo.calibration.ModelCodec.decode_blocks_into`,
    :meth:`BlockCodec.decode_blocks_into`), any other is copied in."""
    if isinstance(codec, (ModelCodec, BlockCodec)):
        codec.decode_blocks_into(stream, layer, blobs, t, out, at)
        return
    y = decode_blocks(codec, stream, layer, blobs, t, out.shape[-1])
    out[:, :, at:at + y.shape[2]] = y


def decode_rows(codec: StreamCodec, stream: str, layer: int, blobs: List[List[bytes]], t: int, d: int) -> np.ndarray:
    """float32 ``[B, H, t, d]`` from blobs ``[batch][head]``. The rows of a codec that is not
    one of the library's own (:data:`TRUSTED`, whose decoders give finite rows of finite input)
    are checked for finiteness: InvalidInputError naming the codec, stream, layer and head."""
    y = np.empty((len(blobs), len(blobs[0]) if blobs else 0, t, d), dtype=np.float32)
    check = type(codec) not in TRUSTED
    for b, row in enumerate(blobs):
        for h, blob in enumerate(row):
            r = np.asarray(codec.decode(stream, layer, h, blob))
            if r.shape != (t, d):
                raise InvalidParameterError(
                    f"{codec!r}.decode returned shape {r.shape} for stream {stream!r}, layer {layer}, "
                    f"head {h}; expected {(t, d)}"
                )
            if not check:
                y[b, h] = r
                continue
            if r.dtype.kind not in "fiu":
                raise InvalidInputError(f"{codec!r}.decode returned dtype {r.dtype} for stream {stream!r}, "
                                        f"layer {layer}, head {h}; expected float32")
            with np.errstate(over="ignore", invalid="ignore"):
                y[b, h] = r
            if not np.isfinite(y[b, h]).all():
                raise InvalidInputError(
                    f"{codec!r}.decode returned NaN or infinite values (or values past float32's range) "
                    f"for stream {stream!r}, layer {layer}, head {h}")
    return y


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A C-contiguous float32 numpy copy of a tensor on any device."""
    return x.detach().to("cpu", torch.float32).contiguous().numpy()
