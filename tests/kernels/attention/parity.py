"""Parity of the Triton decode attention with the Rust kernel (its oracle): the cases (a CI
subset, the full fuzz) and the comparison of one case, under ``attention_triton`` of
``../tolerances.py``. Plain Python (no pytest) so that ``benches/gpu_bench.py`` runs it too.

Keys coded before RoPE (:class:`RopeSpec`: a case of the shared builder read as pre-RoPE codes,
with a rotary table and each sealed row's position) are compared with the Rust kernel's
``rope=..., positions=...`` mode in the case's ``synthesis`` (``"bf16"``, the default: both
kernels multiply the same bfloat16 factors, ``M`` rounded by Rust; ``"f32"``; ``"i16"``, the
Rust kernel's fixed-point factors, which the Triton one sums in float32) under
``attention_triton_rope``, ``S`` taken over the rotated keys."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

import kakeyaturbo as kt
from kakeyaturbo import kernels as K
from kakeyaturbo.kernels.attention import stack_rope

from ..tolerances import TOLERANCES as TOL

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: tests/, the shared case builder
from tests.codec.attention_cases import Spec, build, compare, magnitudes, spec_from  # noqa: E402

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
#: Random pre-RoPE cases of the full fuzz.
FULL_ROPE_CASES = 60


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """A case whose sealed keys are read as coded before RoPE: ``spec`` (the shared builder's
    case; its queries and raw rows stand for rows after RoPE), the pairing ``style``, the
    rotary dimension ``rot`` (0: ``D_k``), the table's ``base`` and ``attention_scale`` (cos
    and sin multiplied by it, as YaRN scales them; the table covers positions ``0 .. T +
    3``). Sealed row ``t`` of every batch row sits at position ``S + t``, except that the
    last batch row, when ``pads``, starts with ``pads`` rows at position 1 (left padding as
    transformers numbers it) and continues ``0, 1, 2, ...``."""

    spec: Spec
    style: str = "half"
    rot: int = 0
    pads: int = 0
    base: float = 10000.0
    attention_scale: float = 1.0
    synthesis: str = "bf16"

    @property
    def seed(self) -> int:
        return self.spec.seed

    @property
    def rot_dim(self) -> int:
        return self.rot or self.spec.dk


#: Keys coded before RoPE, the CI subset (a few seconds in the interpreter).
ROPE_SUBSET = (
    RopeSpec(Spec(seed=201, batch=2, blocks=(70, 65), kv_heads=2, group=4, n_q=1, sink=1, tail=3,
                  dk=64, dv=32, threshold=2.5, softcap=12.0, mask="additive"),
             style="half", rot=32, pads=5, base=500.0),
    RopeSpec(Spec(seed=202, batch=2, blocks=(130,), kv_heads=1, group=2, n_q=2, sink=0, tail=4,
                  dk=48, dv=48, metric="linf", norm=False, threshold=1.0, window=100, mask="bool"),
             style="interleaved", pads=70, attention_scale=1.2, synthesis="f32"),
    RopeSpec(Spec(seed=203, blocks=(40, 1), kv_heads=3, group=3, n_q=1, dk=32, dv=16,
                  metric="inner_product", threshold=3.0, q_scale=6.0),
             style="interleaved", rot=10, base=50.0, synthesis="i16"),
)


def rope_inputs(r: RopeSpec) -> Tuple[kt.RopeTable, np.ndarray]:
    """The table and the positions int64 ``[B, T_c]`` of a :class:`RopeSpec`."""
    s = r.spec
    tc = sum(s.blocks)
    inv = (1.0 / r.base ** (np.arange(0, r.rot_dim, 2, dtype=np.float64) / r.rot_dim))
    ang = np.arange(s.total + 4, dtype=np.float64)[:, None] * inv[None, :]
    table = kt.RopeTable((np.cos(ang) * r.attention_scale).astype(np.float32),
                         (np.sin(ang) * r.attention_scale).astype(np.float32), r.style)
    pos = np.tile(s.sink + np.arange(tc, dtype=np.int64), (s.batch, 1))
    if r.pads:
        p = min(r.pads, tc)
        pos[-1, :p] = 1
        pos[-1, p:] = np.arange(tc - p)
    return table, pos


def rotate_sealed(k: np.ndarray, r: RopeSpec, table: kt.RopeTable, pos: np.ndarray) -> np.ndarray:
    """The keys ``[B, H_kv, T, D_k]`` (float64) with the sealed rows rotated to ``pos`` as the
    kernels rotate them: per pair ``(a, b)``, ``a cos - b sin``, ``b cos + a sin``."""
    out = np.array(k, dtype=np.float64)
    half = table.rot_dim // 2
    lo = r.spec.sink
    sealed = out[:, :, lo:lo + pos.shape[1]]
    c = table.cos.astype(np.float64)[pos][:, None]  # [B, 1, T_c, half]
    sn = table.sin.astype(np.float64)[pos][:, None]
    ia = np.arange(half) if table.style == "half" else 2 * np.arange(half)
    ib = ia + half if table.style == "half" else ia + 1
    a, b = sealed[..., ia].copy(), sealed[..., ib].copy()
    sealed[..., ia] = a * c - b * sn
    sealed[..., ib] = b * c + a * sn
    return out


def make_rope_cases(full: bool) -> List[RopeSpec]:
    if not full:
        return list(ROPE_SUBSET)
    out = []
    for i in range(FULL_ROPE_CASES):
        g = np.random.default_rng(9000 + i)
        s = spec_from(g, 9000 + i, dims=(16, 64, 128, 256))
        rot = int(g.choice([0, 0, 2 * int(g.integers(1, s.dk // 2 + 1))]))
        out.append(RopeSpec(s, style=("half", "interleaved")[int(g.integers(2))], rot=rot,
                            pads=int(g.integers(0, sum(s.blocks) + 2)) if s.batch > 1 else 0,
                            base=float(10 ** g.uniform(3, 6)),
                            attention_scale=float(g.uniform(0.9, 1.3)) if g.random() < 0.3 else 1.0,
                            synthesis=("bf16", "f32", "i16")[i % 3]))
    return out


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


def rope_magnitudes(c: Any, r: RopeSpec, table: kt.RopeTable, pos: np.ndarray) -> Tuple[float, float]:
    """``S`` and ``V`` of ``attention_cases.magnitudes`` with the sealed keys rotated."""
    from kakeyaturbo.reference.attention import decoded_kv

    k, v = decoded_kv(c.codes, c.sink_k, c.sink_v, c.tail_k, c.tail_v)
    kk = rotate_sealed(k.numpy(), r, table, pos).repeat(c.spec.group, axis=1)
    scale = c.kwargs.get("scale", 1.0 / math.sqrt(c.spec.dk))
    s = np.abs(c.q.astype(np.float64)) @ np.abs(kk).transpose(0, 1, 3, 2)
    return float(s.max(initial=0.0)) * scale, float(np.abs(v.numpy()).max(initial=0.0))


def run(spec: Union[Spec, RopeSpec], device: str) -> Result:
    """Runs one case through both kernels with the Triton outputs poisoned first; raises
    attention_cases.AttentionMismatch beyond the limit. A :class:`RopeSpec` runs both in their
    pre-RoPE mode (the Triton side with the table staged by ``stack_rope``)."""
    r: Optional[RopeSpec] = spec if isinstance(spec, RopeSpec) else None
    c = build(r.spec if r else spec)
    extra: Dict[str, Any] = {}
    if r:
        table, pos = rope_inputs(r)
        extra = dict(rope=table, positions=pos, synthesis=r.synthesis)
    want = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, return_lse=True, **c.call(), **extra)
    t0 = time.perf_counter()
    with K.poison_outputs():
        layer = K.stack_layer(c.codes, device)
        if r:
            extra = dict(rope=stack_rope(table, device), positions=torch.from_numpy(pos).to(device),
                         synthesis=r.synthesis)
        out, lse = K.decode_attention_triton(layer, torch.from_numpy(c.q).to(device), c.tail_k,
                                             c.tail_v, **c.call(), **extra)
    dt = time.perf_counter() - t0
    s_mag, v_mag = rope_magnitudes(c, r, table, pos) if r else magnitudes(c)
    limit = TOL["attention_triton_rope" if r else "attention_triton"]
    eo, el = compare(f"triton vs rust, {spec}", (out.cpu().numpy(), lse.cpu().numpy()), want,
                     s_mag, v_mag, limit, limit)
    return Result(f"{'rope_' if r else ''}seed{spec.seed}", eo, el, dt)


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


def covered_rope(cases: List[RopeSpec]) -> Tuple[bool, ...]:
    """What the brief asks of the pre-RoPE cases, each a bool: both pairings, partial and full
    rotation, a batch of 2 with a left-padded row, GQA, softcap, window, both masks,
    outliers, more than one block and a tile cut by a block's end, n_q > 1, D not a power of
    two, a scaled table, every synthesis."""
    s = [r.spec for r in cases]
    return ({"half", "interleaved"} <= {r.style for r in cases},
            any(0 < r.rot < r.spec.dk for r in cases), any(r.rot in (0, r.spec.dk) for r in cases),
            any(r.pads and r.spec.batch == 2 for r in cases), any(x.group > 1 for x in s),
            any(x.softcap for x in s), any(x.window for x in s),
            {"additive", "bool"} <= {x.mask for x in s}, any(x.threshold for x in s),
            any(len(x.blocks) >= 2 for x in s), any(any(n % 64 for n in x.blocks) for x in s),
            any(x.n_q > 1 for x in s), any(x.dk & (x.dk - 1) for x in s),
            any(r.attention_scale != 1.0 for r in cases),
            {"bf16", "f32", "i16"} <= {r.synthesis for r in cases})
