"""How well one calibration fits each domain of a mixture: the recipe's codecs fitted on the
pooled mixture (as ``eval`` builds them), each domain's own calibration rows (the ``k_samples``
and ``v_samples`` its statistics keep) coded and decoded through them, and the error weighed by
that domain's own measured sensitivity: ``tr(F_d E_d) / 2`` per (stream, layer, kv-head), ``E_d``
the second moment of the decoding error of the domain's rows and ``F_d`` its sensitivity, the
second-order prediction of what the coding costs that domain's loss (nats, summed over the
scored tokens of a window). Printed per domain and group of layers, for keys and values apart.
``--minimax N`` first moves the pooling weights of the domains, N multiplicative steps, toward
the domains whose predicted loss is largest (an allocation that bounds the worst domain).

    .venv/bin/python benches/domain_error.py [--model hard-case] --recipes calibrated-3bit \
        [--minimax 3] [--groups 6]

Only calibration text is read (the evaluation split is never touched): a diagnostic of the
calibration, not a quality figure.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from kakeyaturbo import assets, recipes
from kakeyaturbo.calibration import corpus, gather, model_codec
from kakeyaturbo.calibration.mixture import pool_sensitivity, pool_stats
from kakeyaturbo.eval import model as model_mod


def domain_parts(model, tok, path, rec):
    """``[(domain, windows, stats, sensitivity)]`` of the recipe's mixture, from the cache."""
    st = rec.calibration
    text = st.corpus
    out = []
    stat_comp = dict(corpus.composition(text, st.windows, tok))
    sens_comp = dict(corpus.composition(text, st.sensitivity_windows, tok))
    for d in stat_comp:
        s = gather.cached_stats(model, tok, path, d, replace(st, windows=stat_comp[d]),
                                rope=rec.key_rope)
        f = gather.cached_sensitivity(model, tok, path, d,
                                      replace(st, sensitivity_windows=sens_comp[d]),
                                      n_sink=max(rec.n_sink, 1), rope=rec.key_rope)
        out.append((d, stat_comp[d], s, f))
    return out


def predicted(mc, parts) -> Dict[str, np.ndarray]:
    """``{domain: [stream(k, v), layer, kv-head]}`` of ``tr(F_d E_d) / 2``."""
    out = {}
    for d, _, s, f in parts:
        L, H = s.num_layers, s.kv_heads
        res = np.zeros((2, L, H))
        for si, stream in enumerate(("k", "v")):
            rows = s.k_samples if stream == "k" else s.v_samples
            fis = f.of(stream)
            for layer in range(L):
                for h in range(H):
                    x = np.ascontiguousarray(rows[layer, h], dtype=np.float32)
                    if not x.shape[0]:
                        continue
                    c = mc.codecs.get((stream, layer, h))
                    y = x if c is None else c.decode(c.encode(x))
                    e = (y - x).astype(np.float64)
                    em = e.T @ e / len(e)
                    res[si, layer, h] = 0.5 * float(np.sum(fis[layer, h] * em))
        out[d] = res
    return out


def minimax_weights(parts, rec, iters: int, rate: float) -> Tuple[np.ndarray, List[Dict[str, float]]]:
    """Weights of the parts (starting from their window shares) moved multiplicatively toward
    the domains whose predicted loss is largest, ``iters`` times; the trace of every step."""
    w = np.array([c for _, c, _, _ in parts], dtype=np.float64)
    w /= w.sum()
    trace = []
    for _ in range(iters + 1):
        mc = pooled_codec(parts, rec, w)
        loss = np.array([v.sum() for v in predicted(mc, parts).values()])
        trace.append({"weights": dict(zip([p[0] for p in parts], map(float, w))),
                      "loss": dict(zip([p[0] for p in parts], map(float, loss)))})
        w = w * np.exp(rate * (loss / loss.mean() - 1))
        w /= w.sum()
    return w, trace


def pooled_codec(parts, rec, w):
    stats = pool_stats([(s, float(x)) for (_, _, s, _), x in zip(parts, w)])
    sens = pool_sensitivity([(f, float(x)) for (_, _, _, f), x in zip(parts, w)])
    return model_codec.ModelCodec(stats, rec, sensitivity=sens)


def main(argv: "List[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or GGUF file, or 'hard-case'")
    ap.add_argument("--recipes", default="calibrated-3bit")
    ap.add_argument("--groups", type=int, default=6, help="groups of layers")
    ap.add_argument("--minimax", type=int, default=0,
                    help="steps of the multiplicative minimax reweighting (0: the window shares)")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    path = (assets.hard_case_model() if args.model == "hard-case"
            else Path(args.model or assets.default_model()))
    model, tok = model_mod.load(path, "float32")
    report = {}
    for name in args.recipes.split(","):
        rec = recipes.load(name)
        parts = domain_parts(model, tok, path, rec)
        w = np.array([c for _, c, _, _ in parts], dtype=np.float64)
        w /= w.sum()
        trace = []
        if args.minimax:
            w, trace = minimax_weights(parts, rec, args.minimax, args.rate)
            for i, t in enumerate(trace):
                print(f"step {i}: " + ", ".join(
                    f"{d} w={t['weights'][d]:.3f} loss={t['loss'][d]:.5f}" for d in t["loss"]))
        pred = predicted(pooled_codec(parts, rec, w), parts)
        L = next(iter(pred.values())).shape[1]
        edges = np.linspace(0, L, args.groups + 1).round().astype(int)
        print(f"\n{path.name} | {rec.name} | weights "
              + ", ".join(f"{p[0]}={x:.3f}" for p, x in zip(parts, w)))
        print("predicted tr(F E)/2, nats per window (its scored tokens summed), per domain: K and V by groups of layers")
        head = " | ".join(f"{s} {a}-{b - 1}" for s in ("K", "V") for a, b in zip(edges, edges[1:]))
        print(f"| domain | total | K | V | {head} |")
        print("|---" * (4 + 2 * args.groups) + "|")
        rows = {}
        for d, v in pred.items():
            cells = [v[si, a:b].sum() for si in range(2) for a, b in zip(edges, edges[1:])]
            rows[d] = {"total": float(v.sum()), "k": float(v[0].sum()), "v": float(v[1].sum()),
                       "groups": [float(c) for c in cells]}
            print(f"| {d} | {v.sum():.4f} | {v[0].sum():.4f} | {v[1].sum():.4f} | "
                  + " | ".join(f"{c:.4f}" for c in cells) + " |")
        report[rec.name] = {"weights": dict(zip([p[0] for p in parts], map(float, w))),
                            "domains": rows, "trace": trace}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
