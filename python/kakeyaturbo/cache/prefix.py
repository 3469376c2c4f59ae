"""In-place prefix compression of a filled cache (the EVAL.md protocol), with all-in bit counts."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from ..codec import _checks
from ..errors import InvalidParameterError
from .codecs import (RAW_BITS, STREAMS, StreamCodec, boundary_layers, check_streams, decode_rows,
                     encode_rows, to_numpy, wants_rope)
from .rope import RopeFn, apply_rope, unapply_rope


def compress_cache(cache: Any, codec: StreamCodec, *, n_sink: int = 0, boundary: Sequence[int] = (),
                   streams: Sequence[str] = STREAMS, rope: Optional[RopeFn] = None,
                   positions: Any = None) -> Dict[str, Any]:
    """Replaces the K and V of every compressed layer of ``cache`` by their decoded values, in place.

    ``cache``: a filled transformers ``DynamicCache`` (``cache.layers[i].keys`` / ``.values``,
    each ``[batch, kv_heads, T, head_dim]``; any batch size). Per layer, stream, batch row and
    kv-head, the rows ``n_sink:`` go through ``codec.encode`` / ``codec.decode`` as one blob and
    the decoded rows are written back into the same tensors (in the tensors' dtype). Untouched,
    bit for bit: the first ``n_sink`` tokens, the ``boundary`` layers (negative indices count
    from the last layer) and streams not in ``streams``.

    When ``codec.pre_rope_keys``, keys are handed over with RoPE removed and RoPE is re-applied
    to the decoded keys; ``rope`` (e.g. :func:`kakeyaturbo.cache.rope.rope_for` of the model) gives
    cos/sin for ``positions`` (``[T]`` or ``[batch, T]``; default ``0 .. T-1``).

    Returns ``bits`` (all-in: ``8 * len(blob)`` for every blob plus 16 bits per element kept
    uncompressed), ``elements`` (K and V elements over all layers), ``bits_per_element``,
    ``blob_bytes``, ``raw_elements`` and ``compressed_layers``.
    Raises InvalidParameterError (a ValueError) on a bad stream name, a negative ``n_sink``, a
    codec that needs RoPE without ``rope``, or a codec that decodes to the wrong shape.
    """
    streams = check_streams(streams)
    n_sink = _checks.integer(n_sink, "n_sink", 0)
    layers = list(cache.layers)
    skip = boundary_layers(boundary, len(layers))
    want_rope = wants_rope(codec, streams)
    if want_rope and rope is None:
        raise InvalidParameterError(f"{codec!r} codes keys without RoPE: pass rope=rope_for(model)")
    bits = elems = blob_bytes = raw = 0
    done = []
    with torch.no_grad():
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if k is None or v is None or k.numel() == 0:
                continue
            elems += k.numel() + v.numel()
            if i in skip:
                raw += k.numel() + v.numel()
                continue
            done.append(i)
            for stream, t in (("k", k), ("v", v)):
                b, h, n, d = t.shape
                s = min(n_sink, n)
                if stream not in streams or s == n:
                    raw += t.numel()
                    continue
                raw += b * h * s * d
                x = t[:, :, s:]
                cos = sin = None
                if stream == "k" and want_rope:
                    pos = torch.arange(n) if positions is None else torch.as_tensor(positions)
                    cos, sin = rope(pos)
                    cos = cos[..., s:, :].to(t.device)[:, None]
                    sin = sin[..., s:, :].to(t.device)[:, None]
                    x = unapply_rope(x, cos, sin)
                blobs = encode_rows(codec, stream, i, to_numpy(x))
                nb = sum(len(blob) for row in blobs for blob in row)
                blob_bytes += nb
                bits += 8 * nb
                y = torch.from_numpy(decode_rows(codec, stream, i, blobs, n - s, d)).to(t.device)
                if cos is not None:
                    y = apply_rope(y, cos.float(), sin.float())
                t[:, :, s:] = y.to(t.dtype)
    bits += RAW_BITS * raw
    return {
        "bits": bits,
        "elements": elems,
        "bits_per_element": bits / elems if elems else 0.0,
        "blob_bytes": blob_bytes,
        "raw_elements": raw,
        "compressed_layers": done,
    }
