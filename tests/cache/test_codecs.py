"""The codecs the cache ships and the one place a recipe becomes a codec (codec_for)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import BlockCodec, IdentityCodec, codec_for  # noqa: E402
from tests.synthetic_stats import synthetic_stats  # noqa: E402


def _stats(layers: int = 2, heads: int = 1, d: int = 16):
    stats = synthetic_stats(layers, heads, d)
    return stats, calibration.Sensitivity(meta={}, k=stats.q2 * 1e-3, v=stats.q2 * 1e-3)


def test_codec_for_picks_the_mode() -> None:
    block = codec_for(recipes.load("balanced"), threads=1, pre_rope_keys=True)
    assert isinstance(block, BlockCodec) and block.pre_rope_keys and block.threads == 1
    stats, sens = _stats()
    cal = codec_for(recipes.load("calibrated-3bit"), stats=stats, sensitivity=sens)
    assert isinstance(cal, calibration.ModelCodec) and cal.pre_rope_keys
    x = np.random.default_rng(1).standard_normal((40, 16)).astype(np.float32)
    for codec in (block, cal):
        for s in ("k", "v"):
            y = codec.decode(s, 1, 0, codec.encode(s, 1, 0, x))
            assert y.shape == x.shape and np.isfinite(y).all()
    with pytest.raises(kt.InvalidParameterError, match="statistics"):
        codec_for(recipes.load("calibrated-3bit"))
    with pytest.raises(kt.InvalidParameterError, match="Sensitivity"):
        codec_for(recipes.load("calibrated-3bit"), stats=stats)
    with pytest.raises(TypeError, match="Recipe"):
        codec_for("balanced")  # type: ignore[arg-type]
    with pytest.raises(kt.InvalidParameterError, match="not per-block"):
        BlockCodec(recipes.load("calibrated-4bit"))
    with pytest.raises(kt.InvalidParameterError, match="kv-head 3"):
        cal.encode("k", 0, 3, x)


def test_identity_codec_is_exact_and_refuses_other_bytes() -> None:
    c = IdentityCodec()
    x = np.random.default_rng(2).standard_normal((5, 8)).astype(np.float32)
    assert np.array_equal(c.decode("v", 0, 0, c.encode("v", 0, 0, x)), x)
    blob = c.encode("k", 0, 0, x)
    for bad in (b"", b"\x00\x00\x00\x00", blob[:-1], b"\x08\x00"):
        with pytest.raises(kt.CorruptDataError):
            c.decode("k", 0, 0, bad)
    with pytest.raises(kt.InvalidParameterError, match="stream"):
        c.encode("q", 0, 0, x)
    with pytest.raises(TypeError):
        c.decode("k", 0, 0, "text")  # type: ignore[arg-type]


def test_blocks_in_one_call_are_each_blocks_own() -> None:
    # The cache seals a long prompt's blocks through encode_blocks and the slow path decodes a
    # layer's blocks through decode_blocks: with a calibrated codec in one call
    # (ModelCodec.encode_blocks / decode_blocks; a per-block one decodes so too), with any other
    # block by block; the blobs
    # [block][batch][head] are each (stream, layer, head) encode's, the rows each decode_rows'.
    from kakeyaturbo.cache.codecs import decode_blocks, decode_rows, encode_blocks

    stats, sens = _stats(heads=2)
    cal = codec_for(recipes.load("calibrated-3bit"), stats=stats, sensitivity=sens)
    x = np.random.default_rng(3).standard_normal((2, 2, 96, 16)).astype(np.float32)
    for codec in (cal, BlockCodec(recipes.load("balanced")), IdentityCodec()):
        got = encode_blocks(codec, "v", 1, x, 32)
        assert len(got) == 3
        for j, blobs in enumerate(got):
            want = [[codec.encode("v", 1, h, np.ascontiguousarray(x[b, h, 32 * j:32 * (j + 1)]))
                     for h in range(2)] for b in range(2)]
            assert blobs == want, (type(codec).__name__, j)
        rows = np.concatenate([decode_rows(codec, "v", 1, b, 32, 16) for b in got], axis=2)
        y = decode_blocks(codec, "v", 1, got, 32, 16)
        assert y.shape == (2, 2, 96, 16) and np.array_equal(y, rows), type(codec).__name__
    with pytest.raises(kt.InvalidParameterError, match="kv-head 2"):
        cal.encode_blocks("k", 0, np.zeros((1, 3, 32, 16), np.float32), 32)
    with pytest.raises(kt.InvalidParameterError, match="expected 8"):
        decode_blocks(cal, "v", 1, encode_blocks(cal, "v", 1, x, 32), 32, 8)
