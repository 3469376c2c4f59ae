"""The calibrated codec: container round trips and byte counts, custom tables, bad input,
other calibrations' containers, determinism across threads."""

from __future__ import annotations

import numpy as np
import pytest

import kakeyaturbo as kt
from kakeyaturbo import calibration

D = 32


def _data(n: int = 2000, d: int = D, seed: int = 0):
    g = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    lam = 2.0 * 0.85 ** np.arange(d)
    x = (g.standard_normal((n, d)) * np.sqrt(lam)) @ q.T + 0.3
    return x.astype(np.float32), q, lam


def _codec(bpe: float = 3.0, **kw) -> tuple:
    x, _, _ = _data()
    fit = calibration.fit_stream(x.mean(0), np.cov(x.T, bias=True), bpe)
    return fit.codec(**kw), x, fit


def test_container_round_trip_and_bytes() -> None:
    c, x, fit = _codec(3.0, outlier_threshold=3.0, metric="inner_product")
    y, r = c.roundtrip(x)
    blob = c.encode(x)
    assert np.array_equal(c.decode(blob), y)
    assert len(blob) == r["compressed_bytes"]
    assert r["code_bytes"] == x.shape[0] * c.row_bytes
    assert c.row_bits == int(fit.bits.sum()) and c.row_bits <= 3 * D - 16
    n = x.shape[0]
    assert r["scale_bytes"] == 1 + 2 * n  # shared exponent + one fp16 per row
    per_row = 8 * (r["code_bytes"] + r["scale_bytes"] - 1) / n
    assert per_row <= 3.0 * D
    assert r["bits_per_element"] == pytest.approx(8 * r["compressed_bytes"] / x.size)
    info = c.inspect(blob)
    assert info["fingerprint"] == c.fingerprint and info["num_vecs"] == x.shape[0]
    assert c.model_bytes == len(c.canonical_bytes())
    parts = c.encode_parts(x)
    assert np.array_equal(c.decode_parts(parts), y)
    assert parts["indices"].shape == (x.shape[0], c.m)



def test_custom_tables_and_lloyd_fit() -> None:
    z = np.random.default_rng(4).laplace(size=20000)
    t = calibration.lloyd_max(z, 3)
    assert len(t) == 8 and np.all(np.diff(t) > 0)
    gauss = kt.centroids_gaussian(3)
    assert t[-1] > gauss[-1]  # heavier tails than N(0, 1) spread the outer levels
    c, x, fit = _codec(3.0)
    widths = sorted(set(int(b) for b in fit.bits))
    c2 = fit.codec(centroids={b: kt.centroids_gaussian(b) * 1.01 for b in widths})
    assert c2.fingerprint != c.fingerprint
    assert not np.array_equal(c2.decode(c2.encode(x)), c.decode(c.encode(x)))



def test_bad_input_and_other_calibrations() -> None:
    c, x, fit = _codec(3.0)
    with pytest.raises(TypeError):
        c.encode(x.astype(np.float64))
    bad = x.copy()
    bad[3, 4] = np.nan
    with pytest.raises(kt.InvalidInputError):
        c.encode(bad)
    with pytest.raises(kt.InvalidInputError):
        c.encode(x[:, :5].copy())
    with pytest.raises(kt.InvalidInputError):
        c.encode(np.zeros((0, D), np.float32))
    blob = c.encode(x[:100])
    with pytest.raises(kt.CorruptDataError):
        c.decode(blob[:-3])
    flipped = bytearray(blob)
    flipped[60] ^= 1
    with pytest.raises(kt.CorruptDataError):
        c.decode(bytes(flipped))
    with pytest.raises(kt.CorruptDataError):
        c.decode(kt.encode_layer(x[:100]))
    other = calibration.fit_stream(x.mean(0), np.cov(x.T, bias=True), 2.0).codec()
    with pytest.raises(kt.InvalidParameterError, match="different calibration"):
        other.decode(blob)
    with pytest.raises(kt.InvalidParameterError):
        fit.codec(metric="inner_product", norm=False)
    with pytest.raises(kt.InvalidParameterError):
        kt.CalibratedCodec(fit.mean, fit.analysis, fit.synthesis, -fit.spread, fit.bits)
    with pytest.raises(kt.InvalidParameterError):
        kt.CalibratedCodec(fit.mean, fit.analysis, fit.synthesis, fit.spread, fit.bits * 0)
    with pytest.raises(kt.InvalidParameterError, match="synthesis must have shape"):
        kt.CalibratedCodec(fit.mean, fit.analysis, fit.synthesis[:, :3], fit.spread, fit.bits)
    with pytest.raises(kt.InvalidParameterError, match="bits must have shape"):
        kt.CalibratedCodec(fit.mean, fit.analysis, fit.synthesis, fit.spread, fit.bits[1:])



def test_deterministic_across_threads() -> None:
    c, x, _ = _codec(3.0, outlier_threshold=2.5)
    big = np.tile(x, (3, 1))
    assert c.encode(big, threads=1) == c.encode(big, threads=2)


