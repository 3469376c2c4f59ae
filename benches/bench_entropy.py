"""Would a lossless entropy-coding stage shrink a compressed prefix on disk by at least 5 %?

Measured on real calibrated blobs: the prefix K and V of evaluation windows of a model (default:
the embedded SmolLM2-135M), coded by the calibrated recipes (statistics from the calibration
cache, gathered on the first run), one blob per (layer, kv-head, stream) as the cache seals
them. Per recipe it prints the bytes of the blobs and what each lossless coder leaves of them:

- ``zlib`` / ``lzma`` (standard library) and ``zstd`` (the ``zstandard`` package, when it can be
  imported; levels 3 and 19) over the blobs as stored, each blob alone and all blobs as one
  stream: what a well-kept general-purpose library gives without touching the blobs;
- ideal static coders of the Lloyd-Max indices (an arithmetic or rANS coder would come within
  a fraction of a percent of them), headers, scales and outliers counted as stored and the
  tables themselves not counted: ``bound_width_tables`` (one table per bit width, pooled over
  every component of that width), ``bound_component_tables`` (one per (stream, layer, kv-head,
  component), pooled over the windows), ``bound_per_blob_tables`` (one per component of every
  blob: optimistic, a table fitted to the rows it codes). No coder of the indices taken one
  at a time does better than these.

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


def entropy_bits(idx: np.ndarray) -> float:
    """Order-0 entropy (bits) of every column of ``idx [n, m]``, each with its own table."""
    total = 0.0
    for j in range(idx.shape[1]):
        _, counts = np.unique(idx[:, j], return_counts=True)
        total += _entropy(counts)
    return total


def _entropy(counts: np.ndarray) -> float:
    """Bits of an ideal coder of symbols with these counts under their own frequencies."""
    counts = counts[counts > 0].astype(np.float64)
    return -float((counts * np.log2(counts / counts.sum())).sum())


def component_bits(bands) -> np.ndarray:
    """Bit width of every coded component, from the codec's ``(offset, width, bits)`` sub-bands."""
    m = max(o + w for o, w, _ in bands) if bands else 0
    out = np.zeros(m, dtype=np.int64)
    for o, w, b in bands:
        out[o:o + w] = b
    return out


