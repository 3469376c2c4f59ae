"""Triton GPU kernels of the codec: stages 2-5 and the decode, batched over blocks and heads.

They live inside the package so that the wheel ships them with no extra build step, one
subpackage per mode: :mod:`~kakeyaturbo.kernels.perblock` and
:mod:`~kakeyaturbo.kernels.calibrated`, over the launch helpers and @triton.jit building blocks
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
"""

from ._common import is_interpreter, poison_outputs
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
    "SkeletonBatch",
    "block_parts",
    "compact_outliers",
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
    "stack_skeletons",
]
