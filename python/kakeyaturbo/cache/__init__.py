"""The codec inside transformers' KV cache (needs torch and transformers: the ``eval`` extra).

- `codecs`: the :class:`StreamCodec` protocol, :class:`BlockCodec`, :class:`IdentityCodec`, and
  :func:`codec_for`, the one place a recipe becomes a codec;
- `prefix`: :func:`compress_cache`, the K and V of a filled ``DynamicCache`` replaced by their
  decoded values in place (the EVAL.md protocol), with all-in bit counts;
- `generation`: :class:`KakeyaCache`, a ``Cache`` for ``model.generate`` that seals every full
  block through the codec and holds it as bytes;
- `rope`: RoPE of the model, removed from keys before a codec that wants them without it, and
  put back after decoding (bit-exact).
"""

from .codecs import BlockCodec, IdentityCodec, StreamCodec, codec_for
from .generation import KakeyaCache, KakeyaLayer
from .prefix import compress_cache

__all__ = [
    "StreamCodec",
    "BlockCodec",
    "IdentityCodec",
    "codec_for",
    "compress_cache",
    "KakeyaCache",
    "KakeyaLayer",
]
