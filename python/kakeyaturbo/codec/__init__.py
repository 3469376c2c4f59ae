"""The codec, by mode: `perblock` (a fresh skeleton per block of rows), `calibrated` (a basis
fitted once per model) with `attention` over its codes, and the stages' `primitives` (the
oracle kernels are checked against).
Each function checks its arguments once (`_checks`) and makes one call into the Rust core."""

from .attention import LayerCodes, RopeTable, attention_kernel, attention_team, decode_attention
from .calibrated import CalibratedCodec
from .perblock import (
    DEFAULTS,
    check_params,
    decode_block_from_parts,
    decode_layer,
    encode_block_codes,
    encode_layer,
    inspect_layer,
    load_centroids,
    roundtrip_layer,
)
from .primitives import (
    centroids_gaussian,
    inverse_rotate_rows,
    pack_bits,
    rotate_rows,
    unpack_bits,
    wht_rows,
    wht_sign_pattern,
)

__all__ = [
    "CalibratedCodec",
    "DEFAULTS",
    "LayerCodes",
    "RopeTable",
    "attention_kernel",
    "attention_team",
    "centroids_gaussian",
    "check_params",
    "decode_attention",
    "decode_block_from_parts",
    "decode_layer",
    "encode_block_codes",
    "encode_layer",
    "inspect_layer",
    "inverse_rotate_rows",
    "load_centroids",
    "pack_bits",
    "rotate_rows",
    "roundtrip_layer",
    "unpack_bits",
    "wht_rows",
    "wht_sign_pattern",
]
