"""One calibration file: written and read back exactly, self-describing, and every kind of damage
a typed error naming the file (numpy only; the model-facing checks are in tests/cache)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

pytest.importorskip("safetensors")

from kakeyaturbo.calibration import AttentionStats, Calibration, Sensitivity, is_calibration_file  # noqa: E402
from kakeyaturbo.calibration import bundle  # noqa: E402
from kakeyaturbo.errors import CorruptDataError, InvalidParameterError, UnsupportedVersionError  # noqa: E402

L, H, D, S = 2, 1, 4, 3


def _stats(seed: int = 0) -> AttentionStats:
    g = np.random.default_rng(seed)
    sq = lambda: np.stack([[np.cov(g.standard_normal((D, 50)))] * H] * L)  # noqa: E731
    return AttentionStats(meta={"windows": 2}, q2=sq(), k_mean=g.standard_normal((L, H, D)), k_cov=sq(),
                          v_mean=g.standard_normal((L, H, D)), v_cov=sq(), o_gram=sq(),
                          k_samples=g.standard_normal((L, H, S, D)).astype(np.float32),
                          v_samples=g.standard_normal((L, H, S, D)).astype(np.float32))


def _cal(sens: bool = True) -> Calibration:
    st = _stats()
    se = Sensitivity(meta={"score": 16}, k=st.k_cov * 2, v=st.v_cov * 3) if sens else None
    return Calibration(stats=st, sensitivity=se, model_type="llama", fingerprint="ab" * 16,
                       settings={"text": "t.txt", "windows": 2})


def test_round_trip_is_exact_and_self_describing(tmp_path) -> None:
    path = _cal().save(tmp_path / "c.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # one file, no sidecar
    assert is_calibration_file(path)
    back = Calibration.load(path)
    for k in AttentionStats.ARRAYS:
        np.testing.assert_array_equal(getattr(back.stats, k), getattr(_cal().stats, k))
    np.testing.assert_array_equal(back.sensitivity.v, _cal().sensitivity.v)
    assert back.model_type == "llama" and back.fingerprint == "ab" * 16
    assert back.settings == {"text": "t.txt", "windows": 2}
    assert back.shape == (L, H, D) and back.library.startswith("kakeyaturbo ")
    assert back.stats.meta == {"windows": 2} and back.sensitivity.meta == {"score": 16}
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = f.metadata()
    assert meta["format"] == "kakeyaturbo-calibration" and meta["version"] == "1"
    assert json.loads(meta["shape"]) == [L, H, D]


def test_without_sensitivity_a_recipe_that_needs_it_is_refused(tmp_path) -> None:
    from kakeyaturbo import recipes

    back = Calibration.load(_cal(sens=False).save(tmp_path / "c.safetensors"))
    assert back.sensitivity is None
    with pytest.raises(InvalidParameterError, match="needs the model's sensitivity"):
        back.parts(recipes.load("calibrated-4bit"))
    assert back.parts(recipes.load("benches/recipes/calibrated-4bit-proxy.toml"))[1] is None


def test_statistics_of_no_layer_head_or_dimension_are_refused(tmp_path) -> None:
    st = _stats()
    for cut in (lambda a: a[:0], lambda a: a[:, :0]):  # no layer; no kv-head
        with pytest.raises(InvalidParameterError, match="must be >= 1"):
            AttentionStats(meta={"windows": 2}, **{k: cut(getattr(st, k)) for k in AttentionStats.ARRAYS})
        with pytest.raises(InvalidParameterError, match="each >= 1"):
            Sensitivity(meta={}, k=cut(st.k_cov), v=cut(st.v_cov))
    with pytest.raises(InvalidParameterError):
        AttentionStats.load(tmp_path / ("a" * 300))  # a name the system refuses to look up


def test_names_the_system_refuses_to_look_up_are_refused(tmp_path) -> None:
    from kakeyaturbo.calibration.model_codec import ModelCodec, is_codec_file

    long = tmp_path / ("a" * 300)  # is_file raises OSError (ENAMETOOLONG), not False
    for load in (Calibration.load, bundle.load, ModelCodec.load, AttentionStats.load, Sensitivity.load):
        with pytest.raises(InvalidParameterError, match="file '.*aaaa"):
            load(long)
    assert not is_calibration_file(long) and not is_codec_file(long)


def test_a_stored_meta_that_does_not_read_is_corrupt(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    src = _cal().save(tmp_path / "c.safetensors")
    with safe_open(str(src), framework="np") as f:  # no metadata checksum: each record is checked
        meta = {k: v for k, v in f.metadata().items() if k != "meta_sha256"}
    p = tmp_path / "x.safetensors"
    for key, bad, match in (("stats_meta", '{"windows": "many"}', "'windows'"),
                            ("sensitivity_meta", '{"windows": 1e400}', "'windows'"),
                            ("stats_meta", '{"layer_index": [0, 1e400]}', "'layer_index'"),
                            ("stats_meta", "[1]", "meta must be a dict")):
        save_file(load_file(str(src)), str(p), metadata=dict(meta, **{key: bad}))
        with pytest.raises(CorruptDataError, match=f"x.safetensors.*{match}"):
            Calibration.load(p)


def test_damage_is_a_typed_error_naming_the_file(tmp_path) -> None:
    good = _cal().save(tmp_path / "c.safetensors").read_bytes()
    p = tmp_path / "bad.safetensors"
    cases = {
        "flipped data byte": good[:-5] + bytes([good[-5] ^ 1]) + good[-4:],
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "garbage": b"not a safetensors file at all",
        "huge header length": struct.pack("<Q", 2**62) + good[8:],
    }
    for what, data in cases.items():
        p.write_bytes(data)
        with pytest.raises(CorruptDataError, match="bad.safetensors") as e:
            Calibration.load(p)
        assert "bad.safetensors" in str(e.value), what
    with pytest.raises(InvalidParameterError, match="does not exist"):
        Calibration.load(tmp_path / "nowhere.safetensors")


def _rewrite_meta(src, dst, **changes) -> None:
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(src), framework="np") as f:
        meta = dict(f.metadata())
    meta.update(changes)
    save_file(load_file(str(src)), str(dst), metadata=meta)


def test_other_files_and_newer_versions_are_refused(tmp_path) -> None:
    src = _cal().save(tmp_path / "c.safetensors")
    p = tmp_path / "x.safetensors"
    _rewrite_meta(src, p, version="2")
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        Calibration.load(p)
    _rewrite_meta(src, p, format="something-else")
    with pytest.raises(CorruptDataError, match="not a kakeyaturbo calibration"):
        Calibration.load(p)
    assert not is_calibration_file(p)
    _rewrite_meta(src, p, shape="[3, 1, 4]")
    with pytest.raises(CorruptDataError, match="disagree with the shapes"):
        Calibration.load(p)
    _rewrite_meta(src, p, stats_meta="{broken")
    with pytest.raises(CorruptDataError, match="x.safetensors"):
        Calibration.load(p)
    _rewrite_meta(src, p, stats_meta="[" * 100_000 + "]" * 100_000)  # past the recursion limit
    with pytest.raises(CorruptDataError, match="x.safetensors"):
        Calibration.load(p)
    # A statistics file of the older two-file store is not a calibration file.
    _stats().save(tmp_path / "old.safetensors")
    with pytest.raises(CorruptDataError, match="not a kakeyaturbo calibration"):
        Calibration.load(tmp_path / "old.safetensors")


def test_checksum_covers_every_array(tmp_path) -> None:
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    src = _cal().save(tmp_path / "c.safetensors")
    arrays = load_file(str(src))
    with safe_open(str(src), framework="np") as f:
        meta = dict(f.metadata())
    for name in arrays:
        changed = dict(arrays)
        a = changed[name].copy()
        a.flat[0] += 1
        changed[name] = a
        save_file(changed, str(tmp_path / "m.safetensors"), metadata=meta)
        with pytest.raises(CorruptDataError, match="checksum"):
            Calibration.load(tmp_path / "m.safetensors")
    assert bundle.VERSION == 1


def test_metadata_is_checksummed_and_older_files_still_read(tmp_path) -> None:
    src = _cal().save(tmp_path / "c.safetensors")
    p = tmp_path / "x.safetensors"
    _rewrite_meta(src, p, fingerprint="cd" * 16)  # an edit that still reads
    with pytest.raises(CorruptDataError, match="x.safetensors.*checksum of its metadata"):
        Calibration.load(p)
    _rewrite_meta(src, p, settings='{"windows": 3}')
    with pytest.raises(CorruptDataError, match="checksum of its metadata"):
        Calibration.load(p)
    # A file written before the metadata checksum existed (same version) reads as before.
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(src), framework="np") as f:
        meta = {k: v for k, v in f.metadata().items() if k != "meta_sha256"}
    save_file(load_file(str(src)), str(p), metadata=meta)
    assert Calibration.load(p).fingerprint == "ab" * 16


def test_writes_are_atomic_and_touch_no_other_file(tmp_path, monkeypatch) -> None:
    import os

    # Into a directory: a typed error, nothing written, a user's "<name>.tmp" left alone.
    (tmp_path / "d").mkdir()
    (tmp_path / "d.tmp").write_text("user data")
    with pytest.raises(InvalidParameterError, match="is a directory"):
        _cal().save(tmp_path / "d")
    assert (tmp_path / "d.tmp").read_text() == "user data" and list((tmp_path / "d").iterdir()) == []
    (tmp_path / "c.safetensors.tmp").write_text("user data")
    path = _cal().save(tmp_path / "c.safetensors")
    assert (tmp_path / "c.safetensors.tmp").read_text() == "user data"
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask  # as a plain open() makes it
    before = sorted(p.name for p in tmp_path.iterdir())
    # A write that fails half way: the file that was there stays, no temporary file is left.
    import safetensors.numpy

    def half(arrays, name, metadata=None):
        with open(name, "wb") as f:
            f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", half)
    with pytest.raises(OSError, match="disk full"):
        _cal(sens=False).save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert Calibration.load(path).sensitivity is not None
    # A folder that cannot be made: typed.
    with pytest.raises(InvalidParameterError, match="folder"):
        _cal().save(tmp_path / "d.tmp" / "c.safetensors")
