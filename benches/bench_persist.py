"""A compressed prefix on disk, on a real model: sizes and times of `KakeyaCache.save` / `.load`.

A prefix of `--prefix` tokens of the evaluation split of the default text goes through the model
into a `KakeyaCache` of each recipe (calibrated recipes from the cached calibration statistics,
gathered on first use); the cache is saved, loaded back (codec rebuilt from the file's recipe
and a Calibration of the same statistics) and greedy generation continues from both for
`--new-tokens` tokens. Prints per recipe: file bytes, the cache's held bytes and the file's
fixed overhead, bits per element of the file (over the K and V elements of the prefix), what a
bf16 `DynamicCache` holds, prefill / save / load seconds (load includes fitting the codec from
the calibration again, timed alone as `codec_fit_s`), and whether the continuations agree.

    .venv/bin/python benches/bench_persist.py [--recipes calibrated-4bit,calibrated-3bit] [--prefix 1025]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from kakeyaturbo import assets, recipes
from kakeyaturbo.cache import KakeyaCache, codec_for, persist
from kakeyaturbo.calibration import Calibration, ModelCodec, for_recipe
from kakeyaturbo.eval import data, harness
from kakeyaturbo.eval import model as model_mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--recipes", default="calibrated-4bit,calibrated-3bit")
    ap.add_argument("--prefix", type=int, default=1025, help="prefix tokens (1 sink + 2 blocks of 512)")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model_path = Path(args.model) if args.model else assets.default_model()
    text_path = assets.default_text()
    model, tok = model_mod.load(model_path, args.dtype)
    ids = torch.tensor(data.evaluation_windows(tok, text_path, 1, args.prefix + 1)[:1])
    prefix = ids[:, :args.prefix]
    cfg = model.config
    kv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elems = 2 * cfg.num_hidden_layers * kv * d * args.prefix
    out = {"model": model_path.name, "prefix": args.prefix, "block_size": args.block_size,
           "dtype": args.dtype, "bf16_dynamic_cache_bytes": 2 * elems, "recipes": {}}
    tmp = Path(tempfile.mkdtemp())
    for name in args.recipes.split(","):
        rec = recipes.load(name)
        stats, sens = for_recipe(rec, model, tok, model_path, text_path)
        t0 = time.perf_counter()
        codec = (ModelCodec(stats, rec, sensitivity=sens) if rec.mode == "calibrated"
                 else codec_for(rec))
        t_fit = time.perf_counter() - t0
        cache = KakeyaCache(codec, model=model, block_size=args.block_size, n_sink=rec.n_sink,
                            boundary=rec.boundary_layers, streams=rec.streams)
        t0 = time.perf_counter()
        with torch.no_grad():
            harness._forward(model, prefix, cache)
        t_prefill = time.perf_counter() - t0
        path = tmp / f"{name}.kkpfx"
        t0 = time.perf_counter()
        cache.save(path)
        t_save = time.perf_counter() - t0
        cal = Calibration.for_model(model, stats, sens) if rec.mode == "calibrated" else None
        t0 = time.perf_counter()
        loaded = KakeyaCache.load(path, model, calibration=cal)
        t_load = time.perf_counter() - t0
        mem = cache.memory()
        size = path.stat().st_size
        conts = []
        for c in (cache, loaded):
            with torch.no_grad():
                seq = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     do_sample=False, cache=c, pad_token_id=0)
            conts.append(seq[0, ids.shape[1]:].tolist())
        row = {"file_bytes": size, "held_bytes": mem["blobs"] + mem["sink"] + mem["staging"],
               "blob_bytes": mem["blobs"], "raw_bytes": mem["sink"] + mem["staging"],
               "overhead_bytes": persist.overhead(path), "file_bits_per_element": 8 * size / elems,
               "x_vs_bf16": 2 * elems / size, "prefill_s": round(t_prefill, 2),
               "save_s": round(t_save, 3), "load_s": round(t_load, 3), "codec_fit_s": round(t_fit, 2),
               "continuations_equal": conts[0] == conts[1]}
        out["recipes"][name] = row
        print(name, json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
