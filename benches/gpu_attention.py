"""The attention and generation parts of ``benches/gpu_bench.py`` (its items 3 and 4): parity of
the Triton decode attention with the Rust kernel and its timing beside SDPA, and decode steps
through ``KakeyaCache(kernel="triton")`` against ``DynamicCache``."""

from __future__ import annotations

import inspect
import json
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

from gpu_codec import graph_timer, timer  # also puts tests/ on sys.path, for the parity modules


# Decode attention over the codes.

ATTENTION_SHAPES = ((9, 3, 64), (32, 8, 128))
ATTENTION_TOKENS = (8192, 32768)
ATTENTION_BITS = (3.0, 4.0)


def attention_layer(hq: int, hkv: int, d: int, tokens: int, bits: float, seed: int = 0) -> Any:
    """A layer's codes: per kv-head a K and a V calibration water-filled at ``bits`` on a
    decaying spectrum, and ``tokens`` rows of its model in blocks of 512."""
    import numpy as np

    import kakeyaturbo as kt
    from kakeyaturbo import calibration

    g = np.random.default_rng(seed)
    heads = []
    for _ in range(2 * hkv):
        q, _ = np.linalg.qr(g.standard_normal((d, d)))
        lam = 0.9 ** np.arange(d) * g.uniform(0.5, 1.5, d)
        mean = 0.3 * g.standard_normal(d)
        heads.append((calibration.fit_stream(mean, (q * lam) @ q.T, bits).codec(), mean, q, lam))
    codes = kt.LayerCodes([h[0] for h in heads[:hkv]], [h[0] for h in heads[hkv:]])
    for _ in range(tokens // 512):
        blobs = [h[0].encode((h[1] + (g.standard_normal((512, d)) * np.sqrt(h[3])) @ h[2].T)
                             .astype(np.float32)) for h in heads]
        codes.append_blocks([blobs[:hkv]], [blobs[hkv:]])
    return codes


def _add(rows: List[Dict[str, Any]], row: Dict[str, Any]) -> None:
    """Appends a timing row and prints it at once (a run cut short keeps what it measured)."""
    rows.append(row)
    print(json.dumps(row), flush=True)


def run_attention(device: str, dry_run: bool, budget_s: float) -> Dict[str, Any]:
    """Parity of the Triton decode attention with the Rust kernel, then its timing."""
    import torch
    import torch.nn.functional as F

    from kakeyaturbo import kernels as K
    from tests.kernels.attention import parity as attention_parity

    t0 = time.perf_counter()
    # Up to 80 of the 300 random cases, as many as the budget allows (each is built and run
    # through the Rust kernel on the CPU first); `make kernels-fuzz` runs all of them. PASS:
    # every case run passed (the report says how many ran).
    specs = attention_parity.make_cases(not dry_run)[: 2 if dry_run else 80]
    results, failures, not_run = [], [], 0
    for spec in specs:  # two thirds of the budget, the pre-RoPE cases the rest
        if time.perf_counter() - t0 > budget_s * 2 / 3:
            not_run += 1
            continue
        try:
            results.append(attention_parity.run(spec, device))
        except Exception as e:  # noqa: BLE001 - reported, the bench goes on
            failures.append(f"seed {spec.seed}: {str(e)[:500]}")
    # The summary first: its "cases" (those that passed) and "seconds" (kernel time) give way.
    fuzz = {**attention_parity.summary(results), "cases": len(specs), "run": len(results) + len(failures),
            "not_run": not_run, "failures": failures,
            "seconds": time.perf_counter() - t0, "passed": not failures and bool(results)}
    # Keys coded before RoPE: 20 of the 60 random pre-RoPE cases (the subset in a dry run).
    t1 = time.perf_counter()
    rspecs = attention_parity.make_rope_cases(not dry_run)[: 2 if dry_run else 20]
    rresults, rfailures, rnot_run = [], [], 0
    for rspec in rspecs:
        if time.perf_counter() - t0 > budget_s:
            rnot_run += 1
            continue
        try:
            rresults.append(attention_parity.run(rspec, device))
        except Exception as e:  # noqa: BLE001 - reported, the bench goes on
            rfailures.append(f"rope seed {rspec.seed}: {str(e)[:500]}")
    rope_fuzz = {**attention_parity.summary(rresults), "cases": len(rspecs),
                 "run": len(rresults) + len(rfailures), "not_run": rnot_run, "failures": rfailures,
                 "seconds": time.perf_counter() - t1, "passed": not rfailures and bool(rresults)}
    bench, graph = timer(dry_run), graph_timer(dry_run)
    rows: List[Dict[str, Any]] = []
    shapes = [(2, 1, 16)] if dry_run else ATTENTION_SHAPES
    for hq, hkv, d in shapes:
        for tokens in ((1024,) if dry_run else ATTENTION_TOKENS):
            q = torch.randn(1, hq, 1, d, device=device)
            for dtype in (torch.bfloat16, torch.float32):
                k = torch.randn(1, hkv, tokens, d, device=device, dtype=dtype)
                v = torch.randn_like(k)
                qq = q.to(dtype)
                sdpa = lambda: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True)  # noqa: E731
                _add(rows, {"impl": f"torch SDPA ({str(dtype)[6:]} cache, enable_gqa)",
                             "shape": f"{hq}/{hkv}x{d}", "T": tokens, "bits": 16 if dtype == torch.bfloat16 else 32,
                             "ms": bench(sdpa), "graph_ms": graph(sdpa)})
            for bits in ((4.0,) if dry_run else ATTENTION_BITS):
                codes = attention_layer(hq, hkv, d, tokens, bits)
                layer = K.stack_layer(codes, device)
                tail = torch.randn(1, hkv, 1, d, device=device)
                held = 8 * codes.nbytes / (2 * tokens * hkv * d)
                plain = lambda: K.decode_attention_triton(layer, q, tail, tail)  # noqa: E731
                _add(rows, {"impl": "triton attention over the codes", "shape": f"{hq}/{hkv}x{d}",
                             "T": tokens, "bits": round(held, 2), "ms": bench(plain), "graph_ms": graph(plain)})
                # The same codes read as keys coded before RoPE: table staged once, positions
                # on the device (trusted there, so no check reads them back).
                rope, pos = attention_rope(tokens, d, layer.k.rows, device)
                pre = lambda: K.decode_attention_triton(layer, q, tail, tail, rope=rope,  # noqa: E731
                                                        positions=pos)
                _add(rows, {"impl": "triton attention over the codes, keys pre-RoPE",
                             "shape": f"{hq}/{hkv}x{d}", "T": tokens, "bits": round(held, 2),
                             "ms": bench(pre), "graph_ms": graph(pre)})
                if dry_run or tokens != 8192 or bits != ATTENTION_BITS[0]:
                    continue
                # Ablations, the same codes: the bf16 synthesis on the FMA units (the tensor
                # cores' share), and for the default shape the launch settings before
                # 2026-12-04 (tiles of 64 rows on 4 warps, pieces of 1024 rows, no tensor cores).
                from kakeyaturbo.kernels.attention import split as attention_split

                new_settings = attention_split._settings
                variants = [(", keys pre-RoPE, bf16 synthesis on the FMA units", [pre],
                             lambda tc, bh, mp, dev: {**new_settings(tc, bh, mp, dev), "MMA": False})]
                if (hq, hkv, d) == (9, 3, 64):
                    variants.append((", old launch settings", [plain, pre], lambda tc, bh, mp, dev: {
                        "BN": 64, "SPLIT": 1024 if tc >= 8192 else 512, "BDC": 64 if mp <= 128 else 32,
                        "num_warps": 4 if mp <= 64 else 8, "num_stages": 3 if mp <= 64 else 2, "MMA": False}))
                try:
                    for label, fns, settings_fn in variants:
                        attention_split._settings = settings_fn
                        for fn in fns:
                            tag = ", keys pre-RoPE" if fn is pre and "pre-RoPE" not in label else ""
                            _add(rows, {"impl": f"triton attention over the codes{tag}{label}",
                                         "shape": f"{hq}/{hkv}x{d}", "T": tokens, "bits": round(held, 2),
                                         "ms": bench(fn), "graph_ms": graph(fn)})
                finally:
                    attention_split._settings = new_settings
    return {"fuzz": fuzz, "rope_fuzz": rope_fuzz, "rows": rows}


