"""Would a lossless entropy-coding stage shrink a compressed prefix on disk by at least 5 %?

Measured on real calibrated blobs: the prefix K and V of evaluation windows of a model (default:
the embedded SmolLM2-135M), coded by the calibrated recipes (statistics from the calibration
cache, gathered on the first run), one blob per (layer, kv-head, stream) as the cache seals
them. Per recipe it prints the bytes of the blobs and what each lossless coder leaves of them:

- ``zlib`` / ``lzma`` (standard library) and ``zstd`` (the ``zstandard`` package, when it can be
  imported) over the blobs as stored, each blob alone and all blobs as one stream;
- ``zstd split``: the codes unpacked to one byte per index and laid out component by component
  (each component's indices of all rows together), plus the scales' mantissas, then zstd: a
  transform that lets a byte-oriented coder see the skewed distribution of each component;
- ``entropy bound``: the empirical order-0 entropy of each component's indices (its own table
  per component: what an ideal static arithmetic or rANS coder would reach, tables not counted)
  plus the rest of the blob as stored. No coder of the indices taken one at a time does better.

Usage: ``python benches/bench_entropy.py [--model PATH] [--windows 4] [--ctx 1024] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))


def entropy_bits(idx: np.ndarray) -> float:
    """Order-0 entropy (bits) of every column of ``idx [n, m]``, each with its own table."""
    total = 0.0
    for j in range(idx.shape[1]):
        _, counts = np.unique(idx[:, j], return_counts=True)
        p = counts / counts.sum()
        total += -float((counts * np.log2(p)).sum())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--recipes", default="calibrated-4bit,calibrated-3bit,calibrated-2bit")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from kakeyaturbo import assets, recipes
    from kakeyaturbo.cache.codecs import to_numpy
    from kakeyaturbo.calibration import for_recipe
    from kakeyaturbo.eval import data, harness, model
    from kakeyaturbo.families import describe

    try:
        import zstandard
    except ImportError:
        zstandard = None
    model_path = Path(args.model) if args.model else assets.default_model()
    text_path = assets.default_text()
    m, tok = model.load(model_path)
    rope = describe(m).require_rope()
    wins = data.evaluation_windows(tok, text_path, args.windows, args.ctx)
    caches = []
    with torch.no_grad():
        for w in wins:
            caches.append(harness._forward(m, torch.tensor([w]))[1])
    out = {"model": model_path.name, "windows": len(wins), "ctx": args.ctx, "recipes": {}}
    for name in args.recipes.split(","):
        rec = recipes.load(name)
        stats, sens = for_recipe(rec, m, tok, model_path, text_path)
        codec = harness.codec_method(rec, m.config.num_hidden_layers, stats=stats, sensitivity=sens).codec
        blobs, idx_bits, rest_bytes, scale_bytes, split = [], 0.0, 0, 0, []
        for cache in caches:
            for i, layer in enumerate(cache.layers):
                for stream, t in (("k", layer.keys), ("v", layer.values)):
                    x = t[:, :, 1:]  # the sink row stays raw, as the recipes keep it
                    if stream == "k":
                        x = rope.layers[i].remove(x, torch.arange(1, t.shape[2]))
                    x = to_numpy(x)[0]
                    for h in range(x.shape[0]):
                        c = codec._codec(stream, i, h)
                        blob = codec.encode(stream, i, h, np.ascontiguousarray(x[h]))
                        parts = c.encode_parts(np.ascontiguousarray(x[h]))
                        idx = np.asarray(parts["indices"])
                        blobs.append(blob)
                        code_bytes = idx.shape[0] * c.row_bytes
                        idx_bits += entropy_bits(idx)
                        rest_bytes += len(blob) - code_bytes
                        scale = np.asarray(parts.get("scale_bits", np.zeros(0, np.uint16))).astype("<u2")
                        scale_bytes += scale.nbytes
                        split.append(np.ascontiguousarray(idx.T).tobytes() + scale.tobytes())
        raw = sum(len(b) for b in blobs)
        joined = b"".join(blobs)
        row = {"blob_bytes": raw, "blobs": len(blobs), "code_bytes": raw - rest_bytes,
               "scale_bytes": scale_bytes}
        t0 = time.perf_counter()
        row["zlib9_each"] = sum(len(zlib.compress(b, 9)) for b in blobs)
        row["zlib9_joined"] = len(zlib.compress(joined, 9))
        row["lzma_joined"] = len(lzma.compress(joined, preset=9))
        if zstandard is not None:
            z = zstandard.ZstdCompressor(level=19)
            row["zstd19_each"] = sum(len(z.compress(b)) for b in blobs)
            row["zstd19_joined"] = len(z.compress(joined))
            # codes and scale mantissas transformed and coded; headers and outliers as stored
            row["zstd19_split"] = len(z.compress(b"".join(split))) + rest_bytes - scale_bytes
        row["entropy_bound"] = int(np.ceil(idx_bits / 8)) + rest_bytes
        row["seconds"] = round(time.perf_counter() - t0, 1)
        row["saving_pct"] = {k: round(100 * (1 - v / raw), 2) for k, v in row.items()
                             if k not in ("blob_bytes", "blobs", "seconds", "code_bytes", "scale_bytes")
                             and isinstance(v, int)}
        out["recipes"][name] = row
        print(name, json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
