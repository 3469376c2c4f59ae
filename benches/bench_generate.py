"""Greedy generation through `KakeyaCache` against transformers' `DynamicCache` on a real model.

A prompt of Wikipedia summaries (evaluation split) and a request to summarise them goes through
`model.generate` per prompt length: once with an uncompressed `DynamicCache` (the model's own
`sdpa` attention, the baseline, in the same run), then per recipe with a `KakeyaCache` that seals
every `--block-size` tokens through the recipe's codec (calibrated recipes use the cached
calibration statistics, collected on first use): attention over the codes (the fast path, for
calibrated recipes; keys coded before RoPE are synthesised and rotated per tile in the kernel) and, with `--slow`, the same cache decoding its
sealed blocks and attending over them (`fast=False`).

With ``--batch N`` the N sequences are generated together, row ``b``'s prompt built from the
articles from the ``b``-th on (so the rows differ in length and are left-padded to the longest,
as transformers batches prompts); decode tokens/s then count every row's tokens, and the
identical tokens and KL are taken per row against the same row of the baseline (summed and
averaged over the rows; the first divergences listed per row in the JSON).

Per run: prefill seconds (for a KakeyaCache, also over the DynamicCache's of the same run), decode
tokens/s (between the first and the last generated token, so the prompt is not counted), wall
seconds; per KakeyaCache run the bits per element held
(sealed blobs + raw sink and staging rows at 16 bits, over every element a `DynamicCache`
holds), the generated tokens identical to the DynamicCache's and to the slow path's before the
first difference, the mean KL divergence of their next-token distributions from the
DynamicCache's and the slow path's over the steps whose prefixes are still the same (up to and
including the first differing token), and a profile of a decode step (attention, cache update,
sealing, and the rest of the model: time inside the attention functions and the cache's `update`, summed over
the layers, per generated token; over the codes, the Rust kernel's share of attention in brackets,
the rest of it the Python around the kernel), and the same of the prefill (the first forward
call), its sealing split out with the keys' RoPE taken off in brackets. Prints a table and
writes JSON.

    .venv/bin/python benches/bench_generate.py \\
        --recipes benches/recipes/calibrated-3bit-ropeafter.toml --prompt-tokens 2000,8000 --slow
        [--synthesis bf16,f32] [--kernel-threads 1,2] [--repeats 3] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import transformers

from kakeyaturbo import assets, calibration, recipes
from kakeyaturbo.cache import KakeyaCache, codec_for
from kakeyaturbo.cache import fast as fast_mod
from kakeyaturbo.cache.layer import KakeyaLayer
from kakeyaturbo.codec.attention import LayerCodes, attention_kernel, attention_team
from kakeyaturbo.calibration import corpus
from kakeyaturbo.eval import model as model_mod
from kakeyaturbo.families.rope import LayerRope

HERE = Path(__file__).resolve().parent


class Clock(transformers.LogitsProcessor):
    """Records when each generated token's logits come out (after the prefill, then after each
    decode step)."""

    def __init__(self) -> None:
        self.t: List[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.t.append(time.perf_counter())
        return scores


class Profile:
    """Time spent inside the attention functions (and of it inside the Rust kernel's call), the
    caches' ``update``, the fast layers' sealing and (of it) their keys' RoPE taken off, summed,
    while open: in ``acc`` from the second generated token (decode steps only), in ``pre`` before
    (the prefill)."""

    KEYS = ("attention", "kernel", "update", "seal", "turn")

    def __init__(self) -> None:
        self.acc: Dict[str, float] = dict.fromkeys(self.KEYS, 0.0)
        self.pre: Dict[str, float] = dict.fromkeys(self.KEYS, 0.0)
        self.on = False
        self._undo: List[Callable[[], None]] = []

    def _timed(self, orig: Callable[..., Any], key: str) -> Callable[..., Any]:
        """``orig``, adding its wall time to ``acc[key]`` while the profile is on."""

        def timed(*a: Any, **kw: Any) -> Any:
            acc = self.acc if self.on else self.pre
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                acc[key] += time.perf_counter() - t

        return timed

    def _wrap(self, owner: Any, attr: str, key: str) -> None:
        orig = getattr(owner, attr, None)
        if orig is None:  # (an older package on PYTHONPATH, run for comparison: not timed apart)
            return
        setattr(owner, attr, self._timed(orig, key))
        self._undo.append(lambda: setattr(owner, attr, orig))

    def _wrap_item(self, table: Dict[str, Any], name: str, key: str) -> None:
        orig = table[name]
        table[name] = self._timed(orig, key)
        self._undo.append(lambda: table.__setitem__(name, orig))

    def __enter__(self) -> "Profile":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fast_mod.register()
        table = ALL_ATTENTION_FUNCTIONS._global_mapping
        for name in [n for n in ("sdpa", *fast_mod.NAMES.values()) if n in table]:
            self._wrap_item(table, name, "attention")
        self._wrap(transformers.DynamicCache, "update", "update")
        self._wrap(KakeyaCache, "update", "update")
        self._wrap(KakeyaLayer, "settle", "seal")
        self._wrap(LayerRope, "remove_rows", "turn")  # RoPE taken off keys coded before it, to seal them
        self._wrap(LayerCodes, "kernel_attend", "kernel")  # the Rust kernel's share of attention
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()


class LogProbs(transformers.LogitsProcessor):
    """Keeps each generated token's log-probabilities (after transformers' own processors: the
    end of text is forbidden before ``--new-tokens``)."""

    def __init__(self) -> None:
        self.steps: List[torch.Tensor] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.steps.append(torch.log_softmax(scores.float(), -1))  # [batch, vocab]
        return scores


def mean_kl(ref: List[torch.Tensor], other: List[torch.Tensor], upto: Optional[int]) -> float:
    """Mean KL(ref || other) over the steps whose prefixes are the same: every step up to and
    including the first divergent token ``upto`` (None: all); ``ref`` and ``other`` one batch
    row's log-probabilities per step."""
    n = min(len(ref), len(other)) if upto is None else min(upto + 1, len(ref), len(other))
    # Tokens a logits processor forbids (-inf in both: the end of text before
    # --new-tokens) carry no mass and are left out.
    kls = [float(torch.where(a > -torch.inf, a.exp() * (a - b), 0.0).sum())
           for a, b in zip(ref[:n], other[:n])]
    return sum(kls) / len(kls) if kls else float("nan")


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else (None if len(a) == len(b) else n)