def attention_rope(tokens: int, d: int, sealed: int, device: str) -> Tuple[Any, Any]:
    """A base-10000 rotary table over every dimension for positions ``0 .. tokens`` staged on
    ``device`` (``stack_rope``) and the sealed rows' positions ``0 .. sealed - 1`` (int32
    ``[1, sealed]`` there)."""
    import numpy as np
    import torch

    import kakeyaturbo as kt
    from kakeyaturbo.kernels.attention import stack_rope

    inv = 1.0 / 10000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(tokens + 1, dtype=np.float64)[:, None] * inv[None, :]
    table = kt.RopeTable(np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), "half")
    pos = torch.arange(sealed, dtype=torch.int32, device=device)[None]
    return stack_rope(table, device), pos


def attention_lines(at: Dict[str, Any]) -> List[str]:
    fz = at["fuzz"]
    lines = [
        "## Decode attention over the codes",
        "",
        f"Parity with the Rust kernel: {fz['run']} of {fz['cases']} cases in {fz['seconds']:.0f} s, "
        f"largest errors out {fz['max_out_error']:.2e}, lse {fz['max_lse_error']:.2e} (limit "
        f"attention_triton); **{'PASS' if fz['passed'] else 'FAIL'}**",
        "",
    ]
    lines += [f"- failure: {f}" for f in fz["failures"][:20]]
    rf = at.get("rope_fuzz")
    if rf:
        lines += ["", f"Keys coded before RoPE: {rf['run']} of {rf['cases']} cases in {rf['seconds']:.0f} s, "
                  f"largest errors out {rf['max_out_error']:.2e}, lse {rf['max_lse_error']:.2e} (limit "
                  f"attention_triton_rope); **{'PASS' if rf['passed'] else 'FAIL'}**", ""]
        lines += [f"- failure: {f}" for f in rf["failures"][:20]]
    lines += ["", "One decode step of one layer (1 query token per head); bits per element held "
              "(all-in for the codes). ms: do_bench, the host's launch overhead included; graph ms: "
              "replayed from a CUDA graph (the device's time); x SDPA: the bf16 SDPA's time over "
              "this row's (above 1: faster), each column against its own.", "",
              "| impl | q/kv heads x D | T | bits | ms | graph ms | x SDPA | x SDPA (graph) |",
              "|---|---|---|---|---|---|---|---|"]

    def fmt(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.4g}"

    base = {(r["shape"], r["T"]): r for r in at["rows"] if r["impl"].startswith("torch SDPA (bfloat16")}
    for r in at["rows"]:
        ref = base.get((r["shape"], r["T"]), {})
        gm, rg = r.get("graph_ms"), ref.get("graph_ms")
        lines.append(f"| {r['impl']} | {r['shape']} | {r['T']} | {r['bits']} | {r['ms']:.4g} | {fmt(gm)} | "
                     f"{fmt(ref['ms'] / r['ms'] if ref else None)} | "
                     f"{fmt(rg / gm if gm and rg else None)} |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------
# Generation through KakeyaCache on the device.

def _decode_steps(model: Any, ids: Any, cache: Any, steps: int, device: str) -> Tuple[float, List[int]]:
    """Prefill ``ids`` into ``cache``, then ``steps`` greedy decode steps one token at a time:
    the median ms of a step (synchronised) and the tokens."""
    import torch

    kw = {"cache": cache} if "cache" in inspect.signature(model.forward).parameters else {"past_key_values": cache}
    times, toks = [], []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **kw)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            toks.append(int(nxt[0, 0]))
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(input_ids=nxt, use_cache=True, **kw)
            nxt = out.logits[:, -1:].argmax(-1)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times), toks


