"""Parity fuzz and timing of the Triton kernels on a GPU, in one prepared run that builds nothing.

    bash benches/gpu_run.sh OUT_DIR          # on the GPU machine: install dist/*.whl, run this
    python benches/gpu_bench.py --out OUT_DIR [--workers 8] [--budget-s 280] [--dry-run]
                                [--parts codec,attention,generation]

1. Parity: the full fuzz of ``tests/kernels/perblock/parity.py`` (over 1,000 blocks in 150
   groups) and of ``tests/kernels/calibrated/parity.py`` (the calibrated mode, 1,000 heads in
   125 groups), run by ``tests/kernels/harness.py``: the torch reference and the kernels each
   against the Rust codec, spread over worker processes (Rust fits and float64 checks use the
   CPU cores, the kernels the GPU, and the workers compile Triton specialisations in parallel
   through Triton's shared disk cache). The two fuzzes share the fuzz budget equally.
2. Timing of a realistic layer: 8 kv heads x 8192 tokens x head_dim 128, bfloat16, blocks of
   512 rows (128 blocks), skeletons fitted per block by the Rust codec, in two settings: K (the
   predecessor's K recipe: inner_product, 3 bits, randomized PCA, k = 16, outliers T = 2.0) and V
   (mse, 2 bits). Each time is ``triton.testing.do_bench``'s median (ms) of:
   - ``copy``: a device-to-device copy of the bf16 input (``Tensor.copy_``), the yardstick;
   - ``kernels encode``: :func:`kakeyaturbo.kernels.encode_blocks` (stages 2-5, four launches,
     plus the outlier compaction, which synchronises);
   - ``kernels decode``: :func:`kakeyaturbo.kernels.decode_blocks` to bf16 (one launch);
   - ``torch reference`` encode / decode on the GPU, one block at a time;
   - ``Rust CPU``: the same layer through ``roundtrip_layer`` (float32 in): stages 2-5 of the
     encode on one core (the report's ``code_seconds``, thread time) and the decode on all cores
     (``decode_seconds``), measured once each after a warm-up (not do_bench).
   The calibrated mode on the same layer (settings ``cal K``: 4.4 bits per element
   water-filled on each head's own covariance, whitened by a synthetic query second moment,
   mse; ``cal V``: 3.4 bits, inner_product, outliers T = 3.0), one calibration per head, all
   8 heads in one batch: ``calibrated kernels encode`` (up to three launches, plus the
   outlier sort, which synchronises) and ``decode`` (one launch, bf16 out), the torch
   reference (head loop) and the Rust CPU path (``CalibratedCodec.roundtrip`` head by head:
   encode on one core, decode on all cores).
   GB/s = bytes of the bf16 layer / time for every row, so rows compare directly;
   ``x copy`` = copy time / time (1.0 = as fast as copying the input once).
   The timed encodes are also checked against Rust block by block / head by head.
3. Decode attention over the calibrated codes (``kakeyaturbo.kernels.decode_attention_triton``):
   parity with the Rust kernel (``tests/kernels/attention/parity.py``: up to 80 of its 300 random
   cases, then up to 20 of its 60 random cases of keys coded before RoPE, in this process, as many
   as the budget the codec fuzzes leave allows, two thirds to the first; PASS when every case run
   passed) and the time of one decode step of one
   layer (one query token per query head) at T = 8k and 32k for the default model's shape (9
   query heads, 3 kv-heads, head_dim 64) and a head_dim-128 one (32 / 8), codes at 3 and 4 bits
   per element water-filled on a decaying spectrum, beside ``torch.nn.functional.
   scaled_dot_product_attention`` (``enable_gqa``) over the bf16 and the fp32 cache; the same
   codes also read as keys coded before RoPE (``keys pre-RoPE``: a base-10000 table over every
   dimension staged once, positions ``0 .. T_c - 1`` on the device). Each row has do_bench's
   time (the host's launch overhead included) and the time replayed from a CUDA graph (the
   device's alone); at 8k and 3 bits, ablation rows: the bf16 synthesis on the FMA units instead
   of the tensor cores, and (9/3 x 64) the launch settings before 2026-12-04.
4. Generation (``--parts generation``, where transformers is installed): the median decode step
   of a random-weight model of the default model's shape (bfloat16) through
   ``KakeyaCache(kernel="triton")`` and ``DynamicCache`` at 2k and 8k random-token prompts
   (:func:`run_generation`).
5. Prints a table and writes ``gpu_bench.json`` and ``gpu_bench.md`` under ``--out``.

The whole run is held under ``--budget-s`` (default 280 s, so that it ends inside 5 minutes):
each fuzz stops taking new groups when its share is spent and says how many it ran. ``--dry-run`` runs everything on the CPU in
Triton's interpreter (``TRITON_INTERPRET=1``) with tiny shapes (2 heads x 1024 tokens x 64), two
fuzz groups of each mode and ``time.perf_counter`` instead of do_bench: it checks the script,
not the GPU.
Exit status 0 when every parity check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import inspect
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # tests/kernels/, the parity harness, as the package "kernels"



def settings(dim: int) -> Dict[str, Dict[str, Any]]:
    """The K and V codec keyword arguments for head dimension ``dim``."""
    return {
        "K": dict(metric="inner_product", bit_width=3, pca_method="randomized", rsvd_target_rank=dim // 2,
                  k=16, outlier_threshold=2.0),
        "V": dict(metric="mse", bit_width=2, k=16),
    }


@dataclasses.dataclass(frozen=True)
class Layer:
    heads: int
    tokens: int
    dim: int
    block: int

    @property
    def blocks(self) -> int:
        return self.heads * self.tokens // self.block

    @property
    def bf16_bytes(self) -> int:
        return self.heads * self.tokens * self.dim * 2


REAL = Layer(8, 8192, 128, 512)
TINY = Layer(2, 1024, 64, 512)


# ---------------------------------------------------------------------------------------------
# Parity fuzz in worker processes.


def fuzz_module(mode: str) -> Any:
    """The parity module of a mode: ``blocks`` (the per-block mode) or ``calibrated``."""
    if mode == "calibrated":
        from kernels.calibrated import parity as calibrated_parity

        return calibrated_parity
    from kernels.perblock import parity

    return parity


def fuzz_worker(gids: Sequence[int], full: bool, device: str, threads: int,
                mode: str = "blocks") -> List[Dict[str, Any]]:
    """Runs groups ``gids`` of a mode's fuzz through the reference and the kernels."""
    import torch
    from kernels import harness

    parity = fuzz_module(mode)
    torch.set_num_threads(threads)
    groups = {g.gid: g for g in parity.make_groups(full)}
    out: List[Dict[str, Any]] = []
    for gid in gids:
        group = groups[gid]
        try:
            prep = parity.prepare(group)
        except Exception:  # noqa: BLE001 - reported, not raised: the bench goes on
            out.append({"label": group.label, "impl": "rust", "error": traceback.format_exc(limit=3)})
            continue
        for impl, run in (("reference", parity.run_reference), ("kernels", parity.run_kernels)):
            t0 = time.perf_counter()
            try:
                r = run(prep, device)
            except Exception as e:  # noqa: BLE001
                msg = str(e) if isinstance(e, harness.ParityError) else traceback.format_exc(limit=4)
                out.append({"label": group.label, "impl": impl, "error": msg,
                            "seconds": time.perf_counter() - t0})
                continue
            out.append(r.summary())
    return out


