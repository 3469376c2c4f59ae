"""Triton GPU kernels of the codec (encode and decode, batched over blocks and heads).

They live inside the package so that the wheel ships them with no extra build step; the
repository's top-level ``kernels/`` is a link to this folder. The kernels themselves arrive
with the GPU issue; the Rust codec is their byte-exact oracle.
"""
