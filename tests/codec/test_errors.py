"""Every bad input gets a typed exception (never an abort, never a hang)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from tests.conftest import kv_like
from hypothesis import given
from hypothesis import strategies as st

import kakeyaturbo as kt

X = kv_like(100, 8)


@pytest.mark.parametrize(
    "array, exc",
    [
        (X.astype(np.float64), TypeError),
        (X.astype(np.float16), TypeError),
        (X.astype(np.int32), TypeError),
        (X.tolist(), TypeError),
        (X[0], kt.InvalidInputError),
        (X[None], kt.InvalidInputError),
        (np.zeros((0, 8), np.float32), kt.InvalidInputError),
        (np.zeros((8, 0), np.float32), kt.InvalidInputError),
    ],
)
def test_bad_arrays(array, exc) -> None:
    for fn in (kt.roundtrip_layer, kt.encode_layer, kt.encode_block_codes):
        with pytest.raises(exc):
            fn(array)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values(bad: float) -> None:
    x = X.copy()
    x[37, 5] = bad
    with pytest.raises(kt.InvalidInputError, match="row 37, column 5"):
        kt.roundtrip_layer(x)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=0), dict(block_size=-1), dict(bit_width=0), dict(bit_width=5),
        dict(k=0), dict(variance_ratio=-0.01), dict(variance_ratio=1.01),
        dict(variance_ratio=float("nan")), dict(metric="l2"), dict(pca_method="svd"),
        dict(skeleton_dtype="bf16"), dict(rank_cap=0), dict(outlier_threshold=0.0),
        dict(outlier_threshold=float("inf")), dict(rsvd_target_rank=0, pca_method="randomized"),
        dict(centroids=[0.0, 1.0, 2.0]), dict(centroids=[0.0, 2.0, 1.0, 3.0]),
        dict(centroids=[0.0, 1.0, 1.0, 3.0]), dict(centroids=[0.0, float("nan"), 1.0, 3.0]),
        dict(bit_width=1, centroids=[-1.0, 0.0, 1.0, 2.0]), dict(threads=0),
        dict(rotation_seed=-1), dict(rotation_seed=2**64),
    ],
)
def test_impossible_parameters(kwargs) -> None:
    with pytest.raises(kt.InvalidParameterError):
        kt.roundtrip_layer(X, **kwargs)


def test_wrongly_typed_parameters() -> None:
    for kwargs in (dict(block_size="512"), dict(bit_width=2.5), dict(share_basis="yes"),
                   dict(threads=1.5), dict(k=True)):
        with pytest.raises(TypeError):
            kt.roundtrip_layer(X, **kwargs)


def test_unknown_keywords_are_rejected() -> None:
    with pytest.raises(TypeError, match="bitwidth.*bit_width"):
        kt.roundtrip_layer(X, bitwidth=3)
    with pytest.raises(TypeError):
        kt.encode_layer(X, block=512)
    with pytest.raises(TypeError):
        kt.encode_block_codes(X, threads=2)


def test_bad_weights() -> None:
    with pytest.raises(kt.InvalidInputError):
        kt.roundtrip_layer(X, weights=-np.ones(100))
    with pytest.raises(kt.InvalidInputError):
        kt.roundtrip_layer(X, weights=np.ones(99))
    with pytest.raises(kt.InvalidInputError):
        kt.roundtrip_layer(X, weights=np.full(100, np.nan))


def test_bad_centroids_file(tmp_path) -> None:
    with pytest.raises(kt.InvalidParameterError):
        kt.roundtrip_layer(X, bit_width=2, centroids_file=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(kt.InvalidParameterError):
        kt.roundtrip_layer(X, bit_width=2, centroids_file=tmp_path / "bad.json")
    # JSON nested past the recursion limit; an .npy header that claims 4e9 values (16 GB) in
    # a file of a few bytes (refused before anything is allocated); a table too long.
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(kt.InvalidParameterError, match="deep.json"):
        kt.load_centroids(tmp_path / "deep.json")
    head = "{'descr': '<f4', 'fortran_order': False, 'shape': (4000000000,), }"
    head += " " * (117 - len(head)) + "\n"
    (tmp_path / "huge.npy").write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head.encode() + bytes(16))
    with pytest.raises(kt.InvalidParameterError, match="huge.npy"):
        kt.load_centroids(tmp_path / "huge.npy")
    np.save(tmp_path / "long.npy", np.linspace(-1, 1, 257))
    with pytest.raises(kt.InvalidParameterError, match="1 to 256 centroids"):
        kt.load_centroids(tmp_path / "long.npy")
    np.save(tmp_path / "ok.npy", np.linspace(-1, 1, 4).astype(np.float32))
    assert kt.load_centroids(tmp_path / "ok.npy").dtype == np.float64


def test_centroids_file_is_read_within_bounds(tmp_path) -> None:
    """A device (``/dev/zero``: endless) or a file far larger than any table is refused,
    naming it, not read until the memory is full."""
    for call in (lambda f: kt.load_centroids(f), lambda f: kt.roundtrip_layer(X, centroids_file=f),
                 lambda f: kt.check_params({"centroids_file": f})):
        with pytest.raises(kt.InvalidParameterError, match="'/dev/zero' is not a regular file"):
            call("/dev/zero")
    (tmp_path / "big.json").write_text("[" + "0, " * 400_000 + "0]")
    with pytest.raises(kt.InvalidParameterError, match="big.json' is larger than 1048576 bytes"):
        kt.load_centroids(tmp_path / "big.json")
    (tmp_path / "ok.json").write_text('{"centroids": [-1, 0, 1]}')
    assert kt.load_centroids(tmp_path / "ok.json").tolist() == [-1.0, 0.0, 1.0]


@pytest.mark.parametrize("kwargs", [[], [("bit_width", 2)], "bit_width", None])
def test_check_params_of_a_non_dict_is_a_type_error(kwargs) -> None:
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        kt.check_params(kwargs)


DATA = kt.encode_layer(X, outlier_threshold=1.5, block_size=32)


def test_every_truncation_is_corrupt() -> None:
    for n in range(len(DATA)):
        with pytest.raises(kt.CorruptDataError):
            kt.decode_layer(DATA[:n])


def test_future_version_is_refused() -> None:
    future = DATA[:4] + (kt.FORMAT_VERSION + 1).to_bytes(2, "little") + DATA[6:]
    with pytest.raises(kt.UnsupportedVersionError, match="newer"):
        kt.decode_layer(future)
    with pytest.raises(kt.CorruptDataError):  # the subclass relation users can rely on
        kt.decode_layer(future)


@given(st.binary(max_size=2000))
def test_random_bytes(data: bytes) -> None:
    with pytest.raises(kt.CorruptDataError):
        kt.decode_layer(data)


@given(st.integers(0, len(DATA) - 1), st.integers(1, 255))
def test_corrupted_bytes(pos: int, xor: int) -> None:
    bad = bytearray(DATA)
    bad[pos] ^= xor
    with pytest.raises(kt.CorruptDataError):
        kt.decode_layer(bytes(bad))


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(TypeError):
        kt.decode_layer("not bytes")
    assert kt.decode_layer(bytearray(DATA)).shape == X.shape
    assert kt.decode_layer(memoryview(DATA)).shape == X.shape


def test_bad_parts() -> None:
    parts = kt.encode_block_codes(X)
    broken = dict(parts, seg_id=parts["seg_id"] + 100)
    with pytest.raises(kt.InvalidInputError):
        kt.decode_block_from_parts(broken)
    short = dict(parts, residual_packed=parts["residual_packed"][:-1])
    with pytest.raises(kt.InvalidInputError):
        kt.decode_block_from_parts(short)
    with pytest.raises(TypeError):
        kt.decode_block_from_parts({k: v for k, v in parts.items() if k != "mean"})


def test_errors_are_value_errors_too() -> None:
    assert issubclass(kt.InvalidInputError, ValueError)
    assert issubclass(kt.CorruptDataError, kt.KakeyaError)


def test_limits_that_prevent_hangs() -> None:
    with pytest.raises(kt.InvalidInputError, match="maximum 4096"):
        kt.roundtrip_layer(np.zeros((2, 4097), np.float32))
    with pytest.raises(kt.InvalidParameterError):
        kt.roundtrip_layer(X, kmeans_max_iter=10**9)
