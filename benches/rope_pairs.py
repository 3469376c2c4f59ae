"""A lever of issue 15 measured, not shipped: a key basis that commutes with RoPE.

Keys are coded before RoPE (one mean and one spectrum for every position), so attention over
the codes synthesises every sealed key, ``m x D`` multiply-adds per key and kv-head. If every
component of the key basis lay inside one RoPE pair (the two channels RoPE turns together),
RoPE would turn each component's contribution on its own and a key would cost ``O(D)``: each
pair's codes through a 2 x 2 block, turned by the key's angle. That gives up every
correlation between pairs, which is what the calibrated basis compacts. ``--mixed K`` keeps
the ``K`` slowest-turning pairs as one block fitted with all their correlations (a key then
costs ``m_K x 2K`` for that block and ``O(D)`` for the rest).

This runs ``benches/bench_domains.py`` (its arguments after ``--``) with the keys' fit of every
calibrated recipe restricted that way: the covariance and the whitening (the sensitivity) of
each key head cut to their blocks, so that its PCA components and synthesis stay within them
(checked on every key head's components). The codec still rotates each band of equal-width
components with a Hadamard transform, which mixes pairs; a kernel could not use that, but
`benches/bench_key_domains.py` shows it changes the score error of this basis by a few per
cent (its ``pairs`` and ``pairs-norot`` rows). Quality only: the kernel was not built.

    .venv/bin/python benches/rope_pairs.py [--mixed K] -- --calibrations mixture \\
        --recipes calibrated-4bit,calibrated-3bit --baselines "" --out bench-out/pairs16 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, List, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_domains  # noqa: E402

from kakeyaturbo.calibration import fit, model_codec  # noqa: E402


def pair_blocks(d: int, style: str, rot_dim: int, mixed: int) -> np.ndarray:
    """``[d, d]`` bool: channels ``i`` and ``j`` may share a component. The same RoPE pair
    (``half``: ``i`` and ``i + rot_dim/2``; ``interleaved``: ``2f`` and ``2f + 1``), both among
    the ``mixed`` slowest pairs, or both past ``rot_dim`` (not turned)."""
    if rot_dim % 2 or rot_dim > d:
        raise ValueError(f"rot_dim {rot_dim} must be even and at most D = {d}")
    half = rot_dim // 2
    if not 0 <= mixed <= half:
        raise ValueError(f"mixed must be in 0 .. {half} (the RoPE pairs), got {mixed}")
    ch = np.arange(d)
    freq = np.where(ch < rot_dim, ch % half if style == "half" else ch // 2, -1)
    block = np.where(freq >= half - mixed, half, freq)  # the slowest pairs: one block
    block = np.where(ch >= rot_dim, half + 1, block)  # channels RoPE leaves alone: one block
    return block[:, None] == block[None, :]


def within_blocks(synthesis: np.ndarray, mask: np.ndarray) -> bool:
    """Whether every synthesis row lies within one block of ``mask`` (the block of its largest
    entry; the rest at most 1e-9 of the largest entry of all)."""
    s = np.abs(np.asarray(synthesis))
    return bool((s * ~mask[s.argmax(1)]).max() <= 1e-9 * s.max())


def restrict(mask: np.ndarray) -> None:
    """Patches the keys' fit to the blocks of ``mask`` (for the rest of the process)."""
    inputs, spectrum = fit.stream_inputs, model_codec.head_spectrum

    def stream_inputs(stats: Any, stream: str, layer: int, head: int, settings: Any,
                      sensitivity: Optional[Any] = None) -> Any:
        mean, cov, w = inputs(stats, stream, layer, head, settings, sensitivity)
        if stream == "k":
            cov = cov * mask
            if w is not None:  # the metric L L^T cut to the blocks, factored again
                w = np.linalg.cholesky((w @ w.T) * mask)
        return mean, cov, w

    def head_spectrum(stats: Any, stream: str, layer: int, head: int, settings: Any,
                      sensitivity: Optional[Any] = None) -> Any:
        sp = spectrum(stats, stream, layer, head, settings, sensitivity)
        if stream == "k" and not within_blocks(sp.synthesis(), mask):
            raise AssertionError(f"layer {layer}, kv-head {head}: a key component spans two blocks")
        return sp

    fit.stream_inputs = stream_inputs
    model_codec.head_spectrum = head_spectrum


def main(argv: "List[str] | None" = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixed", type=int, default=0, help="the slowest pairs fitted as one block")
    args = ap.parse_args(own)
    from kakeyaturbo import assets
    from kakeyaturbo.eval import model as model_mod
    from kakeyaturbo.families import describe

    sub = argparse.ArgumentParser(add_help=False)
    sub.add_argument("--model")
    known, _ = sub.parse_known_args(rest)
    path = assets.hard_case_model() if known.model == "hard-case" else Path(known.model or assets.default_model())
    model, _ = model_mod.load(path)
    rope = describe(model).require_rope().layer(0)
    if rope is None:
        raise SystemExit("layer 0 applies no RoPE")
    cos, _ = rope(torch.arange(1)[None])
    d = model.config.hidden_size // model.config.num_attention_heads
    d = getattr(model.config, "head_dim", None) or d
    mask = pair_blocks(d, rope.style, int(cos.shape[-1]), args.mixed)
    del model
    print(f"key blocks: {rope.style} RoPE over {cos.shape[-1]} of {d} channels, the {args.mixed} "
          "slowest pairs mixed", file=sys.stderr)
    restrict(mask)
    return bench_domains.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
