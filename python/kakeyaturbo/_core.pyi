# Type stubs of the compiled extension; checked by `python -m mypy.stubtest kakeyaturbo._core`.
from typing import Any, Dict, Optional, Tuple

import numpy as np
import numpy.typing as npt

__all__ = [
    "__version__",
    "FORMAT_VERSION",
    "centroids_gaussian",
    "decode_block_from_parts",
    "decode_layer",
    "encode_block_codes",
    "encode_layer",
    "inspect_layer",
    "inverse_rotate_rows",
    "pack_bits",
    "rotate_rows",
    "roundtrip_layer",
    "unpack_bits",
    "wht_rows",
    "wht_sign_pattern",
]

__version__: str
FORMAT_VERSION: int

def roundtrip_layer(
    array: npt.NDArray[np.float32],
    params: Dict[str, Any],
    weights: Optional[npt.NDArray[np.float32]] = None,
    threads: Optional[int] = None,
) -> Tuple[npt.NDArray[np.float32], Dict[str, Any]]: ...
def encode_layer(
    array: npt.NDArray[np.float32],
    params: Dict[str, Any],
    weights: Optional[npt.NDArray[np.float32]] = None,
    threads: Optional[int] = None,
) -> bytes: ...
def decode_layer(data: bytes, threads: Optional[int] = None) -> npt.NDArray[np.float32]: ...
def inspect_layer(data: bytes) -> Dict[str, Any]: ...
def encode_block_codes(
    array: npt.NDArray[np.float32],
    params: Dict[str, Any],
    weights: Optional[npt.NDArray[np.float32]] = None,
) -> Dict[str, Any]: ...
def decode_block_from_parts(parts: Dict[str, Any]) -> npt.NDArray[np.float32]: ...
def wht_sign_pattern(seed: int, n: int) -> npt.NDArray[np.float32]: ...
def wht_rows(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...
def rotate_rows(x: npt.NDArray[np.float32], seed: int) -> npt.NDArray[np.float32]: ...
def inverse_rotate_rows(y: npt.NDArray[np.float32], seed: int) -> npt.NDArray[np.float32]: ...
def pack_bits(values: npt.NDArray[np.uint8], bits: int) -> bytes: ...
def unpack_bits(data: bytes, bits: int, count: int) -> npt.NDArray[np.uint8]: ...
def centroids_gaussian(bits: int) -> npt.NDArray[np.float32]: ...
