"""The codec inside transformers' KV cache (needs torch and transformers: the ``eval`` extra).

- `codecs`: the :class:`StreamCodec` protocol, :class:`BlockCodec`, :class:`IdentityCodec`, and
  :func:`codec_for`, the one place a recipe becomes a codec;
- `prefix`: :func:`compress_cache`, the K and V of a filled ``DynamicCache`` replaced by their
  decoded values in place (the EVAL.md protocol), with all-in bit counts;
- `layer`: :class:`KakeyaLayer`, one layer of sink rows, sealed blocks held as bytes and staging
  rows, full-attention or sliding-window;
- `generation`: :class:`KakeyaCache`, a ``Cache`` for ``model.generate`` built of them;
- `persist`: a filled :class:`KakeyaCache` saved to one file and loaded in another process
  (:meth:`KakeyaCache.save` / :meth:`KakeyaCache.load`);
- `rope`: RoPE of the model's keys per layer, removed before a codec that wants them without it
  and put back after decoding (bit-exact; :mod:`kakeyaturbo.families.rope`).
"""

from .._extras import require

require("kakeyaturbo.cache")  # before torch is imported: name the extra, not the module

from .codecs import BlockCodec, IdentityCodec, StreamCodec, codec_for
from .generation import KakeyaCache
from .layer import KakeyaLayer
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