def run_fuzz(full: bool, device: str, workers: int, budget_s: float, limit: Optional[int],
             mode: str = "blocks") -> Dict[str, Any]:
    groups = fuzz_module(mode).make_groups(full)[:limit]
    t0 = time.perf_counter()
    results: List[Dict[str, Any]] = []
    not_run: List[str] = []
    if workers <= 1:
        for g in groups:
            if time.perf_counter() - t0 > budget_s:
                not_run.append(g.label)
                continue
            results.extend(fuzz_worker([g.gid], full, device, max(1, os.cpu_count() or 1), mode))
    else:
        ctx = multiprocessing.get_context("spawn")
        threads = max(1, (os.cpu_count() or workers) // workers)
        # Spawned workers load their BLAS afresh: keep them from oversubscribing the cores.
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futs = {pool.submit(fuzz_worker, [g.gid], full, device, threads, mode): g for g in groups}
            _, pending = cf.wait(futs, timeout=max(1.0, budget_s - (time.perf_counter() - t0)))
            for f in pending:
                f.cancel()  # groups not started are dropped; running ones finish
        for f, g in futs.items():
            if f.cancelled():
                not_run.append(g.label)
                continue
            try:
                results.extend(f.result())
            except Exception:  # noqa: BLE001 - a crashed worker is a failure, not a crash
                err = traceback.format_exc(limit=3)
                results.append({"label": g.label, "impl": "worker", "error": err})
    ok = [r for r in results if r["error"] is None]
    failures = [f"{r['label']} [{r['impl']}]: {r['error']}" for r in results if r["error"] is not None]
    failures += [v for r in ok for v in r["near_violations"]]
    blocks = {impl: sum(r["blocks"] for r in ok if r["impl"] == impl) for impl in ("reference", "kernels")}
    compared: Dict[str, int] = {}
    for r in ok:
        for k, v in r["compared"].items():
            compared[k] = compared.get(k, 0) + v
    return {
        "mode": mode,
        "full": full,
        "groups_planned": len(groups),
        "groups_not_run": not_run,
        "block_comparisons": blocks,
        "compared_values": compared,
        "near_threshold": [n for r in ok for n in r["nears"]],
        "undetermined_rows": sum(r["undetermined_rows"] for r in ok),
        "max_decode_error": max([r["max_decode_error"] for r in ok] + [0.0]),
        "failures": failures,
        "seconds": time.perf_counter() - t0,
        "passed": not failures and not not_run,
    }


# ---------------------------------------------------------------------------------------------
# Timing.


def timer(dry_run: bool) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of a call: do_bench on the GPU, perf_counter in a dry run."""
    if dry_run:
        def bench(fn: Callable[[], Any]) -> float:
            fn()
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                runs.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(runs)

        return bench
    import triton.testing

    def bench_gpu(fn: Callable[[], Any]) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    return bench_gpu


def graph_timer(dry_run: bool) -> Callable[[Callable[[], Any]], Optional[float]]:
    """Median milliseconds of a call replayed from a CUDA graph (``do_bench_cudagraph``): the
    device's time without the host's launch overhead. None in a dry run or where the call
    cannot be captured (the reason is printed)."""
    def bench(fn: Callable[[], Any]) -> Optional[float]:
        if dry_run:
            return None
        import torch
        import triton.testing

        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))
        except Exception as e:  # noqa: BLE001 - reported, the bench goes on
            print(f"CUDA graph capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return None

    return bench


def run_timing(layer: Layer, device: str, dry_run: bool) -> Dict[str, Any]:
    import numpy as np
    import torch

    import kakeyaturbo as kt
    from kakeyaturbo import kernels as K
    from kakeyaturbo.reference import perblock as ref
    from kernels import harness
    from kernels.perblock import parity

    bench = timer(dry_run)
    x = harness.kv_layer(layer.heads, layer.tokens, layer.dim)
    flat = x.reshape(-1, layer.dim)
    nb, bs = layer.blocks, layer.block
    xg = torch.from_numpy(x).to(device=device, dtype=torch.bfloat16)
    blocks = xg.view(nb, bs, layer.dim)
    rows: List[Dict[str, Any]] = []
    copy_dst = torch.empty_like(xg)
    copy_ms = bench(lambda: copy_dst.copy_(xg))
    base = {"impl": "copy (bf16, device to device)", "setting": "-", "ms": copy_ms}
    rows.append(base)
    checks: Dict[str, Any] = {}
    for name, kw in settings(layer.dim).items():
        with cf.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:  # the extension releases the GIL
            parts = list(pool.map(lambda i: kt.encode_block_codes(flat[i * bs:(i + 1) * bs], **kw),
                                  range(nb)))
        skel = K.stack_skeletons(parts, device)
        codes = K.encode_blocks(blocks, skel)
        out = torch.empty_like(blocks)
        rows.append({"impl": "kernels encode", "setting": name,
                     "ms": bench(lambda: K.encode_blocks(blocks, skel))})
        rows.append({"impl": "kernels decode (bf16 out)", "setting": name,
                     "ms": bench(lambda: K.decode_blocks(codes, skel, out_dtype=torch.bfloat16, out=out))})
        # The timed encode, checked against Rust block by block.
        nears, undetermined = [], 0
        for i in range(nb):
            ours = K.block_parts(codes, skel, [bs] * nb, i, parts[i])
            res = parity.compare_block(flat[i * bs:(i + 1) * bs], parts[i], ours, f"{name} block {i}")
            nears += [str(n) for n in res.nears]
            undetermined += res.undetermined_rows
        checks[name] = {"blocks": nb, "near_threshold": nears, "undetermined_rows": undetermined,
                        "mean_d_eff": float(np.mean([p["d_eff"] for p in parts])),
                        "outliers": int(codes["outlier_pos"].numel())}

        def ref_encode() -> None:
            for i in range(nb):
                ref.encode_block(blocks[i], parts[i])

        ref_parts = [ref.encode_block(blocks[i], parts[i]) for i in range(nb)]  # on the device

        def ref_decode() -> None:
            for p in ref_parts:
                ref.decode_block(p, device)

        rows.append({"impl": "torch reference encode (block loop)", "setting": name, "ms": bench(ref_encode)})
        rows.append({"impl": "torch reference decode (block loop)", "setting": name, "ms": bench(ref_decode)})
        kt.roundtrip_layer(flat, block_size=bs, threads=1, **kw)  # warm-up
        _, rep1 = kt.roundtrip_layer(flat, block_size=bs, threads=1, **kw)
        _, rep = kt.roundtrip_layer(flat, block_size=bs, **kw)
        rows.append({"impl": "Rust CPU stages 2-5 encode (1 core)", "setting": name,
                     "ms": rep1["code_seconds"] * 1e3})
        rows.append({"impl": f"Rust CPU decode ({os.cpu_count()} cores)", "setting": name,
                     "ms": rep["decode_seconds"] * 1e3})
    cal = run_calibrated_timing(layer, device, dry_run)
    rows += cal["rows"]
    checks.update(cal["checks"])
    for r in rows:
        r["GB/s"] = layer.bf16_bytes / (r["ms"] * 1e-3) / 1e9
        r["x copy"] = copy_ms / r["ms"]
    return {"layer": dataclasses.asdict(layer), "bf16_bytes": layer.bf16_bytes, "rows": rows,
            "checks": checks}


def calibrated_settings() -> Dict[str, Dict[str, Any]]:
    """The calibrated K and V settings: bits per element, query whitening, codec keywords."""
    return {
        "cal K": dict(bits=4.4, whiten=True, codec=dict(metric="mse")),
        "cal V": dict(bits=3.4, whiten=False, codec=dict(metric="inner_product", outlier_threshold=3.0)),
    }


def calibrated_codecs(x: Any, spec: Dict[str, Any], seed: int = 11) -> List[Any]:
    """One calibration per head, fitted on the head's own rows (mean, covariance) at the
    setting's bits per element, keys whitened by a synthetic query second moment."""
    import numpy as np

    from kakeyaturbo import calibrate

    g = np.random.default_rng(seed)
    out = []
    for h in range(x.shape[0]):
        rows = x[h].astype(np.float64)
        w = None
        if spec["whiten"]:
            b = g.standard_normal((x.shape[2], x.shape[2])) / np.sqrt(x.shape[2])
            w = calibrate.whitening_factor(b @ b.T + np.diag(g.uniform(0.1, 2.0, x.shape[2])))
        fit = calibrate.fit_stream(rows.mean(0), np.cov(rows.T, bias=True), spec["bits"], whitening=w)
        out.append(fit.codec(**spec["codec"]))
    return out


def run_calibrated_timing(layer: Layer, device: str, dry_run: bool) -> Dict[str, Any]:
    """The calibrated mode on the layer: kernels, the torch reference and the Rust CPU path."""
    import torch

    from kakeyaturbo import kernels as K
    from kakeyaturbo.reference import calibrated as rc
    from kernels import harness
    from kernels.calibrated import parity as calibrated_parity

    bench = timer(dry_run)
    x = harness.kv_layer(layer.heads, layer.tokens, layer.dim)
    xg = torch.from_numpy(x).to(device=device, dtype=torch.bfloat16)
    rows: List[Dict[str, Any]] = []
    checks: Dict[str, Any] = {}
    for name, spec in calibrated_settings().items():
        codecs = calibrated_codecs(x, spec)
        cals = [rc.calibration_of(c) for c in codecs]
        batch = K.stack_calibrations(cals, device)
        codes = K.encode_calibrated(xg, batch)
        out = torch.empty_like(xg)
        rows.append({"impl": "calibrated kernels encode", "setting": name,
                     "ms": bench(lambda: K.encode_calibrated(xg, batch))})
        rows.append({"impl": "calibrated kernels decode (bf16 out)", "setting": name,
                     "ms": bench(lambda: K.decode_calibrated(codes, batch, out_dtype=torch.bfloat16,
                                                             out=out))})
        # The timed encode (without intermediates) against Rust head by head, through the same
        # batch with intermediates for the checker.
        full = K.encode_calibrated(xg, batch, intermediates=True)
        for key in ("codes", "scale_bits", "scale_exp", "outlier_ptr", "outlier_pos", "outlier_bits"):
            if key in codes and not torch.equal(codes[key], full[key]):
                raise harness.ParityError(f"{name}: {key} depends on the intermediates flag")
        nears, undetermined = [], 0
        ns = [layer.tokens] * layer.heads
        for i, c in enumerate(codecs):
            ours = K.head_parts(full, batch, ns, i)
            res = calibrated_parity.compare_head(x[i], c, cals[i], c.encode_parts(x[i]), ours,
                                                 f"{name} head {i}")
            nears += [str(n) for n in res.nears]
            undetermined += res.undetermined_values
        checks[name] = {"heads": layer.heads, "near_threshold": nears, "undetermined_values": undetermined,
                        "m": [c.m for c in codecs], "row_bytes": [c.row_bytes for c in codecs],
                        "outliers": int(codes["outlier_pos"].numel())}

        def ref_encode() -> None:
            for i in range(layer.heads):
                rc.encode(xg[i], cals[i])

        ref_parts = [rc.encode(xg[i], cals[i]) for i in range(layer.heads)]

        def ref_decode() -> None:
            for i, p in enumerate(ref_parts):
                rc.decode(p, cals[i], device)

        rows.append({"impl": "calibrated torch reference encode (head loop)", "setting": name,
                     "ms": bench(ref_encode)})
        rows.append({"impl": "calibrated torch reference decode (head loop)", "setting": name,
                     "ms": bench(ref_decode)})
        enc = dec = 0.0
        for i, c in enumerate(codecs):
            c.roundtrip(x[i], threads=1)  # warm-up
            enc += c.roundtrip(x[i], threads=1)[1]["encode_seconds"]
            dec += c.roundtrip(x[i])[1]["decode_seconds"]
        rows.append({"impl": "calibrated Rust CPU encode (1 core)", "setting": name, "ms": enc * 1e3})
        rows.append({"impl": f"calibrated Rust CPU decode ({os.cpu_count()} cores)", "setting": name,
                     "ms": dec * 1e3})
    return {"rows": rows, "checks": checks}


# ---------------------------------------------------------------------------------------------
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
    from kernels.attention import parity as attention_parity

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


def _attention_lines(at: Dict[str, Any]) -> List[str]:
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


def _generation_lines(gen: Dict[str, Any]) -> List[str]:
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


# ---------------------------------------------------------------------------------------------
# Report.


def environment(device: str) -> Dict[str, Any]:
    import torch
    import triton

    import kakeyaturbo as kt

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "none (CPU, Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "kakeyaturbo": kt.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


def _fuzz_lines(fz: Dict[str, Any]) -> List[str]:
    unit = "head" if fz["mode"] == "calibrated" else "block"
    lines = [
        f"### {fz['mode']} mode",
        "",
        f"{'full fuzz' if fz['full'] else 'fuzz subset'}: "
        f"{fz['groups_planned'] - len(fz['groups_not_run'])} of {fz['groups_planned']} groups in "
        f"{fz['seconds']:.0f} s; {unit} comparisons: "
        f"reference {fz['block_comparisons']['reference']}, kernels {fz['block_comparisons']['kernels']}; "
        f"{sum(fz['compared_values'].values())} values compared; "
        f"{len(fz['near_threshold'])} near-threshold disagreements; {fz['undetermined_rows']} rows with "
        f"undetermined indices; max decode error {fz['max_decode_error']:.2e}; "
        f"**{'PASS' if fz['passed'] else 'FAIL'}**",
        "",
    ]
    lines += [f"- failure: {f}" for f in fz["failures"][:20]]
    lines += [f"- near: {n}" for n in fz["near_threshold"][:20]]
    return lines + [""]


def markdown(res: Dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        f"# Triton kernels: parity and timing{' (dry run)' if res['dry_run'] else ''}",
        "",
        f"{env['date']} | {env['gpu']} | torch {env['torch']} | triton {env['triton']} | "
        f"kakeyaturbo {env['kakeyaturbo']} | Python {env['python']} | {env['cpu_count']} CPUs",
        "",
    ]
    if res.get("fuzz"):
        lines += ["## Parity with the Rust codec", ""]
        for fz in res["fuzz"].values():
            lines += _fuzz_lines(fz)
    if res.get("attention"):
        lines += _attention_lines(res["attention"])
    if res.get("generation"):
        lines += _generation_lines(res["generation"])
    tm = res.get("timing")
    if not tm:
        return "\n".join(lines) + "\n"
    lay = tm["layer"]
    lines += [
        f"## Timing: {lay['heads']} heads x {lay['tokens']} tokens x {lay['dim']}, bf16, "
        f"blocks of {lay['block']} (per-block mode), one calibration per head (calibrated mode)",
        "",
        "GB/s = bytes of the bf16 layer / time; x copy = copy time / time.",
        "",
        "| impl | setting | ms | GB/s | x copy |",
        "|---|---|---|---|---|",
    ]
    for r in tm["rows"]:
        lines.append(
            f"| {r['impl']} | {r['setting']} | {r['ms']:.4g} | {r['GB/s']:.4g} | {r['x copy']:.3g} |"
        )
    lines.append("")
    for name, c in tm["checks"].items():
        if "heads" in c:
            lines.append(
                f"- {name}: timed encode vs Rust, {c['heads']} heads: "
                f"{len(c['near_threshold'])} near-threshold disagreements, {c['undetermined_values']} "
                f"undetermined values; m {c['m']}, row bytes {c['row_bytes']}, {c['outliers']} outliers"
            )
        else:
            lines.append(
                f"- {name}: timed encode vs Rust, {c['blocks']} blocks: "
                f"{len(c['near_threshold'])} near-threshold disagreements, {c['undetermined_rows']} "
                f"undetermined rows; mean d_eff {c['mean_d_eff']:.1f}, "
                f"{c['outliers']} outliers"
            )
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for gpu_bench.json and gpu_bench.md")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--workers", type=int, default=8, help="fuzz worker processes")
    ap.add_argument("--budget-s", type=float, default=280.0, help="wall-clock budget of the whole run")
    ap.add_argument("--parts", default="codec,attention,generation",
                    help="comma-separated: codec (its fuzz and timing), attention (its parity and timing), "
                         "generation (decode steps through KakeyaCache against DynamicCache)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton and the kernels are imported
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on a CPU", file=sys.stderr)
        return 2
    layer = TINY if args.dry_run else REAL
    # The timings need about two and a half minutes on the GPU; each codec fuzz gets a third of
    # the rest, the attention's parity what they leave (below).
    parts = set(args.parts.split(","))
    if not parts or not parts <= {"codec", "attention", "generation"}:
        print(f"--parts takes codec, attention and/or generation, got {args.parts!r}", file=sys.stderr)
        return 2
    # The generation part takes about a minute; the fuzzes share what the timings leave.
    share = max(10.0, args.budget_s - 180.0 - (60.0 if "generation" in parts else 0.0)) / 3
    fuzz = {} if "codec" not in parts else {
        mode: run_fuzz(
            full=not args.dry_run,
            device=device,
            workers=1 if args.dry_run else args.workers,
            budget_s=share,
            limit=2 if args.dry_run else None,
            mode=mode,
        )
        for mode in ("blocks", "calibrated")
    }
    timing = run_timing(layer, device, args.dry_run) if "codec" in parts else None
    # The attention's parity takes what is left but its timing's minute and a bit (its cases
    # compile a specialisation each, about 5 s apiece on the device).
    attention = None if "attention" not in parts else run_attention(
        device, args.dry_run, max(share, args.budget_s - (time.perf_counter() - t0) - 75
                                  - (60.0 if "generation" in parts else 0.0)))
    generation = run_generation(device, args.dry_run) if "generation" in parts else None
    res = {"dry_run": args.dry_run, "environment": environment(device), "fuzz": fuzz, "timing": timing,
           "attention": attention, "generation": generation, "seconds": time.perf_counter() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (args.out / "gpu_bench.md").write_text(md)
    print(md)
    print(f"total {res['seconds']:.0f} s; wrote gpu_bench.json and gpu_bench.md under {args.out}")
    passed = all(f["passed"] for f in fuzz.values()) and (
        attention is None or (attention["fuzz"]["passed"] and attention["rope_fuzz"]["passed"]))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
