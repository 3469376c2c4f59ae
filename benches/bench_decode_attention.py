"""One decode step of attention, all heads of one layer, over the calibrated codes
(``kakeyaturbo.decode_attention``, the Rust kernel) against torch's
``scaled_dot_product_attention`` over the float cache, in the same run.

For each shape (the default model's 9 query / 3 kv-heads at head_dim 64, and 32 / 8 at 128),
context length T and bits per element: per kv-head a K and a V calibration fitted by
``calibration.fit_stream`` on a decaying spectrum (water-filled bits; the fp16 row scale
counted), T rows of their model sealed in blocks of 512, one query token per query head, one
raw tail row (the query's own). Timed in turns (``median_ms``: runs of up to 5 calls of one
method after an untimed one) so that every method sees the same machine:

- ``codes``: ``decode_attention`` over the codes (threads 1 and 2), keys coded after RoPE
  (scores from look-up tables);
- ``codes pre-RoPE``: the same codes read as keys coded before RoPE (a ``RopeTable`` of base
  10000 for positions ``0 .. T-1``): each tile of keys synthesised, rotated and dotted inside
  the kernel, as the shipped recipes need (``--synthesis``: how, as ``decode_attention``'s
  argument; bf16 by default);
- ``SDPA fp32``: ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` over the float32
  cache a CPU ``DynamicCache`` holds (``torch.set_num_threads`` 1 and 2); ``SDPA bf16`` the
  same over a bfloat16 cache, timed in a pass of its own after the others;
- ``decode + SDPA``: today's ``KakeyaCache`` path at 2 threads (every block decoded by the
  Rust decoder, then SDPA fp32), fewer repetitions.

torch's OpenMP threads are told to sleep when idle (``OMP_WAIT_POLICY=PASSIVE``), so that
their spinning does not slow whichever method runs next; ``--omp-default`` leaves torch's own
policy (its threads spin a while after each parallel region, as in generation), under which the
codes' two-thread calls run on those very threads (``kakeyaturbo.attention_team``). Reported: median ms over the
repetitions, speed-up against SDPA fp32 at the same thread
count, bytes held, and the machine's load average before and after (``os.getloadavg``; 2
cores here, shared). Writes ``bench-out/decode_attention.json`` and ``.md``.

With ``--recipes calibrated-3bit,calibrated-4bit`` the codes are those of the default model's
calibrated codecs for each recipe (its shape, 9 / 3 x 64; the statistics collected on first use
as ``make eval`` does, minutes on 2 cores), copy ``i`` of ``--layers`` coded with the model's
layer ``i``: the components and bits the shipped recipes really synthesise (fewer key
components than the synthetic spectrum's). The rows are random; the kernel's time does not
depend on their values.

With ``--layers N`` every method attends N copies of the layer in turn (codes with codecs of
their own, float caches cloned; at most ``--layers-mb`` of them per row), as a model's decode
step reads one layer's cache after the others': with one copy the float cache of a layer stays
in this CPU's L3 cache from call to call (12.6 MB at 8k for the default model's shape), which
no model with more than a couple of layers sees at 8k.

    .venv/bin/python benches/bench_decode_attention.py [--tokens 2048,8192,32768]
        [--bits 3,4] [--reps 15] [--pause-ms 5] [--layers 1] [--recipes ''] [--first-layer 0]
        [--synthesis bf16] [--omp-default] [--out bench-out]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

# torch's OpenMP threads spin for a while after each parallel region; on 2 cores that took the
# cores from whatever ran next (a 0.25 ms step measured 2 ms right after SDPA). They sleep
# instead (set before torch loads its OpenMP runtime), unless --omp-default.
if "--omp-default" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration  # noqa: E402
from kakeyaturbo.codec.calibrated import SYNTHESES  # noqa: E402

SHAPES = ((9, 3, 64), (32, 8, 128))
BLOCK = 512


def layer(hkv: int, d: int, tokens: int, bits: float, seed: int = 0, dv: Optional[int] = None,
          decay: Tuple[float, float] = (0.9, 0.9)
          ) -> Tuple[kt.LayerCodes, np.ndarray, np.ndarray, Callable[[int], kt.LayerCodes]]:
    """Codes of ``tokens`` rows per kv-head (calibrations water-filled at ``bits`` on a decaying
    spectrum: component ``j`` of K / V has variance ``decay[0 / 1] ** j`` times a draw in 0.5 ..
    1.5), the float K and V they code, ``[1, H_kv, T, D]`` (V ``dv`` wide if given), and a
    function that makes another copy of the codes (its argument, the copy's index, unused) in
    memory of its own (codecs built again, bytes copied): one more layer of a model for
    ``--layers``."""
    g = np.random.default_rng(seed)
    heads, fits = [], []
    for i in range(2 * hkv):
        w, dec = (d, decay[0]) if i < hkv else (dv or d, decay[1])
        q, _ = np.linalg.qr(g.standard_normal((w, w)))
        lam = dec ** np.arange(w) * g.uniform(0.5, 1.5, w)
        mean = 0.3 * g.standard_normal(w)
        fit = calibration.fit_stream(mean, (q * lam) @ q.T, bits)
        fits.append(fit)
        heads.append((fit.codec(), mean, q, lam))
    x = [(h[1] + (g.standard_normal((tokens, len(h[1]))) * np.sqrt(h[3])) @ h[2].T).astype(np.float32)
         for h in heads]
    blocks = [[h[0].encode(x[i][start:start + BLOCK], threads=1) for i, h in enumerate(heads)]
              for start in range(0, tokens, BLOCK)]

    def build(codecs: List[Any], copy: bool) -> kt.LayerCodes:
        codes = kt.LayerCodes(codecs[:hkv], codecs[hkv:])
        for blobs in blocks:
            if copy:
                blobs = [bytes(bytearray(b)) for b in blobs]
            codes.append_blocks([blobs[:hkv]], [blobs[hkv:]])
        return codes

    codes = build([h[0] for h in heads], False)
    return (codes, np.stack(x[:hkv])[None], np.stack(x[hkv:])[None],
            lambda i: build([fit.codec() for fit in fits], True))


def model_layer(mc: Any, hkv: int, d: int, tokens: int, seed: int = 0
                ) -> Tuple[kt.LayerCodes, np.ndarray, np.ndarray, Callable[[int], kt.LayerCodes]]:
    """:func:`layer` with the calibrated codecs of a model (``mc``, a ``ModelCodec``): the
    codes of layer 0, the float K and V (random rows; the kernel's time does not depend on
    their values), and a function making the codes of the same rows for layer ``i`` (modulo
    the model's layers) with that layer's own codecs."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((2 * hkv, tokens, d)).astype(np.float32)
    n_layers = 1 + max(layer for _, layer, _ in mc.codecs)

    def build(i: int) -> kt.LayerCodes:
        codecs = [mc.codecs[(s, i % n_layers, h)] for s in "kv" for h in range(hkv)]
        codes = kt.LayerCodes(codecs[:hkv], codecs[hkv:])
        for start in range(0, tokens, BLOCK):
            blobs = [c.encode(x[j, start:start + BLOCK], threads=1) for j, c in enumerate(codecs)]
            codes.append_blocks([blobs[:hkv]], [blobs[hkv:]])
        return codes

    return build(0), x[None, :hkv], x[None, hkv:], build


PAUSE_S = 0.005


def median_ms(fns: Dict[str, Callable[[], Any]], reps: int) -> Dict[str, float]:
    """Median wall time of each function over ``reps`` timed calls, taken in runs of one
    function at a time (a call, untimed, then up to 5 timed ones), the functions taking turns
    until every one has its ``reps``; a pause (``--pause-ms``, default 5) before each call.
    On 2 cores the thread pools of one method disturb the first call of the next (idle rayon
    or OpenMP workers spinning, or torch re-sizing its pool): interleaved call by call, each
    two-thread time depended on which method came before it (2026-12-04, 32/8 x 128 at 8k,
    pre-RoPE on two threads: 7.17 ms interleaved, 4.49 ms in turns, docs/decode-attention.md). The untimed call absorbs that; the turns keep every method's calls spread over
    the run."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    while any(len(v) < reps for v in times.values()):
        for k, f in fns.items():
            todo = min(5, reps - len(times[k]))
            if todo <= 0:
                continue
            time.sleep(PAUSE_S)
            f()
            for _ in range(todo):
                time.sleep(PAUSE_S)
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def with_torch_threads(n: int, f: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return f()
        finally:
            torch.set_num_threads(old)

    return run


def cycle(fns: List[Callable[[], Any]]) -> Callable[[], Any]:
    """Each call runs the next of ``fns`` in turn: one layer after another, as a model's decode
    step reads its layers' caches."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def sources(bits: List[float], model_recipes: List[str]
            ) -> List[Tuple[int, int, int, Any, Callable, int]]:
    """``(q heads, kv-heads, D, bits label, builder(T), default --layers)`` of every row group:
    the synthetic calibrations of :data:`SHAPES` at each of ``bits``, or (``--recipes``) the
    default model's codecs of each recipe (its statistics collected on first use, as ``make
    eval`` does)."""
    if not model_recipes:
        return [(hq, hkv, d, b, lambda t, hkv=hkv, d=d, b=b: layer(hkv, d, t, b), 1)
                for hq, hkv, d in SHAPES for b in bits]
    from kakeyaturbo import assets, calibration, recipes
    from kakeyaturbo.cache import codec_for
    from kakeyaturbo.eval import model as model_mod
    model_path, text_path = assets.default_model(), assets.default_text()
    model, tok = model_mod.load(model_path)
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    out = []
    for name in model_recipes:
        rec = recipes.load(name)
        stats, sens = calibration.for_recipe(rec, model, tok, model_path, text_path)
        mc = codec_for(rec, stats=stats, sensitivity=sens)
        out.append((hq, hkv, d, rec.name, lambda t, mc=mc: model_layer(mc, hkv, d, t),
                    cfg.num_hidden_layers))
    return out


def run(tokens: List[int], bits: List[float], reps: int, layers: Optional[int] = None,
        layers_mb: float = 6000.0, model_recipes: List[str] = (), first_layer: int = 0,
        synthesis: str = "bf16") -> List[Dict[str, Any]]:
    rows = []
    for hq, hkv, d, b, build, all_layers in sources(bits, list(model_recipes)):
        for t in tokens:
            codes, k, v, another = build(t)
            g = np.random.default_rng(1)
            q = (g.standard_normal((1, hq, 1, d)) / np.sqrt(d)).astype(np.float32)
            tail_k = k[:, :, -1:].copy()
            tail_v = v[:, :, -1:].copy()
            qt = torch.from_numpy(q)
            kf, vf = torch.from_numpy(k), torch.from_numpy(v)
            kb, vb, qb = kf.to(torch.bfloat16), vf.to(torch.bfloat16), qt.to(torch.bfloat16)
            # --layers: as many copies of the layer as fit in --layers-mb (codes, float32
            # and bfloat16 caches together), each call of a method attending the next.
            per_mb = (codes.nbytes + 1.5 * (k.nbytes + v.nbytes)) / 1e6
            n_layers = max(1, min(layers or all_layers, int(layers_mb // per_mb)))
            if first_layer:
                codes = another(first_layer)
            cache = [(codes, kf, vf, kb, vb)] + [
                (another(first_layer + i), kf.clone(), vf.clone(), kb.clone(), vb.clone())
                for i in range(1, n_layers)]

            table, positions = rope_table(t, d)

            def codes_fn(threads: int) -> Callable[[], Any]:
                return cycle([lambda c=c: kt.decode_attention(c[0], q, tail_k, tail_v, threads=threads)
                              for c in cache])

            def rope_fn(threads: int) -> Callable[[], Any]:
                return cycle([lambda c=c: kt.decode_attention(c[0], q, tail_k, tail_v, threads=threads,
                                                              rope=table, positions=positions,
                                                              synthesis=synthesis)
                              for c in cache])

            def sdpa(qq: torch.Tensor, at: int) -> Callable[[], Any]:
                return cycle([lambda c=c: F.scaled_dot_product_attention(qq, c[at], c[at + 1],
                                                                          enable_gqa=True)
                              for c in cache])

            fns = {}
            for n in (1, 2):
                fns[f"codes {n}t"] = codes_fn(n)
                fns[f"codes pre-RoPE {n}t"] = rope_fn(n)
                fns[f"SDPA fp32 {n}t"] = with_torch_threads(n, sdpa(qt, 1))
            # Every copy once per method, untimed: a codec derives its synthesis tables for
            # keys coded before RoPE on first use (once per layer in a model's life).
            for f in fns.values():
                for _ in cache:
                    f()
            load0 = os.getloadavg()
            ms = median_ms(fns, reps)
            # bfloat16 SDPA in a pass of its own: it is not a baseline of the ratios, and
            # its one-thread call is the slowest neighbour a two-thread call could have.
            ms.update(median_ms({f"SDPA bf16 {n}t": with_torch_threads(n, sdpa(qb, 3))
                                 for n in (1, 2)}, reps))

            def decode_then_sdpa() -> Any:
                ks = [np.concatenate([codes.k_codecs[h].decode(codes.blob(0, h, "k", i))
                                      for i in range(codes.num_blocks(0, h))]) for h in range(hkv)]
                vs = [np.concatenate([codes.v_codecs[h].decode(codes.blob(0, h, "v", i))
                                      for i in range(codes.num_blocks(0, h))]) for h in range(hkv)]
                kk = torch.from_numpy(np.concatenate([np.stack(ks), tail_k[0]], axis=1)[None])
                vv = torch.from_numpy(np.concatenate([np.stack(vs), tail_v[0]], axis=1)[None])
                return F.scaled_dot_product_attention(qt, kk, vv, enable_gqa=True)

            ms.update(median_ms({"decode + SDPA 2t": with_torch_threads(2, decode_then_sdpa)},
                                max(3, reps // 5)))
            load1 = os.getloadavg()
            # Agreement with SDPA over the decoded cache (the same numbers, another order).
            ours = kt.decode_attention(codes, q, tail_k, tail_v)
            dec = decode_then_sdpa().numpy()
            ours_r = kt.decode_attention(codes, q, tail_k, tail_v, threads=2, rope=table,
                                         positions=positions, synthesis=synthesis)
            ks = np.stack([np.concatenate([codes.k_codecs[h].decode(codes.blob(0, h, "k", i))
                                           for i in range(codes.num_blocks(0, h))]) for h in range(hkv)])
            kr = torch.from_numpy(np.concatenate([rotate(ks, table), tail_k[0]], axis=1)[None])
            vr = torch.from_numpy(np.concatenate([np.stack([np.concatenate(
                [codes.v_codecs[h].decode(codes.blob(0, h, "v", i)) for i in range(codes.num_blocks(0, h))])
                for h in range(hkv)]), tail_v[0]], axis=1)[None])
            dec_r = F.scaled_dot_product_attention(qt, kr, vr, enable_gqa=True).numpy()
            row = {
                "q_heads": hq, "kv_heads": hkv, "head_dim": d, "T": t, "bits_target": b,
                # over every copy (with --recipes each its own layer's codecs)
                "bits_held": 8 * sum(c[0].nbytes for c in cache) / (2 * t * hkv * d * len(cache)),
                "m_k_mean": float(np.mean([m.m for c in cache for m in c[0].k_codecs])),
                "m_k": [c.m for c in codes.k_codecs], "m_v": [c.m for c in codes.v_codecs],
                "codes_bytes": sum(c[0].nbytes for c in cache) / len(cache),
                "fp32_bytes": 2 * t * hkv * d * 4, "layers": n_layers,
                "ms": ms, "load_before": load0, "load_after": load1,
                "max_abs_diff_vs_decoded_sdpa": float(np.abs(ours - dec).max()),
                "max_abs_diff_pre_rope_vs_decoded_rotated_sdpa": float(np.abs(ours_r - dec_r).max()),
            }
            for n in (1, 2):
                row[f"speedup_vs_sdpa_fp32_{n}t"] = ms[f"SDPA fp32 {n}t"] / ms[f"codes {n}t"]
                row[f"speedup_pre_rope_vs_sdpa_fp32_{n}t"] = ms[f"SDPA fp32 {n}t"] / ms[f"codes pre-RoPE {n}t"]
            rows.append(row)
            print(f"{hq}/{hkv}x{d} T={t} bits={b}: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items())
                  + f" | {n_layers} layer(s) | load {load0[0]:.2f}->{load1[0]:.2f}", flush=True)
            cache = []  # the layers' copies go before the next size (the closures above are done)
    return rows


def rope_table(tokens: int, d: int) -> Tuple[kt.RopeTable, np.ndarray]:
    """A base-10000 rotary table over every dimension for positions ``0 .. tokens`` and the
    sealed rows' positions ``[1, T]``: every row of :func:`layer`'s blocks, the last one
    partial where ``T`` is not a whole number of blocks (the tail row sits at ``tokens``)."""
    inv = (1.0 / 10000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
    ang = (np.arange(tokens + 1, dtype=np.float32)[:, None] * inv[None]).astype(np.float32)
    table = kt.RopeTable(np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), "half")
    return table, np.arange(tokens, dtype=np.int64)[None]


def rotate(k: np.ndarray, table: kt.RopeTable) -> np.ndarray:
    """RoPE (the ``half`` pairing) on rows ``[H, T, D]`` at positions ``0 .. T-1``."""
    h = table.cos.shape[1]
    c, s = table.cos[:k.shape[1]], table.sin[:k.shape[1]]
    a, b = k[..., :h], k[..., h:2 * h]
    return np.concatenate([a * c - b * s, b * c + a * s, k[..., 2 * h:]], axis=-1).astype(np.float32)


def markdown(res: Dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# One decode step of attention over the codes vs torch SDPA over the float cache",
        "",
        f"{machine(env)} | "
        f"median of {res['reps']} repetitions (methods taking turns in runs of up to 5 calls after an "
        f"untimed one, {res['pause_ms']:g} ms pause before each call) | OMP_WAIT_POLICY "
        f"{res['omp_wait_policy']} | load average (1 min) "
        f"{res['load_min']:.2f}..{res['load_max']:.2f}",
        "",
        "ms per step, one layer, all heads, one query token per head; x = SDPA fp32 time / codes "
        "time at the same thread count (> 1: the codes are faster); pre-RoPE: keys coded before "
        f"RoPE, synthesised ({res['synthesis']}) and rotated per tile in the kernel (the shipped recipes)."
        + (f" Each call attends the next of up to {res['layers']} copies of the layer (`--layers`; the "
           "column says how many), so that, as in a model's decode step, its cache is not the one the "
           "previous call read; `decode + SDPA` uses the first copy only." if res["layers"] > 1 else ""),
        "",
        "| q/kv heads x D | T | bits held | codes 1t | SDPA fp32 1t | x 1t | codes 2t | SDPA fp32 2t "
        "| x 2t | pre-RoPE 1t | x 1t | pre-RoPE 2t | x 2t | SDPA bf16 2t | decode + SDPA 2t "
        "| MB codes / fp32 |" + (" layers |" if res["layers"] > 1 else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if res["layers"] > 1 else ""),
    ]
    for r in res["rows"]:
        ms = r["ms"]
        lines.append(
            f"| {r['q_heads']}/{r['kv_heads']}x{r['head_dim']}"
            + (f" {r['bits_target']}" if isinstance(r['bits_target'], str) else "")
            + f" | {r['T']} | {r['bits_held']:.2f} | "
            f"{ms['codes 1t']:.3f} | {ms['SDPA fp32 1t']:.3f} | {r['speedup_vs_sdpa_fp32_1t']:.2f} | "
            f"{ms['codes 2t']:.3f} | {ms['SDPA fp32 2t']:.3f} | {r['speedup_vs_sdpa_fp32_2t']:.2f} | "
            f"{ms['codes pre-RoPE 1t']:.3f} | {r['speedup_pre_rope_vs_sdpa_fp32_1t']:.2f} | "
            f"{ms['codes pre-RoPE 2t']:.3f} | {r['speedup_pre_rope_vs_sdpa_fp32_2t']:.2f} | "
            f"{ms['SDPA bf16 2t']:.3f} | {ms['decode + SDPA 2t']:.1f} | "
            f"{r['codes_bytes'] / 1e6:.2f} / {r['fp32_bytes'] / 1e6:.1f} |"
            + (f" {r['layers']} |" if res["layers"] > 1 else ""))
    return "\n".join(lines) + "\n"


def environment() -> Dict[str, Any]:
    """The date (UTC), the CPU's model name, its cores and the versions a table names."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "kakeyaturbo": kt.__version__, "python": platform.python_version(),
            "attention_kernel": kt.attention_kernel(), "openmp_team": kt.attention_team()}


def machine(env: Dict[str, Any]) -> str:
    """The date, CPU, cores and torch of :func:`environment`, as a table's first line begins."""
    return (f"{env['date']} | {env['cpu']} | {env['cores']} cores | torch {env['torch']} | "
            f"kernel {env['attention_kernel']} | OpenMP team {env['openmp_team'] or 'none'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--bits", default="3,4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pause-ms", type=float, default=5.0,
                    help="sleep before each timed call (0: back to back, threads kept warm)")
    ap.add_argument("--layers", type=int, default=None,
                    help="copies of each layer, attended in turn (a model's layers: 30 for the "
                         "default model); 1: the same layer every call, its caches warm (default: "
                         "1, or every layer of the model with --recipes)")
    ap.add_argument("--layers-mb", type=float, default=6000.0,
                    help="at most this many MB of copies per row (fewer layers where they would not fit)")
    ap.add_argument("--recipes", default="",
                    help="comma-separated calibrated recipes: time the default model's own codecs of "
                         "each (its shape; layer i of --layers uses the model's layer i, so that "
                         "--layers 1 is layer 0 alone, whose keys get few bits) instead of the "
                         "synthetic calibrations (--bits is then unused)")
    ap.add_argument("--first-layer", type=int, default=0,
                    help="with --recipes: the model's layer the first copy is coded with (copy i "
                         "with layer first + i); e.g. --layers 1 --first-layer 15 times one layer "
                         "whose keys get a typical number of components")
    ap.add_argument("--synthesis", default="bf16", choices=SYNTHESES,
                    help="how the pre-RoPE columns synthesise the keys (kakeyaturbo.decode_attention)")
    ap.add_argument("--omp-default", action="store_true",
                    help="leave torch's OpenMP wait policy as it is (default: OMP_WAIT_POLICY=PASSIVE, "
                         "set before torch loads)")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    global PAUSE_S
    PAUSE_S = args.pause_ms / 1e3
    rows = run([int(t) for t in args.tokens.split(",")], [float(b) for b in args.bits.split(",")],
               args.reps, args.layers, args.layers_mb,
               [r for r in args.recipes.split(",") if r], args.first_layer, args.synthesis)
    loads = [x for r in rows for x in (r["load_before"][0], r["load_after"][0])]
    res = {
        "environment": environment(),
        "reps": args.reps, "pause_ms": args.pause_ms, "layers": max(r["layers"] for r in rows),
        "first_layer": args.first_layer, "synthesis": args.synthesis,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "torch's default"),
        "load_min": min(loads), "load_max": max(loads),
        "rows": rows,
    }
    write(Path(args.out), "decode_attention", res, markdown(res))
    return 0


def write(out: Path, stem: str, res: Dict[str, Any], md: str) -> None:
    """``OUT/STEM.json`` and ``OUT/STEM.md``, and the table printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    sys.exit(main())
