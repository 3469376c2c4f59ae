# Type stubs of the compiled extension; checked by `python -m mypy.stubtest kakeyaturbo._core`.
# Every function raises TypeError for a wrong type and a kakeyaturbo.errors.KakeyaError
# subclass for anything else (README, "Guarantees"); ints out of range are
# InvalidParameterError, never OverflowError.
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "__version__",
    "CALIBRATED_FORMAT_VERSION",
    "CalibratedCodec",
    "FORMAT_VERSION",
    "centroids_gaussian",
    "check_params",
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
CALIBRATED_FORMAT_VERSION: int

@final
class CalibratedCodec:
    def __new__(
        cls,
        mean: npt.NDArray[np.float32],
        analysis: npt.NDArray[np.float32],
        synthesis: npt.NDArray[np.float32],
        spread: npt.NDArray[np.float32],
        bits: npt.NDArray[np.uint8],
        rotation_seed: int,
        metric: str,
        norm: bool,
        outlier_threshold: Optional[float] = None,
        centroids: Optional[
            Union[Mapping[int, Sequence[float]], Sequence[Tuple[int, Sequence[float]]]]
        ] = None,
    ) -> CalibratedCodec: ...
    @property
    def d(self) -> int: ...
    @property
    def m(self) -> int: ...
    @property
    def fingerprint(self) -> int: ...
    @property
    def model_bytes(self) -> int: ...
    @property
    def row_bits(self) -> int: ...
    @property
    def row_bytes(self) -> int: ...
    @property
    def bands(self) -> List[Tuple[int, int, int]]: ...
    def canonical_bytes(self) -> bytes: ...
    def encode(self, array: npt.NDArray[np.float32], threads: Optional[int] = None) -> bytes: ...
    def decode(self, data: bytes, threads: Optional[int] = None) -> npt.NDArray[np.float32]: ...
    def roundtrip(
        self, array: npt.NDArray[np.float32], threads: Optional[int] = None
    ) -> Tuple[npt.NDArray[np.float32], Dict[str, Any]]: ...
    def encode_parts(self, array: npt.NDArray[np.float32]) -> Dict[str, Any]: ...
    def decode_parts(self, parts: Dict[str, Any]) -> npt.NDArray[np.float32]: ...
    def inspect(self, data: bytes) -> Dict[str, Any]: ...

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
def check_params(params: Dict[str, Any]) -> Dict[str, Any]: ...
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
