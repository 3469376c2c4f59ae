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
    "LayerCodes",
    "MAX_DIM",
    "MAX_ROWS",
    "attention_kernel",
    "attention_team",
    "centroids_gaussian",
    "check_params",
    "decode_block_from_parts",
    "decode_calibrated_blocks",
    "decode_calibrated_blocks_into",
    "decode_layer",
    "decode_layer_blocks",
    "decode_layer_blocks_into",
    "encode_block_codes",
    "encode_calibrated_blocks",
    "encode_layer",
    "encode_layer_blocks",
    "inspect_layer",
    "inverse_rotate_rows",
    "pack_bits",
    "rotate_rows",
    "roundtrip_layer",
    "unpack_bits",
    "unrope_keys",
    "wht_rows",
    "wht_sign_pattern",
]

__version__: str
FORMAT_VERSION: int
CALIBRATED_FORMAT_VERSION: int
MAX_DIM: int
MAX_ROWS: int

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
    def __copy__(self) -> CalibratedCodec: ...
    def __deepcopy__(self, memo: Any) -> CalibratedCodec: ...
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
    def key_synthesis(self, synthesis: str = "bf16") -> npt.NDArray[np.float32]: ...
    def arrays(self) -> Dict[str, Any]: ...
    def canonical_bytes(self) -> bytes: ...
    def encode(self, array: npt.NDArray[np.float32], threads: Optional[int] = None) -> bytes: ...
    def decode(self, data: bytes, threads: Optional[int] = None) -> npt.NDArray[np.float32]: ...
    def roundtrip(
        self, array: npt.NDArray[np.float32], threads: Optional[int] = None
    ) -> Tuple[npt.NDArray[np.float32], Dict[str, Any]]: ...
    def encode_parts(self, array: npt.NDArray[np.float32]) -> Dict[str, Any]: ...
    def decode_parts(self, parts: Dict[str, Any]) -> npt.NDArray[np.float32]: ...
    def inspect(self, data: bytes) -> Dict[str, Any]: ...

@final
class LayerCodes:
    def __new__(
        cls, k_codecs: Sequence[CalibratedCodec], v_codecs: Sequence[CalibratedCodec], batch: int
    ) -> LayerCodes: ...
    def __copy__(self) -> LayerCodes: ...
    def __deepcopy__(self, memo: Any) -> LayerCodes: ...
    @property
    def batch(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def k_dim(self) -> int: ...
    @property
    def v_dim(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def rows(self) -> int: ...
    def rows_at(self, b: int, h: int) -> int: ...
    def num_blocks(self, b: int, h: int) -> int: ...
    def append(self, b: int, h: int, k: bytes, v: bytes) -> None: ...
    def append_blocks(self, k: Sequence[Sequence[bytes]], v: Sequence[Sequence[bytes]]) -> None: ...
    def blob(self, b: int, h: int, stream: str, i: int) -> bytes: ...
    def pop_block(self) -> None: ...
    def pop_front_block(self) -> None: ...
    def select(self, index: Sequence[int]) -> None: ...
    def clear(self) -> None: ...
    def attend(
        self,
        q: npt.NDArray[Union[np.float32, np.uint16]],
        sink_k: npt.NDArray[Union[np.float32, np.uint16]],
        sink_v: npt.NDArray[Union[np.float32, np.uint16]],
        tail_k: npt.NDArray[Union[np.float32, np.uint16]],
        tail_v: npt.NDArray[Union[np.float32, np.uint16]],
        mask: Optional[npt.NDArray[np.float32]],
        scale: float,
        softcap: Optional[float] = None,
        window: Optional[int] = None,
        threads: Optional[int] = None,
        rope: Optional[
            Tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.uint32], str, str]
        ] = None,
        latent: bool = False,
        out_bf16: bool = False,
    ) -> Tuple[npt.NDArray[Union[np.float32, np.uint16]], npt.NDArray[np.float32]]: ...

def attention_kernel() -> str: ...
def unrope_keys(
    x: Union[npt.NDArray[np.float32], npt.NDArray[np.uint16]],
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    style: str,
    rows: Optional[int] = None,
) -> npt.NDArray[np.float32]: ...
def attention_team() -> int: ...
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
def encode_layer_blocks(
    array: npt.NDArray[np.float32],
    block_rows: int,
    params: Dict[str, Any],
    threads: Optional[int] = None,
) -> List[List[bytes]]: ...
def decode_layer_blocks(
    blobs: Sequence[Sequence[bytes]], block_rows: int, threads: Optional[int] = None
) -> npt.NDArray[np.float32]: ...
def decode_layer_blocks_into(
    blobs: Sequence[Sequence[bytes]],
    block_rows: int,
    out: npt.NDArray[np.float32],
    at: int,
    threads: Optional[int] = None,
) -> None: ...
def inspect_layer(data: bytes) -> Dict[str, Any]: ...
def check_params(params: Dict[str, Any]) -> Dict[str, Any]: ...
def encode_block_codes(
    array: npt.NDArray[np.float32],
    params: Dict[str, Any],
    weights: Optional[npt.NDArray[np.float32]] = None,
) -> Dict[str, Any]: ...
def encode_calibrated_blocks(
    codecs: Sequence[CalibratedCodec],
    array: npt.NDArray[np.float32],
    block_rows: int,
    threads: Optional[int] = None,
) -> List[List[bytes]]: ...
def decode_calibrated_blocks(
    codecs: Sequence[CalibratedCodec],
    blobs: Sequence[Sequence[bytes]],
    block_rows: int,
    threads: Optional[int] = None,
) -> npt.NDArray[np.float32]: ...
def decode_calibrated_blocks_into(
    codecs: Sequence[CalibratedCodec],
    blobs: Sequence[Sequence[bytes]],
    block_rows: int,
    out: npt.NDArray[np.float32],
    at: int,
    threads: Optional[int] = None,
) -> None: ...
def decode_block_from_parts(parts: Dict[str, Any]) -> npt.NDArray[np.float32]: ...
def wht_sign_pattern(seed: int, n: int) -> npt.NDArray[np.float32]: ...
def wht_rows(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...
def rotate_rows(x: npt.NDArray[np.float32], seed: int) -> npt.NDArray[np.float32]: ...
def inverse_rotate_rows(y: npt.NDArray[np.float32], seed: int) -> npt.NDArray[np.float32]: ...
def pack_bits(values: npt.NDArray[np.uint8], bits: int) -> bytes: ...
def unpack_bits(data: bytes, bits: int, count: int) -> npt.NDArray[np.uint8]: ...
def centroids_gaussian(bits: int) -> npt.NDArray[np.float32]: ...