def measure(blobs, rest_bytes, scale_bytes, per_blob_bits, per_component, per_width, zstandard):
    """Sizes (bytes) of the blobs as stored and what each lossless coder or bound leaves."""
    raw = sum(len(b) for b in blobs)
    joined = b"".join(blobs)
    code_bytes = raw - rest_bytes
    row = {"blob_bytes": raw, "blobs": len(blobs), "code_bytes": code_bytes,
           "other_bytes": rest_bytes, "scale_bytes": scale_bytes}
    t0 = time.perf_counter()
    row["zlib9_each"] = sum(len(zlib.compress(b, 9)) for b in blobs)
    row["zlib9_joined"] = len(zlib.compress(joined, 9))
    row["lzma_joined"] = len(lzma.compress(joined, preset=9))
    if zstandard is not None:
        z3, z19 = zstandard.ZstdCompressor(level=3), zstandard.ZstdCompressor(level=19)
        row["zstd3_each"] = sum(len(z3.compress(b)) for b in blobs)
        row["zstd19_each"] = sum(len(z19.compress(b)) for b in blobs)
        row["zstd19_joined"] = len(z19.compress(joined))
    # Ideal static coders of the indices (headers, scales and outliers as stored; the tables
    # themselves not counted):
    # - one table per bit width, pooled over every component of that width of every blob;
    row["bound_width_tables"] = int(np.ceil(sum(_entropy(c) for c in per_width.values()) / 8)) + rest_bytes
    # - one table per (stream, layer, kv-head, component), pooled over the windows;
    row["bound_component_tables"] = int(np.ceil(
        sum(entropy_bits(np.concatenate(v)) for v in per_component.values()) / 8)) + rest_bytes
    # - one table per component of every blob (optimistic: ~1000 rows per table, fitted to them).
    row["bound_per_blob_tables"] = int(np.ceil(per_blob_bits / 8)) + rest_bytes
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["saving_pct"] = {k: round(100 * (1 - v / raw), 2) for k, v in row.items()
                         if k.startswith(("zlib", "lzma", "zstd", "bound"))}
    return row


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
        print("zstandard is not installed: its rows are left out (pip install zstandard)", file=sys.stderr)
    model_path = Path(args.model) if args.model else assets.default_model()
    text_path = assets.default_text()
    m, tok = model.load(model_path)
    rope = describe(m).require_rope()
    wins = data.evaluation_windows(tok, text_path, args.windows, args.ctx)
    caches = []
    with torch.no_grad():
        for w in wins:
            caches.append(harness._forward(m, torch.tensor([w]))[1])
    out = {"model": model_path.name, "text": text_path.name, "windows": len(wins), "ctx": args.ctx,
           "zstandard": getattr(zstandard, "__version__", None), "recipes": {}}
    for name in args.recipes.split(","):
        rec = recipes.load(name)
        stats, sens = for_recipe(rec, m, tok, model_path, text_path)
        codec = harness.codec_method(rec, m.config.num_hidden_layers, stats=stats, sensitivity=sens).codec
        blobs, per_blob_bits, rest_bytes, scale_bytes = [], 0.0, 0, 0
        per_component: dict = {}
        per_width: dict = {}
        for cache in caches:
            for i, layer in enumerate(cache.layers):
                for stream, t in (("k", layer.keys), ("v", layer.values)):
                    x = t[:, :, rec.n_sink:]  # the sink rows stay raw, as the recipes keep them
                    if stream == "k" and codec.pre_rope_keys:
                        x = rope.layers[i].remove(x, torch.arange(rec.n_sink, t.shape[2]))
                    x = to_numpy(x)[0]
                    for h in range(x.shape[0]):
                        c = codec._codec(stream, i, h)
                        rows = np.ascontiguousarray(x[h])
                        blob = codec.encode(stream, i, h, rows)
                        parts = c.encode_parts(rows)
                        idx = np.asarray(parts["indices"])
                        blobs.append(blob)
                        per_blob_bits += entropy_bits(idx)
                        per_component.setdefault((stream, i, h), []).append(idx)
                        widths = component_bits(c.bands)
                        for b in np.unique(widths):
                            cnt = np.bincount(idx[:, widths == b].ravel(), minlength=1 << int(b))
                            per_width[int(b)] = per_width.get(int(b), 0) + cnt
                        rest_bytes += len(blob) - idx.shape[0] * c.row_bytes
                        scale_bytes += np.asarray(parts.get("scale_bits", np.zeros(0, np.uint16))).size * 2
        row = measure(blobs, rest_bytes, scale_bytes, per_blob_bits, per_component, per_width, zstandard)
        row["bits_histogram"] = {str(b): int(c.sum()) for b, c in sorted(per_width.items())}
        out["recipes"][name] = row
        print(name, json.dumps(row), flush=True)
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def table(out) -> str:
    """The Markdown table: per recipe, bytes as stored and the saving of each coder and bound."""
    keys = [k for r in out["recipes"].values() for k in r["saving_pct"]]
    keys = list(dict.fromkeys(keys))
    lines = [f"{out['model']} | {out['windows']} windows x ctx {out['ctx']} | blobs as the cache seals them",
             "", "| recipe | blob bytes | " + " | ".join(f"{k} %" for k in keys) + " |",
             "|---|---|" + "---|" * len(keys)]
    for name, r in out["recipes"].items():
        lines.append(f"| {name} | {r['blob_bytes']} | "
                     + " | ".join(f"{r['saving_pct'].get(k, float('nan')):.2f}" for k in keys) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
