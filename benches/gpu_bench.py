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
Exit status 0 when every parity check passed, 1 otherwise. Items 1 and 2 live in ``gpu_codec.py``,
3 and 4 in ``gpu_attention.py``; this file reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from gpu_attention import attention_lines, generation_lines, run_attention, run_generation
from gpu_codec import REAL, TINY, fuzz_lines, run_fuzz, run_timing, timing_lines


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
            lines += fuzz_lines(fz)
    if res.get("attention"):
        lines += attention_lines(res["attention"])
    if res.get("generation"):
        lines += generation_lines(res["generation"])
    if res.get("timing"):
        lines += timing_lines(res["timing"])
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
