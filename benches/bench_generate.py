"""Greedy generation through `KakeyaCache` against transformers' `DynamicCache` on a real model.

A prompt of Wikipedia summaries (evaluation split) and a request to summarise them goes through
`model.generate` twice per recipe: with an uncompressed `DynamicCache` and with a `KakeyaCache`
that seals every `--block-size` tokens through the recipe's codec (calibrated recipes use the
cached calibration statistics, collected on first use). Prints, per recipe, the bytes held
(sealed blobs, raw sink and staging rows) against a bf16 cache, all-in bits per element, the
number of generated tokens identical to the uncompressed run before the first difference,
wall time, and both continuations.

    .venv/bin/python benches/bench_generate.py [--model hard-case] [--recipes calibrated-4bit]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, List

import torch
import transformers

from kakeyaturbo import assets, calibration, recipes
from kakeyaturbo.cache import KakeyaCache, codec_for
from kakeyaturbo.calibration import corpus
from kakeyaturbo.eval import model as model_mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file, or 'hard-case'")
    ap.add_argument("--recipes", default="calibrated-4bit,calibrated-3bit")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    model_path = (assets.hard_case_model() if args.model == "hard-case"
                  else Path(args.model) if args.model else assets.default_model())
    text_path = assets.default_text()
    model, tok = model_mod.load(model_path)
    _, ev = corpus.split(corpus.load_articles(text_path))
    text = ""
    for t in ev:
        text += t + "\n\n"
        if len(tok.encode(text, add_special_tokens=False)) > args.prompt_tokens:
            break
    msgs = [{"role": "user", "content": text + "Summarize the text above in a few sentences."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    n0 = ids.shape[1]
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0

    def gen(cache: Any) -> Any:
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, cache=cache,
                                 pad_token_id=pad)
        return out[0, n0:], time.perf_counter() - t

    ref, t_ref = gen(transformers.DynamicCache(config=model.config))
    rows: List[dict] = []
    for name in args.recipes.split(","):
        rec = recipes.load(name)
        stats, sens = calibration.for_recipe(rec, model, tok, model_path, text_path)
        codec = codec_for(rec, stats=stats, sensitivity=sens)
        cache = KakeyaCache(codec, model=model, block_size=args.block_size, n_sink=rec.n_sink,
                            boundary=rec.boundary(model.config.num_hidden_layers),
                            streams=rec.streams)
        out, t_k = gen(cache)
        n = min(len(out), len(ref))
        same = int((out[:n] == ref[:n]).int().cumprod(0).sum())
        mem = cache.memory()
        elems = cache.nbytes_uncompressed() // 4  # float32 storage on the CPU
        raw_elems = (mem["sink"] + mem["staging"]) // 4
        bits = 8 * mem["blobs"] + 16 * raw_elems
        rows.append({"recipe": rec.name, "block_size": args.block_size, "tokens": cache.get_seq_length(),
                     "blob_bytes": mem["blobs"], "raw_elements": raw_elems,
                     "bits_per_element": bits / elems, "ratio_vs_bf16": 16 * elems / bits,
                     "identical_tokens": same, "new_tokens": len(out), "seconds": t_k,
                     "seconds_dynamic_cache": t_ref,
                     "text": tok.decode(out, skip_special_tokens=True)})
    print(f"{model_path.name} | prompt {n0} tokens | {args.new_tokens} new | block {args.block_size}")
    print("| recipe | bits/elem | x vs bf16 | identical tokens | s (KakeyaCache) | s (DynamicCache) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['bits_per_element']:.2f} | {r['ratio_vs_bf16']:.2f} | "
              f"{r['identical_tokens']}/{r['new_tokens']} | {r['seconds']:.1f} | {r['seconds_dynamic_cache']:.1f} |")
    print("\nDynamicCache:", tok.decode(ref, skip_special_tokens=True))
    for r in rows:
        print(f"\n{r['recipe']}:", r["text"])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"generate-{model_path.stem}.json"
    path.write_text(json.dumps({"model": model_path.name, "prompt_tokens": n0, "rows": rows,
                                "reference_text": tok.decode(ref, skip_special_tokens=True)},
                               indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