def run_generation(device: str, dry_run: bool) -> Dict[str, Any]:
    """Decode steps of a random-weight model of the default model's shape (SmolLM2-135M: 30
    layers, 9 / 3 heads x 64, bfloat16 on the GPU) through ``KakeyaCache(kernel="triton")``
    (attention over the codes by the Triton kernel) and through ``DynamicCache`` (SDPA), at
    prompts of 2k and 8k random tokens; the codec fitted on two windows of the model's own
    statistics (uniform weights). Speed does not depend on the weights; the tokens compared
    are the random model's."""
    try:
        import transformers
    except ModuleNotFoundError:
        return {"skipped": "transformers is not installed"}
    import numpy as np
    import torch

    from kakeyaturbo import calibration, recipes
    from kakeyaturbo.cache import KakeyaCache
    from kakeyaturbo.calibration import ModelCodec

    t0 = time.perf_counter()
    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97) if dry_run else
             dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**shape, max_position_embeddings=16384, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    model = transformers.LlamaForCausalLM(cfg).eval().to(device, torch.float32 if dry_run else torch.bfloat16)
    model.set_attn_implementation("sdpa")
    g = np.random.default_rng(0)
    vocab = shape["vocab_size"]
    win = 24 if dry_run else 256
    stats = calibration.collect(model, [list(g.integers(3, vocab, win)) for _ in range(2)], n_sink=1,
                                samples=32 if dry_run else 256, weighting="uniform")
    # Calibrated without sensitivity (no gradients): keys before RoPE at 4 bits, values at 3.
    rec = recipes.Recipe(name="gpu-gen-4bit", mode="calibrated", n_sink=1,
                         k={"bits": 4, "whiten": "query"}, v={"bits": 3, "whiten": "output", "center": False})
    codec = ModelCodec(stats, rec)
    steps = 3 if dry_run else 32
    block = 8 if dry_run else 128
    rows = []
    for tokens in ((40,) if dry_run else (2048, 8192)):
        ids = torch.from_numpy(g.integers(3, vocab, (1, tokens))).to(device)
        base_ms, base_toks = _decode_steps(model, ids, transformers.DynamicCache(config=model.config), steps, device)
        rows.append({"cache": "DynamicCache (SDPA)", "T": tokens, "ms": base_ms, "x": 1.0, "bits": 16.0,
                     "same_tokens": steps})
        cache = KakeyaCache(codec, model=model, block_size=block, n_sink=1, kernel="triton")
        ms, toks = _decode_steps(model, ids, cache, steps, device)
        same = next((i for i, (a, b) in enumerate(zip(toks, base_toks)) if a != b), steps)
        mem = cache.memory()
        elems = cache.nbytes_uncompressed() // torch.empty((), dtype=model.dtype).element_size()
        bits = 8 * (mem["blobs"] + mem["sink"] + mem["staging"]) / max(1, elems)
        label = "KakeyaCache (Triton attention over the codes)" if cache.fast else \
            f"KakeyaCache (slow path: {cache.fast_reason})"
        rows.append({"cache": label, "T": tokens, "ms": ms,
                     "x": base_ms / ms, "bits": bits, "same_tokens": same, "fast": cache.fast})
        model.set_attn_implementation("sdpa")  # the next DynamicCache runs the model's own attention
    return {"rows": rows, "steps": steps, "block_size": block, "seconds": time.perf_counter() - t0}


def generation_lines(gen: Dict[str, Any]) -> List[str]:
    if "skipped" in gen:
        return ["## Generation", "", f"Skipped: {gen['skipped']}.", ""]
    lines = ["## Generation through the cache (random weights, the default model's shape)", "",
             f"Median ms of a decode step over {gen['steps']} greedy steps after the prompt; x: "
             "DynamicCache's time over this row's (above 1: faster); bits per element held "
             f"(blocks of {gen['block_size']}, raw sink and staging rows at their dtype's width); "
             "same tokens: greedy steps equal to DynamicCache's before the first difference.", "",
             "| cache | T | ms / step | x DynamicCache | bits held | same tokens |", "|---|---|---|---|---|---|"]
    for r in gen["rows"]:
        lines.append(f"| {r['cache']} | {r['T']} | {r['ms']:.4g} | {r['x']:.3g} | {r['bits']:.3g} | "
                     f"{r['same_tokens']} |")
    return lines + [""]


