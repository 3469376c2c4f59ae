"""Fingerprint of the library's behaviour: the bytes every shipped recipe and mode writes for a
fixed set of inputs, and the figures of an evaluation on a tiny random-weight model.

It uses only long-standing public names, so the same script runs on a commit before a
refactoring and after it; `tests/golden/behaviour.json` holds what it printed at the commit
named inside (the commit before the package was moved into layers), and
`tests/golden/test_behaviour.py` checks that today's build prints the same.

    python tools/behaviour.py                 # print the fingerprint as JSON
    python tools/behaviour.py --write FILE    # write it (only when a behaviour change is meant)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any, Dict

import numpy as np


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:24]


def _arr_sha(a: np.ndarray) -> str:
    return _sha(np.ascontiguousarray(a, dtype=np.float32).tobytes())


def rows(seed: int, n: int, d: int) -> np.ndarray:
    """KV-like rows: a decaying spectrum in a random basis, an offset channel."""
    g = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    x = (g.standard_normal((n, d)) * 0.9 ** np.arange(d)) @ q.T
    x[:, 1] += 2.5
    return x.astype(np.float32)


def synthetic_stats(layers: int, heads: int, d: int, seed: int = 3) -> Any:
    """Deterministic statistics (and sensitivity) of a made-up model, as a calibration holds them."""
    from kakeyaturbo import calibrate

    g = np.random.default_rng(seed)

    def spd(scale: float) -> np.ndarray:
        a = g.standard_normal((layers, heads, d, d)) * (0.85 ** np.arange(d)) * scale
        return np.einsum("lhij,lhkj->lhik", a, a) / d + 1e-3 * np.eye(d)

    samples = g.standard_normal((layers, heads, 96, d)).astype(np.float32)
    stats = calibrate.AttentionStats(
        meta={"synthetic": True}, q2=spd(1.0), k_mean=g.standard_normal((layers, heads, d)) * 0.3,
        k_cov=spd(2.0), v_mean=g.standard_normal((layers, heads, d)) * 0.1, v_cov=spd(0.5),
        o_gram=spd(1.0), k_samples=samples, v_samples=samples * 0.5)
    sens = calibrate.Sensitivity(meta={"synthetic": True}, k=spd(0.1), v=spd(0.2))
    return stats, sens


# The calibrated recipes fit their bases with numpy's LAPACK, whose kernels (and so the last
# bits of an eigenvector) depend on the CPU: a blob's calibration fingerprint, and a code that
# sits on a decision threshold, may differ between two CPU models (seen: two AMD EPYCs). Their
# blobs are checked by length and by the relative error of the decoded rows, to this tolerance
# (a code flipped on a threshold moves it by about 1e-5; a changed quantiser or basis by more);
# the eval figures of a calibrated method too. Where a head's weakest components have nearly
# equal variances, which of them get the last bits (and their eigenvectors) can differ between
# CPUs too, moving that one head's error by up to about 1 % (seen: 0.7 % on one key head of
# `calibrated-4bit-sens`, a Zen 4 EPYC against the Zen 5 that recorded it): each head is held
# to RTOL_HEAD, and the mean over a recipe's six heads of a stream to RTOL_MEAN (one such head
# moves it by a sixth of its own change).
RTOL = 1e-3
RTOL_HEAD = 2e-2
RTOL_MEAN = 3e-3
# The eval figures come from a torch forward pass, whose matrix products round differently on
# CPUs with and without AVX-512 (seen: a Zen 3 EPYC against the AVX-512 EPYCs that recorded
# them, every baseline's perplexity within 2e-8 relative, its KL within 7e-7, its dppl ratio
# within 1e-8); the per-block recipe's fit (faer, dispatched by CPU) moved its figures by up to
# 6e-6 relative there, and is held to RTOL as the calibrated ones are. dppl is compared as the
# ratio `1 + dppl` (its own relative error is that of a difference of nearly equal numbers).
RTOL_FORWARD = 1e-5


def codec_bytes() -> Dict[str, Any]:
    """sha256 of the blobs of every shipped recipe (and the benches' diagnostic ones) on
    fixed rows, per stream, layer and kv-head; and of the decoded rows (calibrated recipes:
    also the decoded rows' relative squared error, the figure compared across machines)."""
    from pathlib import Path

    from kakeyaturbo import calibrate, recipes
    from kakeyaturbo.cache import BlockCodec

    layers, heads, d = 3, 2, 32
    stats, sens = synthetic_stats(layers, heads, d)
    here = Path(__file__).resolve().parent.parent
    names = recipes.available() + sorted(str(p) for p in (here / "benches" / "recipes").glob("*.toml"))
    out: Dict[str, Any] = {}
    for name in names:
        rec = recipes.load(name)
        if rec.mode == "calibrated":
            st, se = stats, sens
            if getattr(rec, "key_rope", "before") != "before":  # statistics taken after RoPE
                import dataclasses

                st = dataclasses.replace(stats, meta={**stats.meta, "rope": rec.key_rope})
                se = dataclasses.replace(sens, meta={**sens.meta, "rope": rec.key_rope})
            codec: Any = calibrate.ModelCodec(st, rec, sensitivity=se)
            extra = {"model_bytes": codec.model_bytes}
        else:
            codec = BlockCodec(rec)
            extra = {}
        entry: Dict[str, Any] = dict(extra)
        for s in ("k", "v"):
            for layer in range(layers):
                for h in range(heads):
                    x = rows(100 * layer + 10 * h + (s == "v"), 300, d)
                    blob = codec.encode(s, layer, h, x)
                    y = codec.decode(s, layer, h, blob)
                    e = [len(blob), _sha(blob), _arr_sha(y)]
                    if rec.mode == "calibrated":  # the fit's LAPACK differs by CPU: see RTOL
                        e.append(round(float(np.mean((y - x) ** 2) / np.mean(x ** 2)), 12))
                    entry[f"{s}{layer}{h}"] = e
        out[Path(name).stem] = entry
    return out


def per_block_bytes() -> Dict[str, Any]:
    """The per-block codec's keyword arguments over their range, on one input."""
    import kakeyaturbo as kt

    x = rows(7, 700, 48)
    cases = {
        "default": {},
        "ip_b2_k4": dict(metric="inner_product", bit_width=2, k=4),
        "linf_b1": dict(metric="linf", bit_width=1, block_size=128),
        "rand_fp32": dict(pca_method="randomized", skeleton_dtype="fp32", rsvd_target_rank=12),
        "outliers_shared": dict(outlier_threshold=2.0, share_basis=True, variance_ratio=1.0),
        "cap_seed": dict(rank_cap=8, rotation_seed=12345, bit_width=4),
        "weights": dict(weights=np.linspace(0, 1, 700).astype(np.float32)),
    }
    out = {}
    for name, kw in cases.items():
        blob = kt.encode_layer(x, **kw)
        out[name] = [len(blob), _sha(blob), _arr_sha(kt.decode_layer(blob))]
    c = kt.CalibratedCodec(np.zeros(48), np.eye(48)[:20], np.eye(48)[:20], 0.9 ** np.arange(20),
                           np.array([4] * 4 + [3] * 8 + [2] * 8), metric="inner_product",
                           outlier_threshold=2.5)
    blob = c.encode(x)
    out["calibrated_direct"] = [len(blob), _sha(blob), _arr_sha(c.decode(blob)), c.fingerprint]
    return out


def eval_figures() -> Dict[str, Any]:
    """`harness.evaluate` on a tiny random-weight Llama: baselines, a per-block and a
    calibrated recipe (synthetic statistics), every figure rounded to 12 digits."""
    import torch
    import transformers

    from kakeyaturbo import recipes
    from kakeyaturbo.eval import harness

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = np.random.default_rng(0)
    ctx, n_eval = 96, 8
    windows = [list(g.integers(0, 97, ctx + n_eval + 1)) for _ in range(2)]
    stats, sens = synthetic_stats(3, 2, 32)
    methods = harness.baseline_methods(["identity", "fp8_e4m3", "int4", "kivi2", "turboquant3"])
    methods.append(harness.codec_method(recipes.load("balanced"), 3))
    methods.append(harness.codec_method(recipes.load("calibrated-3bit"), 3, stats=stats,
                                        sensitivity=sens))
    res = harness.evaluate(model, windows, ctx, methods)
    keys = ("ppl", "dppl", "top1", "kl", "bits_per_element", "verdict")
    return {name: {k: (round(float(r[k]), 12) if k != "verdict" else r[k]) for k in keys}
            for name, r in res.items()}


def fingerprint() -> Dict[str, Any]:
    return {"per_block": per_block_bytes(), "recipes": codec_bytes(), "eval": eval_figures()}


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", metavar="FILE", help="write the fingerprint here")
    ap.add_argument("--commit", default="", help="the commit the fingerprint is of (recorded)")
    args = ap.parse_args(argv)
    fp = fingerprint()
    if args.write:
        doc = {"commit": args.commit, "fingerprint": fp}
        with open(args.write, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
    else:
        json.dump(fp, sys.stdout, indent=1, sort_keys=True)
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
