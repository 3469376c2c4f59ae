"""The codec part of ``benches/gpu_bench.py`` (its items 1 and 2): the parity fuzz of both modes
in worker processes, and the timing of a realistic layer through the kernels, the torch
reference and the Rust CPU path; also the timers the attention part uses."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/kernels/, the parity harness, as the package "tests.kernels"




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
        from tests.kernels.calibrated import parity as calibrated_parity

        return calibrated_parity
    from tests.kernels.perblock import parity

    return parity


def fuzz_worker(gids: Sequence[int], full: bool, device: str, threads: int,
                mode: str = "blocks") -> List[Dict[str, Any]]:
    """Runs groups ``gids`` of a mode's fuzz through the reference and the kernels."""
    import torch
    from tests.kernels import harness

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
    from tests.kernels import harness
    from tests.kernels.perblock import parity

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
    from tests.kernels import harness
    from tests.kernels.calibrated import parity as calibrated_parity

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


def fuzz_lines(fz: Dict[str, Any]) -> List[str]:
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


def timing_lines(tm: Dict[str, Any]) -> List[str]:
    """The markdown of :func:`run_timing`'s result."""
    lay = tm["layer"]
    lines = [
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
    return lines
