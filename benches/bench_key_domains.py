"""Which key domain a calibrated key codec should code in, by the error it leaves in the scores.

Attention over the codes is cheapest when one query transform serves every sealed key (keys
coded after RoPE: `O(m)` per key) and most accurate when keys are coded before RoPE (one mean
and one spectrum for every position; the kernel then synthesises each key, `O(m D)`). Between
the two sits coding each key relative to the first position of its tile of `L` rows (the key
turned back by that position's RoPE angle): one query transform per tile, and a spectrum that
RoPE smears only over `L` positions instead of all of them. And a basis that commutes with RoPE:
every component inside one RoPE pair (the covariance and the query metric cut to their 2 x 2
blocks per pair, so that the PCA's components and the whitening stay within a pair), which makes
a score `O(D)` per key (each pair's two codes, turned by the key's angle) at the price of every
correlation between pairs.

For each domain this fits the calibrated codec (`calibration.fit_stream`, query-whitened, the
same bits per element) on the keys of two calibration windows of the default model's text and
codes the keys of a third (evaluation) window; the coding error is carried to the keys after
RoPE and scored against every query that sees the key (causal, the layer's own queries after
RoPE). Reported: `sum (q . e)^2 / sum (q . k)^2` over the query/key pairs, mean over the layers
sampled (every third) and kv-heads. The library codec rotates each band of equal-width components
with a Hadamard transform, which mixes pairs (a kernel could not use it in the `pairs` domain);
so both pre-RoPE bases are also coded by a plain simulation without that rotation (`-norot`: each
component's coefficient, divided by the row's rms, to the nearest Lloyd-Max N(0, 1) centroid of its
width, fitted here on a seeded Gaussian sample). A proxy, not the model's KL: the KL of keys before and after
RoPE is measured in docs/decode-attention.md, "Keys before or after RoPE"; this ranks the domains at
equal bits and says how far the tile domains fall from both.

    .venv/bin/python benches/bench_key_domains.py [--bits 3] [--tiles 64,16] [--out bench-out]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

import rope_pairs  # benches/, this script's folder
from kakeyaturbo import assets
from kakeyaturbo.calibration import corpus, fit
from kakeyaturbo.eval import model as model_mod
from kakeyaturbo.families import describe
from kakeyaturbo.families.rope import apply_rope

CTX = 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=float, default=3.0, help="bits per element of the key codec")
    ap.add_argument("--tiles", default="64,16", help="tile lengths L of the tile-relative domains")
    ap.add_argument("--layer-step", type=int, default=3)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    model, tok = model_mod.load(assets.default_model())
    rope = describe(model).require_rope().layer(0)
    if rope is None or rope.style != "half":
        raise SystemExit("the default model's layer 0 applies 'half' RoPE; this bench assumes it")
    cal, ev = corpus.split(corpus.load_articles(assets.default_text()))

    def window(texts: List[str], off: int) -> torch.Tensor:
        return torch.tensor(tok.encode("\n\n".join(texts[off:off + 60]))[:CTX])[None]

    caps: Dict[tuple, list] = {}
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        a.k_proj.register_forward_hook(lambda m, x, o, i=i: caps.setdefault(("k", i), []).append(o.detach()))
        a.q_proj.register_forward_hook(lambda m, x, o, i=i: caps.setdefault(("q", i), []).append(o.detach()))
    with torch.no_grad():
        for w in (window(cal, 0), window(cal, 60), window(ev, 0)):
            model(input_ids=w)
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    group = hq // hkv
    pos = torch.arange(CTX)

    def rot(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        c, s = rope(p[None])
        return apply_rope(x.double(), c[0].double(), s[0].double())

    tiles = [int(t) for t in args.tiles.split(",") if t]
    domains = ["before", "after"] + [f"tile{t}" for t in tiles] + ["pairs", "before-norot", "pairs-norot"]
    pair = rope_pairs.pair_blocks(d, rope.style, d, 0)
    gauss = np.random.default_rng(0).standard_normal(400_000)
    tables = {b: fit.lloyd_max(gauss, b) for b in range(1, 9)}

    def plain(sf: fit.StreamFit, x: np.ndarray) -> np.ndarray:
        """Decode of ``x`` coded without the band rotation (see the docstring)."""
        u = (x - sf.mean) @ sf.analysis.T / sf.spread
        g = np.sqrt((u ** 2).mean(1, keepdims=True)) + 1e-30
        q = np.empty_like(u)
        for j, b in enumerate(sf.bits):
            c = tables[int(b)]
            q[:, j] = c[np.abs(u[:, j:j + 1] / g - c[None]).argmin(1)]
        return sf.mean + (q * g * sf.spread) @ sf.synthesis

    def to_domain(k: torch.Tensor, dom: str) -> torch.Tensor:
        if dom in ("before", "pairs", "before-norot", "pairs-norot"):
            return k.double()
        if dom == "after":
            return rot(k, pos)
        return rot(k, pos % int(dom[4:]))

    def to_after(e: torch.Tensor, dom: str) -> torch.Tensor:
        if dom in ("before", "pairs", "before-norot", "pairs-norot"):
            return rot(e, pos)
        if dom == "after":
            return e
        t = int(dom[4:])
        return rot(e, pos - pos % t)

    causal = torch.tril(torch.ones(CTX, CTX, dtype=torch.bool))
    res: Dict[str, List[float]] = {dom: [] for dom in domains}
    layers = list(range(0, cfg.num_hidden_layers, args.layer_step))
    for li in layers:
        ks = [c.view(1, CTX, hkv, d).transpose(1, 2)[0] for c in caps[("k", li)]]
        qs = [c.view(1, CTX, hq, d).transpose(1, 2)[0] for c in caps[("q", li)]]
        for dom in domains:
            err = sig = 0.0
            for h in range(hkv):
                train = torch.cat([to_domain(ks[i][h:h + 1], dom)[0] for i in (0, 1)]).numpy()
                qtrain = torch.cat([qs[i][h * group:(h + 1) * group].reshape(-1, d) for i in (0, 1)]).double().numpy()
                qm, cov = qtrain.T @ qtrain / len(qtrain), np.cov(train.T)
                if dom.startswith("pairs"):
                    qm, cov = qm * pair, cov * pair
                sf = fit.fit_stream(train.mean(0), cov, args.bits, whitening=fit.whitening_factor(qm))
                if dom.startswith("pairs"):  # else the domain is not what it says
                    assert rope_pairs.within_blocks(sf.synthesis, pair), "a component spans two RoPE pairs"
                x = to_domain(ks[2][h:h + 1], dom)[0].float().numpy()
                if dom.endswith("norot"):
                    dec = plain(sf, x.astype(np.float64))
                else:
                    codec = sf.codec()
                    dec = codec.decode(codec.encode(x, threads=1))
                e = to_after(torch.from_numpy(x - dec)[None].double(), dom)[0]
                qa = rot(qs[2][h * group:(h + 1) * group].double(), pos)
                ka = rot(ks[2][h:h + 1].double(), pos)[0]
                err += ((qa @ e.T)[:, causal] ** 2).mean().item()
                sig += ((qa @ ka.T)[:, causal] ** 2).mean().item()
            res[dom].append(err / sig)
    rows = [{"domain": dom, "relative_score_error": float(np.mean(v)), "per_layer": v,
             "vs_before": float(np.mean(v) / np.mean(res["before"]))} for dom, v in res.items()]
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": assets.default_model().name, "bits": args.bits, "layers": layers, "ctx": CTX, "rows": rows}
    lines = [f"# Score error of the key codec by key domain ({out['model']}, {args.bits:g} bits, layers {layers})", "",
             "| key domain | relative score error | vs before RoPE |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['domain']} | {r['relative_score_error']:.5f} | {r['vs_before']:.2f}x |")
    md = "\n".join(lines) + "\n"
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "key_domains.json").write_text(json.dumps(out, indent=1))
    (path / "key_domains.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