@pytest.mark.parametrize("threads", [None, 1, 2])
def test_blocks_in_one_call_are_each_blocks_own(threads) -> None:
    # Two calibrations over three row sets (one used twice), blocks of 96 rows and of 300 (a
    # block past one chunk of 256 rows): each container the bytes of that block's own encode,
    # each decoded block its own decode.
    from kakeyaturbo.codec.calibrated import decode_blocks, encode_blocks

    c, x, fit = _codec(3.0, outlier_threshold=2.5)
    c2 = calibration.fit_stream(x.mean(0), np.cov(x.T, bias=True), 2.0).codec()
    rows = np.stack([x[:1200], x[400:1600] * 3, x[800:]])
    for block in (96, 300):
        t = 1200 // block * block
        got = encode_blocks([c, c2, c], rows[:, :t], block, threads=threads)
        y = decode_blocks([c, c2, c], got, block, threads=threads)
        assert len(got) == t // block and all(len(b) == 3 for b in got)
        assert y.shape == (3, t, D) and y.dtype == np.float32
        for j, blobs in enumerate(got):
            for g, (codec, blob) in enumerate(zip([c, c2, c], blobs)):
                assert blob == codec.encode(rows[g, j * block:(j + 1) * block]), (block, j, g)
                assert np.array_equal(y[g, j * block:(j + 1) * block], codec.decode(blob)), (block, j, g)
    assert encode_blocks([c], rows[:1, :0], 4) == []
    assert decode_blocks([c], [], 4).shape == (1, 0, D)


def test_decode_blocks_refusals() -> None:
    from kakeyaturbo.codec.calibrated import decode_blocks

    c, x, _ = _codec(3.0)
    other = calibration.fit_stream(x.mean(0), np.cov(x.T, bias=True), 2.0).codec()
    a, b = c.encode(x[:128]), c.encode(x[128:256])
    with pytest.raises(kt.InvalidInputError, match="2 containers for 1"):
        decode_blocks([c], [[a, b]], 128)
    with pytest.raises(kt.InvalidInputError, match="64 rows"):
        decode_blocks([c], [[a], [c.encode(x[:64])]], 128)
    with pytest.raises(kt.CorruptDataError):
        decode_blocks([c, c], [[a, b[:-3]]], 128)
    with pytest.raises(kt.InvalidParameterError, match="different calibration"):
        decode_blocks([c, other], [[a, b]], 128)
    with pytest.raises(kt.InvalidParameterError):
        decode_blocks([], [], 128)
    with pytest.raises(kt.InvalidParameterError):
        decode_blocks([c], [[a]], 0)
    with pytest.raises(TypeError):
        decode_blocks([c], [["text"]], 128)


def test_decode_blocks_into_rows_of_a_given_array() -> None:
    from kakeyaturbo.codec.calibrated import decode_blocks, decode_blocks_into

    c, x, _ = _codec(3.0, outlier_threshold=2.5)
    c2 = calibration.fit_stream(x.mean(0), np.cov(x.T, bias=True), 2.0).codec()
    blobs = [[c.encode(x[j * 96:(j + 1) * 96]), c2.encode(x[j * 96 + 500:(j + 1) * 96 + 500])] for j in range(3)]
    want = decode_blocks([c, c2], blobs, 96)
    for threads in (None, 1, 2):
        out = np.full((2, 300, D), 7.0, np.float32)
        decode_blocks_into([c, c2], blobs, 96, out, 5, threads=threads)
        assert np.array_equal(out[:, 5:293], want)
        assert (out[:, :5] == 7).all() and (out[:, 293:] == 7).all()
    # Refused before anything is written: blocks past the end, another shape, dtype, layout, a
    # read-only array.
    out = np.full((2, 300, D), 7.0, np.float32)
    with pytest.raises(kt.InvalidInputError, match="cannot take 3 blocks"):
        decode_blocks_into([c, c2], blobs, 96, out, 13)
    for at, rows in ((-1, 96), (2**70, 96), (0, 2**70)):  # not an OverflowError
        with pytest.raises(kt.InvalidParameterError):
            decode_blocks_into([c, c2], blobs, rows, out, at)
    with pytest.raises(kt.InvalidInputError, match="shape"):
        decode_blocks_into([c, c2], blobs, 96, out[:1], 0)
    for bad in (out.astype(np.float64), np.asfortranarray(out), out[:, ::2]):
        with pytest.raises(kt.InvalidInputError, match="C-contiguous float32"):
            decode_blocks_into([c, c2], blobs, 96, bad, 0)
    frozen = out.copy()
    frozen.flags.writeable = False
    with pytest.raises(kt.InvalidInputError, match="writeable"):
        decode_blocks_into([c, c2], blobs, 96, frozen, 0)
    assert (out == 7).all()


def test_encode_blocks_refusals() -> None:
    from kakeyaturbo.codec.calibrated import encode_blocks

    c, x, _ = _codec(3.0)
    rows = np.stack([x[:256], x[256:512]])
    with pytest.raises(kt.InvalidInputError, match="2 row sets"):
        encode_blocks([c], rows, 128)
    with pytest.raises(kt.InvalidInputError, match="whole blocks"):
        encode_blocks([c, c], rows, 100)
    with pytest.raises(kt.InvalidParameterError):
        encode_blocks([c, c], rows, 0)
    with pytest.raises(kt.InvalidInputError, match="columns"):
        encode_blocks([c, c], rows[:, :, :5].copy(), 128)
    with pytest.raises(kt.InvalidInputError):
        encode_blocks([c, c], rows[0], 128)
    with pytest.raises(TypeError):
        encode_blocks([c, c], rows.astype(np.float64), 128)
    with pytest.raises(TypeError):
        encode_blocks([c, "c"], rows, 128)
    bad = rows.copy()
    bad[1, 200, 3] = np.inf
    with pytest.raises(kt.InvalidInputError):
        encode_blocks([c, c], bad, 128)
