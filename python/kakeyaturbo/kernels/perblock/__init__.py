"""Triton kernels of the per-block mode: stages 2-5 and the decode of many blocks per launch,
against skeletons the Rust codec fitted (:mod:`kakeyaturbo.reference.perblock` is their torch
mirror).

``skeleton.py`` holds the batched layout; the encode (``encode.py``) is four launches,
``project.py``, ``residual.py``, ``quantize.py`` and ``pack.py``; the decode (``decode.py``) is
one."""

from .decode import decode_blocks
from .encode import compact_outliers, encode_blocks
from .skeleton import SkeletonBatch, block_parts, stack_codes, stack_skeletons

__all__ = [
    "SkeletonBatch",
    "block_parts",
    "compact_outliers",
    "decode_blocks",
    "encode_blocks",
    "stack_codes",
    "stack_skeletons",
]
