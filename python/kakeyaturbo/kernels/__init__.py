"""Triton GPU kernels of the codec: stages 2-5 and the decode, batched over blocks and heads.

They live inside the package so that the wheel ships them with no extra build step, one
subpackage per mode: :mod:`~kakeyaturbo.kernels.perblock` and
:mod:`~kakeyaturbo.kernels.calibrated`, and :mod:`~kakeyaturbo.kernels.attention` (attention
over the calibrated codes), over the launch helpers and @triton.jit building blocks
of ``_common.py``. The Rust codec is their oracle (``tests/kernels/`` fuzzes both these kernels
and their torch mirrors in :mod:`kakeyaturbo.reference` against it).
Needs torch and triton; set ``TRITON_INTERPRET=1`` before importing to run on the CPU.

Typical use (per-block mode, skeletons fitted by the Rust codec)::

    parts = [kakeyaturbo.encode_block_codes(block, **params) for block in blocks]
    skel = stack_skeletons(parts, device="cuda")
    codes = encode_blocks(x, skel, rows)            # x: [B, N, D] float32 / bfloat16
    x_hat = decode_blocks(codes, skel, rows, torch.bfloat16)

Calibrated mode (one calibration per head, e.g. every kv-head of a layer's K stream)::

    batch = stack_calibrations(codecs, device="cuda")   # CalibratedCodec objects
    codes = encode_calibrated(k, batch)                  # k: [H, T, D] float32 / bfloat16
    k_hat = decode_calibrated(codes, batch, out_dtype=torch.bfloat16)

Decode attention over a layer's sealed calibrated codes (a :class:`kakeyaturbo.LayerCodes`)::

    layer = stack_layer(codes, device="cuda")
    out, lse = decode_attention_triton(layer, q, tail_k, tail_v, sink_k=sink_k, sink_v=sink_v)
"""

from ._common import is_interpreter, poison_outputs
from .attention import LayerBatch, decode_attention_triton, stack_layer
from .calibrated import (
    CalibrationBatch,
    decode_calibrated,
    encode_calibrated,
    head_parts,
    outlier_capacity,
    stack_calibrated_parts,
    stack_calibrations,
)
from .perblock import (
    SkeletonBatch,
    block_parts,
    compact_outliers,
    decode_blocks,
    encode_blocks,
    stack_codes,
    stack_skeletons,
)

__all__ = [
    "CalibrationBatch",
    "LayerBatch",
    "SkeletonBatch",
    "block_parts",
    "compact_outliers",
    "decode_attention_triton",
    "decode_blocks",
    "decode_calibrated",
    "encode_blocks",
    "encode_calibrated",
    "head_parts",
    "is_interpreter",
    "outlier_capacity",
    "poison_outputs",
    "stack_calibrated_parts",
    "stack_calibrations",
    "stack_codes",
    "stack_layer",
    "stack_skeletons",
]
