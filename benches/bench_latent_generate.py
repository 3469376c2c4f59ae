"""Greedy generation through ``KakeyaCache`` on a model of multi-head latent attention, against
transformers' ``DynamicCache``, in the same run: decode tokens/s.

No MLA checkpoint installs offline, so the model is a random-weight ``DeepseekV2ForCausalLM`` of
DeepSeek-V2-Lite's attention and width (hidden 2048, 16 heads, kv_lora_rank 512, rotated key part
64, keys without RoPE and values 128 per head, vocabulary 102,400) with ``--layers`` layers and a
dense MLP (V2-Lite's first layer: 10,944 wide) in each; the time of a step does not depend on the
weights' values, its tokens are meaningless. The cache's codec is a calibrated recipe fitted on
the model's own latent rows (uniform statistics of three random windows; K the latent at 4 bits
whitened by its queries, V the rotated part at 3 bits; no sensitivity: for timing, not quality).
Per prompt length: ``DynamicCache`` (the model's own path: every cached latent expanded into each
head's key and value at every step, then SDPA), ``KakeyaCache`` attending over the codes (the
absorbed form, ``fast._attend_latent``) and, with ``--slow``, the same cache decoding its sealed
blocks (``fast=False``). Reported: decode tokens/s between the first and last generated token,
the tokens identical to the slow path's (the fast path's own check), bits per element held (blocks
of 128 tokens sealed; the staging rows raw in float32).

    .venv/bin/python benches/bench_latent_generate.py [--prompt-tokens 2048,4096] [--new-tokens 8]
        [--layers 2] [--slow] [--out bench-out]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch
import transformers

import bench_decode_attention as bda
from bench_generate import Clock
from kakeyaturbo import calibration, recipes
from kakeyaturbo.cache import KakeyaCache
from kakeyaturbo.calibration import ModelCodec

#: The recipe of the run: K (the latent) at 4 bits, V (the rotated part) at 3, one raw sink row.
RECIPE = recipes.Recipe(name="latent-bench", mode="calibrated", n_sink=1,
                        k=dict(bits=4, whiten="query"), v=dict(bits=3, whiten="output", center=False))


def model(layers: int) -> Any:
    cfg = transformers.DeepseekV2Config(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=10944, num_hidden_layers=layers, first_k_dense_replace=layers,
        vocab_size=102400, max_position_embeddings=16384)
    torch.manual_seed(0)
    return transformers.DeepseekV2ForCausalLM(cfg).eval()


def generate(m: Any, ids: torch.Tensor, cache: Any, n: int) -> Dict[str, Any]:
    clock = Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                         cache=cache, logits_processor=transformers.LogitsProcessorList([clock]))
    decode_s = clock.t[-1] - clock.t[0]
    return {"tokens": out[0, ids.shape[1]:].tolist(), "prefill_s": clock.t[0] - t0,
            "decode_tok_s": (len(clock.t) - 1) / decode_s, "wall_s": time.perf_counter() - t0}


def run(prompts: List[int], new: int, layers: int, slow: bool) -> List[Dict[str, Any]]:
    m = model(layers)
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, 102400, 256)) for _ in range(3)]
    codec = ModelCodec(calibration.collect(m, wins, n_sink=1, samples=64, weighting="uniform"), RECIPE)
    rows = []
    for p in prompts:
        ids = torch.from_numpy(g.integers(3, 102400, (1, p)))
        res = {"prompt": p, "new": new}
        if slow:
            res["slow"] = generate(m, ids, KakeyaCache(codec, model=m, block_size=128, fast=False), new)
        cache = KakeyaCache(codec, model=m, block_size=128)
        assert cache.fast, cache.fast_reason
        res["fast"] = generate(m, ids, cache, new)
        # Over every element a DynamicCache holds (float32 here); raw sink and staging rows as held.
        res["bits_per_element"] = 8 * cache.nbytes() / (cache.nbytes_uncompressed() / 4)
        res["dynamic"] = generate(m, ids, transformers.DynamicCache(config=m.config), new)
        if slow:
            same = [a == b for a, b in zip(res["fast"]["tokens"], res["slow"]["tokens"])]
            res["identical_to_slow"] = same.index(False) if False in same else len(same)
        rows.append(res)
        print(f"prompt {p}: " + ", ".join(f"{k} {res[k]['decode_tok_s']:.2f} tok/s"
                                           for k in ("dynamic", "fast", "slow") if k in res), flush=True)
    return rows


def markdown(res: Dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# Generation through the codes on a random-weight model of DeepSeek-V2-Lite's attention",
        "",
        f"{bda.machine(env)} | {res['layers']} "
        f"layers | {res['rows'][0]['new']} new tokens, greedy",
        "",
        "decode tokens/s (between the first and the last generated token); x = KakeyaCache / DynamicCache",
        "",
        "| prompt | DynamicCache | KakeyaCache (codes) | x | KakeyaCache fast=False | tokens = slow path's | bits/elem held |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        slow = r.get("slow")
        lines.append(
            f"| {r['prompt']} | {r['dynamic']['decode_tok_s']:.2f} | {r['fast']['decode_tok_s']:.2f} | "
            f"{r['fast']['decode_tok_s'] / r['dynamic']['decode_tok_s']:.1f} | "
            + ("-" if slow is None else f"{slow['decode_tok_s']:.2f}") + " | "
            + ("-" if slow is None else f"{r['identical_to_slow']}/{r['new']}")
            + f" | {r['bits_per_element']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", default="2048,4096")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--slow", action="store_true", help="also the cache decoding its blocks (fast=False)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    rows = run([int(p) for p in args.prompt_tokens.split(",")], args.new_tokens, args.layers, args.slow)
    res = {"environment": bda.environment(), "layers": args.layers, "rows": rows}
    bda.write(Path(args.out), "latent_generate", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