def compare(ref: Dict[str, Any], r: Dict[str, Any]) -> Tuple[List[Optional[int]], int, float]:
    """Per batch row, the first token where ``r``'s greedy output leaves ``ref``'s (None where it
    never does); the tokens identical before it, summed over the rows; the mean over the rows of
    :func:`mean_kl` up to it."""
    ds, same, kls = [], 0, []
    for b in range(ref["tokens"].shape[0]):
        d = first_divergence(r["tokens"][b], ref["tokens"][b])
        ds.append(d)
        same += r["tokens"].shape[1] if d is None else d
        kls.append(mean_kl([x[b] for x in ref["logp"]], [x[b] for x in r["logp"]], d))
    return ds, same, sum(kls) / len(kls)


def recipe(name: str) -> recipes.Recipe:
    p = Path(name)
    if not p.exists() and (HERE / "recipes" / f"{name}.toml").exists():
        p = HERE / "recipes" / f"{name}.toml"
    return recipes.load(p if p.exists() else name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file, or 'hard-case'")
    ap.add_argument("--recipes", default="calibrated-3bit-ropeafter",
                    help="shipped names, files, or names under benches/recipes")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--prompt-tokens", default="2000,8000", help="comma-separated prompt lengths")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences generated together, each its own prompt of about --prompt-tokens "
                         "tokens (other articles first), left-padded to the longest")
    ap.add_argument("--slow", action="store_true", help="also run the decode-then-attend path")
    ap.add_argument("--synthesis", default="auto",
                    help="comma-separated syntheses of keys coded before RoPE for the codes path, each "
                         "as its own KakeyaCache row: auto (the cache's default, the default here), "
                         "bf16, i16, f32")
    ap.add_argument("--kernel-threads", default="",
                    help="comma-separated thread counts of the codes' attention kernel to run, each "
                         "as its own KakeyaCache row (default: the cache's default, all cores)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of the whole sequence (DynamicCache, then every KakeyaCache) per prompt "
                         "length, alternating; the table shows medians, each ratio taken within its run")
    ap.add_argument("--dtype", default="float32", choices=model_mod.DTYPES,
                    help="the model's dtype (both caches hold its rows in it)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    model_path = (assets.hard_case_model() if args.model == "hard-case"
                  else Path(args.model) if args.model else assets.default_model())
    text_path = assets.default_text()
    model, tok = model_mod.load(model_path, args.dtype)
    held = model.dtype.itemsize  # bytes per element a DynamicCache holds (the model's dtype)
    base = fast_mod.base_of(model) or model.config._attn_implementation
    _, ev = corpus.split(corpus.load_articles(text_path))
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    codecs = []
    for name in args.recipes.split(","):
        rec = recipe(name)
        stats, sens = calibration.for_recipe(rec, model, tok, model_path, text_path)
        codecs.append((rec, codec_for(rec, stats=stats, sensitivity=sens)))

    def prompt(n_tokens: int) -> Dict[str, torch.Tensor]:
        """``--batch`` chat prompts (row ``b`` from article ``b`` on), left-padded."""
        convs = []
        for b in range(args.batch):
            text = ""
            for t in ev[b:]:
                text += t + "\n\n"
                if len(tok.encode(text, add_special_tokens=False)) > n_tokens:
                    break
            convs.append([{"role": "user", "content": text + "Summarize the text above in a few sentences."}])
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        got = tok.apply_chat_template(convs, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True, padding=True)
        return {"input_ids": got["input_ids"], "attention_mask": got["attention_mask"]}

    def gen(inputs: Dict[str, torch.Tensor], cache: Any) -> Dict[str, Any]:
        clock, logp = Clock(), LogProbs()
        n0 = inputs["input_ids"].shape[1]
        with Profile() as prof, torch.no_grad():
            def step_on(input_ids: Any, scores: Any) -> Any:
                prof.on = True  # from the first generated token on: decode steps only
                return scores

            t0 = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 do_sample=False, cache=cache, pad_token_id=pad,
                                 logits_processor=transformers.LogitsProcessorList([clock, logp, step_on]))
            t1 = time.perf_counter()
        steps = len(clock.t) - 1
        decode_s = clock.t[-1] - clock.t[0]
        per = {k: 1e3 * v / steps for k, v in prof.acc.items()} if steps else {}
        if steps:
            per["attention"] -= per["seal"]  # the fast path seals inside its attention function
        if steps:
            per["model_rest"] = 1e3 * decode_s / steps - sum(v for k, v in per.items() if k not in ("kernel", "turn"))
        # The prefill (the first forward call, to the first token's logits), in ms: the fast path
        # seals (``seal``; of it ``turn``, RoPE taken off the keys) inside its attention function.
        pre = {k: 1e3 * v for k, v in prof.pre.items()}
        pre["attention"] -= pre["seal"]  # (0 on the slow path: it seals inside update, not timed apart)
        pre["model_rest"] = 1e3 * (clock.t[0] - t0) - pre["attention"] - pre["update"] - pre["seal"]
        return {"tokens": out[:, n0:], "logp": logp.steps, "prefill_s": clock.t[0] - t0,
                "decode_s": decode_s,
                "decode_tokens_per_s": out.shape[0] * steps / decode_s if decode_s > 0 else float("nan"),
                "wall_s": t1 - t0, "step_ms": per, "prefill_ms": pre}

    rows: List[Dict[str, Any]] = []
    texts: Dict[str, str] = {}
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    for n_tokens, repeat in [(n, k) for n in lengths for k in range(max(1, args.repeats))]:
        ids = prompt(n_tokens)
        n0 = ids["input_ids"].shape[1]
        model.set_attn_implementation(base)  # the baseline runs the model's own attention
        ref = gen(ids, transformers.DynamicCache(config=model.config))
        texts[f"{n0}/DynamicCache"] = tok.decode(ref["tokens"][0], skip_special_tokens=True)
        rows.append({"prompt_tokens": n0, "cache": "DynamicCache", "recipe": "-", "repeat": repeat,
                     "batch": args.batch, "padding": int((ids["attention_mask"] == 0).sum()),
                     **{k: v for k, v in ref.items() if k not in ("tokens", "logp")}})
        for rec, codec in codecs:
            runs = {}
            counts = [None] if not args.kernel_threads else \
                [int(t) for t in args.kernel_threads.split(",")]
            modes = [("fast", t, syn) for syn in args.synthesis.split(",") for t in counts]
            for mode, threads, syn in modes + ([("slow", None, "bf16")] if args.slow else []):
                cache = KakeyaCache(codec, model=model, block_size=args.block_size, n_sink=rec.n_sink,
                                    boundary=rec.boundary(model.config.num_hidden_layers),
                                    streams=rec.streams, fast=None if mode == "fast" else False,
                                    threads=threads, synthesis=syn)
                r = gen(ids, cache)
                mem = cache.memory()
                elems = cache.nbytes_uncompressed() // held  # rows stored in the model's dtype
                raw_elems = (mem["sink"] + mem["staging"]) // held
                bits = 8 * mem["blobs"] + 16 * raw_elems
                # Keys coded before RoPE also hold each token's position (int32) and, on the fast
                # path, the model's cos/sin table (shared by every layer and sequence).
                extra = mem.get("positions", 0) + mem.get("rope_table", 0)
                how = "codes" if cache.fast else "decode-then-attend"
                how += f", {threads} thread{'s' if threads != 1 else ''}" if threads is not None else ""
                used = cache.synthesis  # "auto" resolved
                how += f", {used} synthesis" if cache.fast and used != "bf16" else ""
                r.update(cache=f"KakeyaCache ({how})", kernel_threads=threads, synthesis=used,
                         fast=cache.fast, fast_reason=cache.fast_reason, recipe=rec.name,
                         prompt_tokens=n0, batch=args.batch, block_size=args.block_size, blob_bytes=mem["blobs"],
                         raw_elements=raw_elems, bits_per_element=bits / elems,
                         positions_bytes=mem.get("positions", 0), rope_table_bytes=mem.get("rope_table", 0),
                         bits_per_element_with_positions_and_table=(bits + 8 * extra) / elems,
                         speed_vs_dynamic=r["decode_tokens_per_s"] / ref["decode_tokens_per_s"],
                         prefill_vs_dynamic=r["prefill_s"] / ref["prefill_s"],
                         wall_vs_dynamic=ref["wall_s"] / r["wall_s"])
                key = mode if threads is None else f"{mode}-{threads}t"
                runs[key if syn == "auto" or mode == "slow" else f"{key}-{syn}"] = r
            slow = runs.get("slow")
            for mode, r in runs.items():
                ds, same, kl = compare(ref, r)
                # Per batch row where there are several; one value (as before) for one.
                r["first_divergence_vs_dynamic"] = ds if args.batch > 1 else ds[0]
                r["identical_to_dynamic"], r["kl_vs_dynamic"] = same, kl
                if slow is not None:
                    if mode.startswith("fast"):
                        ds, same, kl = compare(slow, r)
                    else:
                        ds, same, kl = [None] * args.batch, r["tokens"].numel(), 0.0
                    r["first_divergence_vs_slow"] = ds if args.batch > 1 else ds[0]
                    r["identical_to_slow"], r["kl_vs_slow"] = same, kl
            for mode, r in runs.items():
                toks = r.pop("tokens")
                r.pop("logp")
                r["new_tokens"] = toks.numel()  # over the batch
                r["repeat"] = repeat
                texts[f"{n0}/{rec.name}/{mode}"] = tok.decode(toks[0], skip_special_tokens=True)
                rows.append(r)
    load = os.getloadavg()
    print(f"{model_path.name} | batch {args.batch} | {args.new_tokens} new tokens | block {args.block_size} | "
          f"{os.cpu_count()} cores | torch threads {torch.get_num_threads()} | load {load[0]:.2f} | "
          f"attention kernel {attention_kernel()} | OpenMP team {attention_team() or 'none'}")
    print("| prompt | cache | recipe | bits/elem held | prefill s (time / DynamicCache's) | decode tok/s | vs DynamicCache "
          "| identical (vs DynamicCache) | identical (vs decode-then-attend) | KL vs DynamicCache "
          "| KL vs decode-then-attend | decode step ms: attention (kernel) / update / seal / rest "
          "| prefill ms: attention / update / seal (RoPE off) / rest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    shown = summarize(rows) if args.repeats > 1 else rows
    if args.repeats > 1:
        print(f"(medians over {args.repeats} alternating runs; each ratio taken within its run)")
    for r in shown:
        def kl(key: str) -> str:
            return f"{r[key]:.2e}" if r.get(key) is not None else "-"

        sm = r["step_ms"]
        prof = " / ".join(f"{sm.get(k, 0):.1f}" for k in ("attention", "update", "seal", "model_rest"))
        if sm.get("kernel"):  # attention over the codes: the kernel's share, the rest Python around it
            prof = prof.replace(" / ", f" ({sm['kernel']:.1f}) / ", 1)
        bits = f"{r['bits_per_element']:.2f}" if "bits_per_element" in r else f"16 (bf16) / {8 * held} held"
        vs = f"{r['speed_vs_dynamic']:.2f}x" if "speed_vs_dynamic" in r else "1.00x"
        same = f"{r['identical_to_dynamic']}/{r['new_tokens']}" if "new_tokens" in r else "-"
        same_s = (f"{r['identical_to_slow']}/{r['new_tokens']}" if r.get("identical_to_slow") is not None
                  else "-")
        pre = f"{r['prefill_s']:.1f}" + (f" ({r['prefill_vs_dynamic']:.2f}x)" if "prefill_vs_dynamic" in r else "")
        pm = r["prefill_ms"]
        pprof = " / ".join(f"{pm.get(k, 0):.0f}" for k in ("attention", "update", "seal", "model_rest"))
        if pm.get("turn"):
            pprof = pprof.replace(f"{pm.get('seal', 0):.0f} /", f"{pm['seal']:.0f} ({pm['turn']:.0f}) /")
        print(f"| {r['prompt_tokens']} | {r['cache']} | {r['recipe']} | {bits} | {pre} | "
              f"{r['decode_tokens_per_s']:.2f} | {vs} | {same} | {same_s} | {kl('kl_vs_dynamic')} | "
              f"{kl('kl_vs_slow')} | {prof} | {pprof} |")
    for k, v in texts.items():
        print(f"\n{k}: {v}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"generate-{model_path.stem}.json"
    path.write_text(json.dumps({
        "model": model_path.name, "dtype": str(model.dtype).replace("torch.", ""), "batch": args.batch, "new_tokens": args.new_tokens, "block_size": args.block_size,
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg": load,
        "machine": platform.processor() or platform.machine(),
        "attention_kernel": attention_kernel(), "openmp_team": attention_team(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "repeats": args.repeats, "rows": rows, "summary": shown, "texts": texts},
        indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    return 0


def summarize(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per (prompt, cache, recipe): the median tokens/s, ratio to DynamicCache (each taken
    within its run), prefill and step profile over the repeats; the rest from the first run."""
    import statistics

    groups: Dict[Any, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["prompt_tokens"], r["cache"], r["recipe"]), []).append(r)
    out = []
    for rs in groups.values():
        m = dict(rs[0])
        m["runs"] = len(rs)
        for k in ("decode_tokens_per_s", "prefill_s", "wall_s", "speed_vs_dynamic", "prefill_vs_dynamic",
                  "wall_vs_dynamic"):
            if k in m:
                m[k] = statistics.median(r[k] for r in rs)
        m["speed_vs_dynamic_range"] = [min(r.get("speed_vs_dynamic", 1.0) for r in rs),
                                       max(r.get("speed_vs_dynamic", 1.0) for r in rs)]
        for part in ("step_ms", "prefill_ms"):
            m[part] = {k: statistics.median(r[part].get(k, 0.0) for r in rs) for k in rs[0][part]}
        out.append(m)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
