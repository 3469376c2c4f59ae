"""kakeyaturbo: a KV-cache codec for LLM inference (Rust core, Python API)."""

from ._api import (
    DEFAULTS,
    centroids_gaussian,
    decode_block_from_parts,
    decode_layer,
    encode_block_codes,
    encode_layer,
    inspect_layer,
    inverse_rotate_rows,
    load_centroids,
    pack_bits,
    rotate_rows,
    roundtrip_layer,
    unpack_bits,
    wht_rows,
    wht_sign_pattern,
)
from ._calibrated import CalibratedCodec
from ._core import CALIBRATED_FORMAT_VERSION, FORMAT_VERSION, __version__
from .errors import (
    CorruptDataError,
    InternalError,
    InvalidInputError,
    InvalidParameterError,
    KakeyaError,
    NumericalError,
    UnsupportedVersionError,
)

__all__ = [
    "CALIBRATED_FORMAT_VERSION",
    "CalibratedCodec",
    "DEFAULTS",
    "FORMAT_VERSION",
    "__version__",
    "centroids_gaussian",
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
    "CorruptDataError",
    "InternalError",
    "InvalidInputError",
    "InvalidParameterError",
    "KakeyaError",
    "NumericalError",
    "UnsupportedVersionError",
]
