"""A few decode steps of the Triton attention over the codes, for a profiler to read.

    bash benches/gpu_profile.sh OUT_DIR      # on the GPU machine: ncu over these steps
    python benches/gpu_profile.py [--heads 9/3] [--dim 64] [--tokens 8192] [--bits 3] [--steps 6]
    python benches/gpu_profile.py --dry-run   # CPU, Triton's interpreter, tiny shapes

The layer is :func:`gpu_attention.attention_layer`'s (water-filled codes on a decaying spectrum,
blocks of 512 rows). Each step runs the plain kernel (keys coded after RoPE) then the one over
keys coded before RoPE (table staged once, positions on the device), so a profiler filtering
on ``_split_kernel`` / ``_combine_kernel`` sees both, in that order, ``--steps`` times; the
first step compiles. Prints one line per mode with the median wall time of the later steps
(``torch.cuda.synchronize`` around each: not a benchmark, see ``gpu_bench.py`` for that).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="9/3", help="query heads / kv-heads")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--bits", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    try:
        hq, hkv = (int(x) for x in args.heads.split("/"))
    except ValueError:
        print(f"--heads must be Q/KV, got {args.heads!r}", file=sys.stderr)
        return 2
    if hq < 1 or hkv < 1 or hq % hkv or args.dim < 2 or args.tokens < 512 or args.steps < 2:
        print("need heads Q/KV with KV dividing Q, --dim >= 2, --tokens >= 512, --steps >= 2",
              file=sys.stderr)
        return 2
    import torch

    import gpu_attention
    from kakeyaturbo import kernels as K

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on a CPU", file=sys.stderr)
        return 2
    tokens = 1024 if args.dry_run else args.tokens
    codes = gpu_attention.attention_layer(hq, hkv, args.dim, tokens, args.bits)
    layer = K.stack_layer(codes, device)
    q = torch.randn(1, hq, 1, args.dim, device=device)
    tail = torch.randn(1, hkv, 1, args.dim, device=device)
    rope, pos = gpu_attention.attention_rope(tokens, args.dim, layer.k.rows, device)
    modes = {"plain": lambda: K.decode_attention_triton(layer, q, tail, tail),
             "pre-RoPE": lambda: K.decode_attention_triton(layer, q, tail, tail, rope=rope, positions=pos)}
    times = {m: [] for m in modes}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(args.steps):
        for m, fn in modes.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[m].append(time.perf_counter() - t0)
    for m, ts in times.items():
        print(f"{hq}/{hkv}x{args.dim} T={tokens} bits={args.bits} {m}: median {statistics.median(ts[1:]) * 1e3:.3f} ms "
              f"over {len(ts) - 1} steps after the first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
