"""The one table of parity limits. Every parity check reads its limit from here.

Integer codes (segment ids, fp16 bit patterns, shared exponents, quantiser indices, outlier
flags) are compared exactly. A disagreement is accepted only where the value that decides it
lies within an epsilon of the decision threshold, the epsilon being the f32 error the
computation can carry (Rust sums in a fixed 8-lane / faer order, torch and Triton in their
own). The epsilons are relative to the magnitudes that enter the computation of the row:

- ``c``: ``c = U (x - mu)`` and everything linear in it (``g = c C^T``, ``t``):
  ``|error| <= c * |x_i - mu|``.
- ``z``: the residual and what follows (``|r|``, ``z``, the outlier value, the gain):
  ``|error| <= z * kappa_i`` in units of ``z`` (unit second moment), with
  ``kappa_i = (|x_i - mu| + |t_i|) / |r_i|`` the amplification of the residual's cancellation;
  the norm uses ``z * (|x_i - mu| + |t_i|)``. The gain ``s^ <z, q> / <q, q>`` propagates the z
  epsilon through the dot product: ``2 s^ (eps_z |q|_1 + d_eff 2**-24 sum|z q|) / <q, q>`` (its
  dot product may cancel when the centroid table fits z badly).

Measured (CPU, permuted summation orders, D up to 256): c errors <= 6e-7 |x - mu| and z errors
<= 1.2e-6 kappa; the limits below leave a margin of about 15x. ``near_fraction`` bounds how many
of the compared values of one kind may sit that close to a threshold (at least one per kind
and group is allowed; they must stay rare); fp16 roundings have their own, larger, share.
Decoded tensors: ``max |a - b| / max |b|`` per block, with both decoders fed the same codes.

Calibrated mode (``calibrated/parity.py``), per row ``i`` and component ``j``:

- ``u = A' (x - mean)``, ``A'_j = analysis_j / spread_j``: ``|error| <= cal_u * |x_i - mean|
  * |A'_j|`` (the terms' magnitude by Cauchy-Schwarz; ``x - mean`` is formed identically).
- ``z`` of a sub-band of width ``W``: every butterfly output is a signed sum of the band's
  ``u``, whose rounding errors (separate dot products) are independent and each within its
  ``eps_u``, so ``|error| <= r_W * sqrt(sum_band eps_u^2) / g^``; the rms scale: ``cal_u *
  |x_i - mean| * |A'|_F / sqrt(m)``. The gain of ``inner_product`` propagates these as above.
- ``undetermined_z`` applies per value: a component with a tiny spread has ``|A'_j|`` so large
  that no f32 projection resolves its ``z`` (they are counted and reported, not compared).

Measured (CPU, f32 sums in torch's, sequential, reversed, permuted and 32-wide chunked
orders against f64, 14 calibrations of the full set, D 64..256): u errors <= 5.3e-7
``|x - mean| |A'_j|``; ``cal_u`` leaves a margin of about 20x.

Attention over the codes (``tests/codec/test_attention.py``, ``attention/parity.py``), per
call, against :func:`kakeyaturbo.reference.attention.reference_attention` (the decoded cache
in float64): with ``S = scale * max |q| . |k|`` over every query and position (the largest
score any f32 sum could carry: its errors are a few ulps of it) and ``V = max |v|``,

- ``max |out - ref| <= attention_out * V * (1 + S)`` (score errors move the output by at most
  their size times the spread of the values; the value sums round at ``V``);
- ``max |lse - ref| <= attention_lse * (1 + S)`` (over queries that see a position; the others
  must be ``-inf`` on both sides).

Measured (2,000 random calls: D 16..256, GQA groups 1..8, n_q 1..4, 0 to 3 blocks of 1..700
rows, water-filled layouts 1.5..8 bits, every metric, scale on and off, outliers, custom
tables, softcap, windows, masks; S from 0.1 to 1,700): out <= 1.7e-7, lse <= 3.0e-7; the
limits leave a margin of about 12x. The Triton kernel against the Rust one: the same bound
with ``attention_triton`` (both sides round). Keys coded before RoPE (``attention_triton_rope``,
``S`` over the rotated keys): measured (interpreter, the 3 subset cases and 4 of the random
ones, D 16..256, both pairings, partial rotation, padded positions) out <= 4.4e-8, lse <=
1.6e-7; the limit leaves a margin of about 25x.
"""

from __future__ import annotations

from typing import Dict

TOLERANCES: Dict[str, float] = {
    # decision epsilons (see the module docstring for what they multiply)
    "c": 1e-5,
    "z": 2e-5,
    # calibrated mode: u = A' (x - mean), relative to |x - mean| |A'_j|
    "cal_u": 1e-5,
    # largest accepted share of near-threshold disagreements per kind of code and group:
    # decisions on f32 values (segments, quantiser indices, outlier flags) ...
    "near_fraction": 1e-3,
    # ... and fp16 roundings (t, norm, gain, outlier values): fp16 keeps 13 bits fewer than
    # f32, so an f32 difference of k ulps crosses an fp16 rounding boundary with probability
    # about k * 2**-12 (measured: 4 of 1024 rows at D=128, d_eff=98)
    "near_fraction_fp16": 1e-2,
    # rows whose z epsilon exceeds this (a residual below the f32 resolution of the
    # projection, kappa > 2500) have indices no f32 implementation determines: their codes are
    # not compared, their decoded values are
    "undetermined_z": 0.05,
    # ... and on those rows |decoded row difference| <= this * the row's r epsilon: both
    # residuals are below 21 epsilons, their quantised copies below about 25 each
    "undetermined_decode": 50.0,
    # attention over the codes (see above): output relative to V (1 + S), lse relative to 1 + S
    "attention_out": 2e-6,
    "attention_lse": 4e-6,
    # the Triton decode attention against the Rust kernel, both float32: out and lse alike
    "attention_triton": 4e-6,
    # ... keys coded before RoPE (each sealed key synthesised, rotated and dotted in its own
    # order on either side), S over the rotated keys: out and lse alike
    "attention_triton_rope": 4e-6,
    # decoded output, normwise relative error per block, by output dtype
    "decode_float32": 1e-5,
    # one bf16 ulp: the GPU rounds to nearest (half an ulp); Triton's CPU interpreter
    # truncates when it casts float32 to bfloat16
    "decode_bfloat16": 2.0**-7,
}
