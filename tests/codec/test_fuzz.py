"""A bounded fuzzer of both container readers through the Python API (a few seconds; the long
run is `make fuzz`, the Rust harness in rust/kakeyaturbo/tests/fuzz/). Valid containers are
mutated and their CRC-32 recomputed, so that the structural checks meet the mutation: every
input must either raise a KakeyaError or decode to finite values of the shape it states."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from tests.conftest import kv_like
from hypothesis import given, settings
from hypothesis import strategies as st

import kakeyaturbo as kt
from kakeyaturbo.codec.perblock import decode_blocks_into

X = kv_like(90, 12)
PERBLOCK = [
    kt.encode_layer(X, block_size=32, outlier_threshold=1.5),
    kt.encode_layer(X[:40], k=1, block_size=2**32 - 1),
    kt.encode_layer(X, share_basis=True, skeleton_dtype="fp32", bit_width=2, block_size=16,
                    pca_method="randomized", centroids=[-1.2, -0.4, 0.4, 1.2]),
    kt.encode_layer((X * np.float32(1e36)).astype(np.float32), metric="ip", block_size=40),
]


def _calibrated(norm: bool, bits: list, threshold: float | None) -> kt.CalibratedCodec:
    q, _ = np.linalg.qr(np.random.default_rng(len(bits)).standard_normal((12, 12)))
    m = len(bits)
    return kt.CalibratedCodec(X.mean(0), q[:m], q[:m] * 1.5, 1.0 / (1.0 + np.arange(m)),
                              np.array(bits), norm=norm, outlier_threshold=threshold,
                              metric="inner_product" if norm else "mse")


CALIBRATED = [
    (c, c.encode(rows))
    for c in (_calibrated(True, [5, 4, 4, 3, 3, 2, 1, 1], 1.8), _calibrated(False, [8] * 6, None))
    for rows in (X[:1], X, (X * np.float32(1e30)).astype(np.float32))
]

#: Little-endian values at the edges of the size fields' ranges.
BOUNDARY = [0, 1, 2, 7, 8, 255, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, 1 << 40,
            1 << 61, 2**64 - 1]

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 4095), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 4095), st.integers(0, 255)),
    st.tuples(st.just("field"), st.integers(0, 4095), st.sampled_from([1, 2, 4, 8]),
              st.one_of(st.sampled_from(BOUNDARY), st.integers(0, 2**64 - 1))),
    st.tuples(st.just("truncate"), st.integers(0, 4095)),
    st.tuples(st.just("insert"), st.integers(0, 4095), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 4095), st.integers(1, 16)),
)


def _mutate(data: bytes, muts: list, recompute_crc: bool) -> bytes:
    b = bytearray(data)
    for m in muts:
        if not b:
            break
        kind, at = m[0], m[1] % len(b)
        if kind == "flip":
            b[at] ^= 1 << m[2]
        elif kind == "set":
            b[at] = m[2]
        elif kind == "field":
            w = min(m[2], len(b))
            at = m[1] % (len(b) - w + 1)
            b[at:at + w] = m[3].to_bytes(8, "little")[:w]
        elif kind == "truncate":
            del b[at:]
        elif kind == "insert":
            b[at:at] = m[2]
        else:
            del b[at:at + m[2]]
    if recompute_crc and len(b) >= 4:
        b[-4:] = zlib.crc32(bytes(b[:-4])).to_bytes(4, "little")
    return bytes(b)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, len(PERBLOCK) - 1), st.lists(mutation, min_size=1, max_size=4),
       st.booleans())
def test_mutated_per_block_containers(i: int, muts: list, keep_crc: bool) -> None:
    # decode_layer and the decode into a given array (a cache's blocks) agree: the same rows, or
    # both refuse, the array then untouched.
    data = _mutate(PERBLOCK[i], muts, not keep_crc)
    whole = kt.inspect_layer(PERBLOCK[i])
    out = np.full((1, whole["num_vecs"] + 2, whole["dim"]), 7.0, np.float32)
    try:
        y = kt.decode_layer(data)
    except kt.KakeyaError:
        with pytest.raises(kt.KakeyaError):
            decode_blocks_into([[data]], whole["num_vecs"], out, 1)
        assert (out == 7).all()
        return
    info = kt.inspect_layer(data)
    assert y.shape == (info["num_vecs"], info["dim"])
    assert np.isfinite(y).all()
    out = np.full((1, y.shape[0] + 2, y.shape[1]), 7.0, np.float32)
    decode_blocks_into([[data]], y.shape[0], out, 1)
    assert np.array_equal(out[0, 1:-1], y) and (out[0, [0, -1]] == 7).all()


@settings(max_examples=400, deadline=None)
@given(st.integers(0, len(CALIBRATED) - 1), st.lists(mutation, min_size=1, max_size=4),
       st.booleans())
def test_mutated_calibrated_containers(i: int, muts: list, keep_crc: bool) -> None:
    c, blob = CALIBRATED[i]
    data = _mutate(blob, muts, not keep_crc)
    try:
        y = c.decode(data)
    except kt.KakeyaError:
        return
    assert y.shape == (c.inspect(data)["num_vecs"], c.d)
    assert np.isfinite(y).all()


def test_the_corpus_decodes() -> None:
    for data in PERBLOCK:
        assert np.isfinite(kt.decode_layer(data)).all()
    for c, data in CALIBRATED:
        assert np.isfinite(c.decode(data)).all()
