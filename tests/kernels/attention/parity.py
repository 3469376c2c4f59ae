"""Parity of the Triton decode attention with the Rust kernel (its oracle): the cases (a CI
subset, the full fuzz) and the comparison of one case, under ``attention_triton`` of
``../tolerances.py``. Plain Python (no pytest) so that ``benches/gpu_bench.py`` runs it too."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

import kakeyaturbo as kt
from kakeyaturbo import kernels as K

from ..tolerances import TOLERANCES as TOL

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared case builder
from codec.attention_cases import Spec, build, compare, magnitudes, spec_from  # noqa: E402

#: The CI subset: what makes the kernel hard, each at least once, small enough for the
#: interpreter (a few seconds).
SUBSET = (
    Spec(seed=101, blocks=(), sink=0, tail=4, n_q=4, group=1, dk=16, dv=16),
    Spec(seed=102, blocks=(130, 1), group=8, n_q=1, metric="inner_product", threshold=2.5,
         mask="additive", softcap=8.0),
    Spec(seed=103, blocks=(600,), dk=33, dv=64, group=3, n_q=2, norm=False, threshold=1.0,
         window=300, tables=True),
    Spec(seed=104, batch=2, blocks=(64, 65), kv_heads=3, group=2, n_q=3, sink=2, tail=7,
         metric="linf", mask="bool", q_scale=10.0),
)
FULL_CASES = 300


def make_cases(full: bool) -> List[Spec]:
    if not full:
        return list(SUBSET)
    return [spec_from(np.random.default_rng(7000 + i), 7000 + i, dims=(16, 64, 128, 256))
            for i in range(FULL_CASES)]


@dataclasses.dataclass
class Result:
    label: str
    out_error: float
    lse_error: float
    seconds: float


def run(spec: Spec, device: str) -> Result:
    """Runs one case through both kernels with the Triton outputs poisoned first; raises
    attention_cases.AttentionMismatch beyond the limit."""
    c = build(spec)
    want = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, return_lse=True, **c.call())
    t0 = time.perf_counter()
    with K.poison_outputs():
        layer = K.stack_layer(c.codes, device)
        out, lse = K.decode_attention_triton(layer, torch.from_numpy(c.q).to(device), c.tail_k,
                                             c.tail_v, **c.call())
    dt = time.perf_counter() - t0
    s_mag, v_mag = magnitudes(c)
    eo, el = compare(f"triton vs rust, {spec}", (out.cpu().numpy(), lse.cpu().numpy()), want,
                     s_mag, v_mag, TOL["attention_triton"], TOL["attention_triton"])
    return Result(f"seed{spec.seed}", eo, el, dt)


def summary(results: List[Result]) -> Dict[str, Any]:
    return {"cases": len(results), "max_out_error": max((r.out_error for r in results), default=0.0),
            "max_lse_error": max((r.lse_error for r in results), default=0.0),
            "seconds": sum(r.seconds for r in results)}


def covered(specs: List[Spec]) -> Tuple[bool, ...]:
    """What the brief asks of a case set, each a bool."""
    return (any(not s.blocks for s in specs), any(len(s.blocks) >= 2 for s in specs),
            {1, 8} <= {s.group for s in specs}, any(s.n_q > 1 for s in specs),
            {"mse", "inner_product", "linf"} <= {s.metric for s in specs},
            any(not s.norm for s in specs), any(s.threshold for s in specs),
            any(s.softcap for s in specs), any(s.window for s in specs),
            {"additive", "bool"} <= {s.mask for s in specs}, any(s.dk % 16 for s in specs))
