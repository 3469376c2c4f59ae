"""Triton GPU kernels of the codec: stages 2-5 and the decode, batched over blocks and heads.

They live inside the package so that the wheel ships them with no extra build step. The Rust
codec is their oracle
(``tests/kernels/`` fuzzes both these kernels and :mod:`kakeyaturbo.reference` against it).
Needs torch and triton; set ``TRITON_INTERPRET=1`` before importing to run on the CPU.

Typical use (per-block mode, skeletons fitted by the Rust codec)::

    parts = [kakeyaturbo.encode_block_codes(block, **params) for block in blocks]
    skel = stack_skeletons(parts, device="cuda")
    codes = encode_blocks(x, skel, rows)            # x: [B, N, D] float32 / bfloat16
    x_hat = decode_blocks(codes, skel, rows, torch.bfloat16)
"""

from ._utils import is_interpreter, poison_outputs
from .decode import decode_blocks
from .encode import compact_outliers, encode_blocks
from .skeleton import SkeletonBatch, block_parts, stack_codes, stack_skeletons

__all__ = [
    "SkeletonBatch",
    "block_parts",
    "compact_outliers",
    "decode_blocks",
    "encode_blocks",
    "is_interpreter",
    "poison_outputs",
    "stack_codes",
    "stack_skeletons",
]
