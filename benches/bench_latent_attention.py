"""One decode step of multi-head latent attention (DeepSeek V2/V3's MLA, in its absorbed form),
all heads of one layer, over the calibrated codes (``kakeyaturbo.decode_attention(...,
latent=True)``, the Rust kernel) against torch's ``scaled_dot_product_attention`` over the
float cache, in the same run.

An MLA layer caches per token one latent row (``kv_lora_rank`` = 512 wide) and one rotated key
part (64 wide); the cache codes them as its K and V streams. Shapes: 16 query heads (DeepSeek-V2-Lite)
and 128 (DeepSeek V3), each head's key without RoPE and value 128 wide. Per stream a calibration
fitted by ``calibration.fit_stream`` on a decaying spectrum (component ``j``'s variance ``0.99 **
j`` for the latent, ``0.93 ** j`` for the rotated part: about 170:1 and 100:1 from first to last,
flatter than the other benchmark's, so that most components get bits), water-filled at each of
``--bits``; T rows sealed in blocks of 512, one query token per head, one raw tail row. Methods,
timed in turns as in ``bench_decode_attention.py`` (``median_ms``):

- ``codes``: ``decode_attention(codes, q, ..., latent=True)``, threads 1, 2 and None (``codes
  auto``: the kernel's own choice, what a cache passes by default): every score from both
  streams' codes, the value sum over the latent's codes, synthesised once per head; ``q`` is
  every head's query already in the latent space (``W_uk^T q_nope``) and its rotated part;
- ``SDPA fp32``: ``scaled_dot_product_attention(q, [latent, rotated], latent)`` over the float32
  rows a ``DynamicCache`` of the model holds (keys 576 wide, values 512), every head's query a
  row of one call (one kv-head; with ``enable_gqa`` torch's CPU SDPA copied the cache once per
  head, 45x slower at 2k): the same absorbed attention over the float cache, as serving engines
  run MLA;
- ``expand + SDPA``: what transformers' modeling code computes with a ``DynamicCache`` (two
  threads, fewer repetitions): ``kv_b_proj`` over every cached latent row (each head's key and
  value, 256 numbers per head and row), then SDPA over the heads.

Neither absorbed method includes the per-head projections into and out of the latent space
(``W_uk``, ``W_uv``: the same in both, ``H x 128 x 512`` multiply-adds each per query token).
Each call attends the next of ``--layers`` copies of the layer (8 by default; DeepSeek-V2-Lite
has 27 layers), so that a float cache is not warm in this CPU's L3 from the previous call. The
agreement of the three is checked in the same run (the codes against SDPA over their decoded
rows; the absorbed float form against the expanded one, up to ``--expand-max``). Writes
``bench-out/latent_attention.json`` and ``.md``.

    .venv/bin/python benches/bench_latent_attention.py [--tokens 2048,8192,32768] [--bits 3,4]
        [--heads 16,128] [--reps 15] [--layers 8] [--expand-max 8192] [--out bench-out]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_decode_attention.py

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench_decode_attention as bda  # noqa: E402
import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo.reference.attention import decoded_kv  # noqa: E402

LORA, ROT, NOPE, VHEAD = 512, 64, 128, 128
#: The model's score scale, 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim).
SCALE = 1.0 / math.sqrt(NOPE + ROT)


def run(tokens: List[int], bits: List[float], heads: List[int], reps: int, layers: int,
        expand_max: int) -> List[Dict[str, Any]]:
    rows = []
    for h in heads:
        g = np.random.default_rng(h)
        w_kv = torch.from_numpy((g.standard_normal((h * (NOPE + VHEAD), LORA)) / math.sqrt(LORA)).astype(np.float32))
        for b in bits:
            for t in tokens:
                codes, lat, rot, another = bda.layer(1, LORA, t, b, dv=ROT, decay=(0.99, 0.93))
                q = (g.standard_normal((1, h, 1, LORA + ROT)) / math.sqrt(LORA + ROT)).astype(np.float32)
                tail_k, tail_v = lat[:, :, -1:].copy(), rot[:, :, -1:].copy()
                qt = torch.from_numpy(q)
                lat_t, rot_t = torch.from_numpy(lat), torch.from_numpy(rot)
                cache = [(codes, torch.cat([lat_t, rot_t], -1), lat_t)] + [
                    (another(i), torch.cat([lat_t, rot_t], -1), lat_t.clone()) for i in range(1, layers)]

                def codes_fn(threads: Optional[int]) -> Callable[[], Any]:
                    return bda.cycle([lambda c=c: kt.decode_attention(
                        c[0], q, tail_k, tail_v, threads=threads, scale=SCALE, latent=True) for c in cache])

                # One kv-head: the heads' queries are rows of one attention call (with
                # enable_gqa torch's CPU SDPA copied the cache once per head: 45x slower at 2k).
                q_rows = qt.view(1, 1, h, LORA + ROT)

                def sdpa_fn() -> Callable[[], Any]:
                    return bda.cycle([lambda c=c: F.scaled_dot_product_attention(
                        q_rows, c[1], c[2], scale=SCALE) for c in cache])

                # The model's own path over the float cache: expand every latent row, then SDPA.
                q_full = torch.from_numpy((g.standard_normal((1, h, 1, NOPE + ROT)) / math.sqrt(NOPE + ROT))
                                          .astype(np.float32))

                def expand(lat_rows: torch.Tensor, rot_rows: torch.Tensor) -> torch.Tensor:
                    kv = F.linear(lat_rows[0, 0], w_kv).view(-1, h, NOPE + VHEAD).transpose(0, 1)
                    k = torch.cat([kv[..., :NOPE], rot_rows[0, 0][None].expand(h, -1, -1)], -1)
                    return F.scaled_dot_product_attention(q_full, k[None], kv[None, ..., NOPE:], scale=SCALE)

                fns = {}
                for n in (1, 2):
                    fns[f"codes {n}t"] = codes_fn(n)
                    fns[f"SDPA fp32 {n}t"] = bda.with_torch_threads(n, sdpa_fn())
                # What a cache passes by default: the kernel picks the calling thread or all cores.
                fns["codes auto"] = codes_fn(None)
                for f in fns.values():
                    for _ in cache:
                        f()
                load0 = os.getloadavg()
                ms = bda.median_ms(fns, reps)
                if t <= expand_max:
                    ms.update(bda.median_ms({"expand + SDPA 2t": bda.with_torch_threads(
                        2, lambda: expand(lat_t, rot_t))}, max(3, reps // 5)))
                load1 = os.getloadavg()
                # Agreement: the codes against SDPA over their decoded rows (and the raw tail);
                # the absorbed float form against the expanded one.
                ours = kt.decode_attention(codes, q, tail_k, tail_v, scale=SCALE, latent=True)
                dl, dr = (x.float() for x in decoded_kv(codes, None, None, tail_k, tail_v))
                ref = F.scaled_dot_product_attention(q_rows, torch.cat([dl, dr], -1), dl,
                                                     scale=SCALE).view(1, h, 1, LORA).numpy()
                absorbed_vs_expanded = None
                if t <= expand_max:  # the expansion holds H x 256 floats per row (GBs past 8k at 128 heads)
                    wk = w_kv.view(h, NOPE + VHEAD, LORA)
                    q_abs = torch.cat([torch.einsum("hd,hdr->hr", q_full[0, :, 0, :NOPE], wk[:, :NOPE]),
                                       q_full[0, :, 0, NOPE:]], -1)[None, None]
                    absorbed = torch.einsum("hr,hvr->hv", F.scaled_dot_product_attention(
                        q_abs, cache[0][1], cache[0][2], scale=SCALE)[0, 0], wk[:, NOPE:])
                    absorbed_vs_expanded = float((absorbed - expand(lat_t, rot_t)[0, :, 0]).abs().max())
                held = 8 * sum(c[0].nbytes for c in cache) / (t * (LORA + ROT) * len(cache))
                row = {
                    "q_heads": h, "T": t, "bits_target": b, "bits_held": held,
                    "m_latent": codes.k_codecs[0].m, "m_rot": codes.v_codecs[0].m,
                    "codes_bytes": codes.nbytes, "fp32_bytes": t * (LORA + ROT) * 4, "layers": layers,
                    "ms": ms, "load_before": load0, "load_after": load1,
                    "max_abs_diff_vs_decoded_sdpa": float(np.abs(ours - ref).max()),
                    "max_abs_diff_absorbed_vs_expanded": absorbed_vs_expanded,
                }
                for n in (1, 2):
                    row[f"speedup_vs_sdpa_fp32_{n}t"] = ms[f"SDPA fp32 {n}t"] / ms[f"codes {n}t"]
                rows.append(row)
                print(f"H={h} T={t} bits={b}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items())
                      + f" | load {load0[0]:.2f}->{load1[0]:.2f}", flush=True)
                cache = []  # the layers' copies go before the next size (the closures above are done)
    return rows


def markdown(res: Dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# One decode step of multi-head latent attention over the codes vs torch SDPA over the float cache",
        "",
        f"{bda.machine(env)} | median of "
        f"{res['reps']} repetitions (methods taking turns, {res['pause_ms']:g} ms pause before each call; "
        f"`expand + SDPA` fewer) | each call attends the next of {res['layers']} copies of the layer | "
        f"load average (1 min) {res['load_min']:.2f}..{res['load_max']:.2f}",
        "",
        "ms per step, one layer, all heads, one query token per head, kv_lora_rank 512 + rotated part 64; "
        "x = SDPA fp32 (absorbed, over the float latent cache) time / codes time at the same thread "
        "count (> 1: the codes are faster); `expand + SDPA`: transformers' own path over a DynamicCache "
        "(every cached latent row expanded into each head's key and value, then SDPA); m: the latent's / "
        "the rotated part's components with bits; `codes auto`: `threads=None` (what `KakeyaCache` passes by "
        "default: small calls on the calling thread, else all cores), x against SDPA fp32 2t.",
        "",
        "| heads | T | bits held | m | codes 1t | SDPA fp32 1t | x 1t | codes 2t | SDPA fp32 2t | x 2t "
        "| codes auto | x auto | expand + SDPA 2t | MB codes / fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        ms = r["ms"]
        exp = ms.get("expand + SDPA 2t")
        lines.append(
            f"| {r['q_heads']} | {r['T']} | {r['bits_held']:.2f} | {r['m_latent']} / {r['m_rot']} | "
            f"{ms['codes 1t']:.3f} | {ms['SDPA fp32 1t']:.3f} | {r['speedup_vs_sdpa_fp32_1t']:.2f} | "
            f"{ms['codes 2t']:.3f} | {ms['SDPA fp32 2t']:.3f} | {r['speedup_vs_sdpa_fp32_2t']:.2f} | "
            + ("- | - | " if "codes auto" not in ms else
               f"{ms['codes auto']:.3f} | {ms['SDPA fp32 2t'] / ms['codes auto']:.2f} | ")
            + ("-" if exp is None else f"{exp:.1f}")
            + f" | {r['codes_bytes'] / 1e6:.2f} / {r['fp32_bytes'] / 1e6:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--bits", default="3,4")
    ap.add_argument("--heads", default="16,128", help="query heads per layer")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pause-ms", type=float, default=5.0)
    ap.add_argument("--layers", type=int, default=8, help="copies of the layer, attended in turn")
    ap.add_argument("--expand-max", type=int, default=8192,
                    help="time `expand + SDPA` up to this many tokens (it costs seconds per step past it)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    bda.PAUSE_S = args.pause_ms / 1e3
    rows = run([int(t) for t in args.tokens.split(",")], [float(b) for b in args.bits.split(",")],
               [int(h) for h in args.heads.split(",")], args.reps, args.layers, args.expand_max)
    loads = [x for r in rows for x in (r["load_before"][0], r["load_after"][0])]
    res = {"environment": bda.environment(), "reps": args.reps, "pause_ms": args.pause_ms,
           "layers": args.layers, "load_min": min(loads), "load_max": max(loads), "rows": rows}
    bda.write(Path(args.out), "latent_attention", res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
