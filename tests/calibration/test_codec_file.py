"""A model's fitted codecs in one file (``ModelCodec.save`` / ``ModelCodec.load``): the same
codecs back (fingerprints, bytes), also where fitting them again from the statistics would not
give them (a CPU whose BLAS rounds the eigendecomposition differently); every kind of damage is a
typed error naming the file."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import kakeyaturbo
from kakeyaturbo import recipes
from kakeyaturbo.calibration import AttentionStats, ModelCodec, Sensitivity
from kakeyaturbo.codec import CalibratedCodec
from kakeyaturbo.errors import CorruptDataError, InvalidParameterError, UnsupportedVersionError

L, H, D = 2, 2, 16


def _psd(g, decay: float) -> np.ndarray:
    a = g.standard_normal((200, D)) * decay ** np.arange(D)
    q, _ = np.linalg.qr(g.standard_normal((D, D)))
    a = a @ q
    return a.T @ a / 200


@pytest.fixture(scope="module")
def stats_and_sensitivity():
    g = np.random.default_rng(4)
    mats = lambda decay: np.stack([np.stack([_psd(g, decay) for _ in range(H)]) for _ in range(L)])
    rows = g.standard_normal((L, H, 300, D)).astype(np.float32) * (0.8 ** np.arange(D)).astype(np.float32)
    stats = AttentionStats(meta={}, q2=mats(0.8), k_mean=g.standard_normal((L, H, D)),
                           k_cov=mats(0.75), v_mean=g.standard_normal((L, H, D)) * 0.1,
                           v_cov=mats(0.8), o_gram=mats(0.9), k_samples=rows, v_samples=rows)
    sens = Sensitivity(meta={}, k=mats(0.6), v=mats(0.65))
    return stats, sens


@pytest.fixture(scope="module", params=["calibrated-3bit", "calibrated-4bit", "tables"])
def fitted(request, stats_and_sensitivity):
    stats, sens = stats_and_sensitivity
    if request.param == "tables":  # custom Lloyd-Max tables and no outliers
        rec = recipes.load("calibrated-4bit")
        rec = replace(rec, name="tables", k=replace(rec.k, tables="calibrated", outlier_threshold=None),
                      v=replace(rec.v, tables="per-head"))
    else:
        rec = recipes.load(request.param)
    return ModelCodec(stats, rec, sensitivity=sens)


def _fps(mc: ModelCodec) -> dict:
    return {k: c.fingerprint for k, c in mc.codecs.items()}


def test_the_same_codecs_come_back(fitted, tmp_path) -> None:
    path = fitted.save(tmp_path / "codec.safetensors")
    back = ModelCodec.load(path, threads=1)
    assert _fps(back) == _fps(fitted) and back.model_bytes == fitted.model_bytes
    assert back.recipe == fitted.recipe and back.pre_rope_keys == fitted.pre_rope_keys
    assert {s: sorted(t) for s, t in back.tables.items()} == {s: sorted(t) for s, t in fitted.tables.items()}
    x = np.random.default_rng(1).standard_normal((70, D)).astype(np.float32)
    for key in fitted.codecs:
        blob = fitted.encode(*key, x)
        assert back.encode(*key, x) == blob
        assert np.array_equal(back.decode(*key, blob), fitted.decode(*key, blob))
    # A codec rebuilt from what it was made from is the same codec.
    c = next(iter(fitted.codecs.values()))
    assert CalibratedCodec(**c.as_dict()).fingerprint == c.fingerprint


_UNPICKLE = """
import json, pickle, sys
mc = pickle.load(sys.stdin.buffer)
print(json.dumps({f"{s}.{l}.{h}": c.fingerprint for (s, l, h), c in mc.codecs.items()}))
"""


def test_a_pickled_model_codec_codes_as_the_original(fitted) -> None:
    """What a ``spawn`` or ``forkserver`` process pool does with a codec it hands its workers:
    pickled, then unpickled here and in a fresh interpreter, the same codecs (before 2026-12-06 a
    TypeError: the codec's Rust object could not be pickled)."""
    data = pickle.dumps(fitted)
    back = pickle.loads(data)
    assert _fps(back) == _fps(fitted) and back.recipe == fitted.recipe
    x = np.random.default_rng(2).standard_normal((70, D)).astype(np.float32)
    for key in fitted.codecs:
        assert back.encode(*key, x) == fitted.encode(*key, x)
    r = subprocess.run([sys.executable, "-c", _UNPICKLE], input=data, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert json.loads(r.stdout) == {f"{s}.{l}.{h}": fp for (s, l, h), fp in _fps(fitted).items()}


_CHILD = """
import json, sys
from kakeyaturbo.calibration import ModelCodec
mc = ModelCodec.load(sys.argv[1])
print(json.dumps({f"{s}.{l}.{h}": c.fingerprint for (s, l, h), c in mc.codecs.items()}))
"""


def test_a_process_with_other_blas_kernels_loads_the_same_codecs(fitted, tmp_path) -> None:
    """OpenBLAS's AVX2 kernels (what an older CPU runs) round the fit's eigendecompositions
    differently from its AVX-512 ones; the file does not depend on them."""
    path = fitted.save(tmp_path / "codec.safetensors")
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell")
    root = str(Path(kakeyaturbo.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {f"{s}.{layer}.{h}": fp for (s, layer, h), fp in _fps(fitted).items()}


def _rewrite(src: Path, dst: Path, arrays=None, meta=None, keep_checksum: bool = False) -> Path:
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from kakeyaturbo.calibration.model_codec import _codec_checksum

    with safe_open(str(src), framework="np") as f:
        m = dict(f.metadata())
        a = {k: f.get_tensor(k) for k in f.keys()}
    a = arrays(a) if arrays else a
    m = meta(m) if meta else m
    if not keep_checksum:
        m["sha256"] = _codec_checksum(a, m)
    save_file(a, str(dst), metadata=m)
    return dst


def test_damage_of_every_kind_is_typed_and_names_the_file(fitted, tmp_path) -> None:
    path = fitted.save(tmp_path / "codec.safetensors")
    with pytest.raises(InvalidParameterError, match="does not exist"):
        ModelCodec.load(tmp_path / "nothing.safetensors")
    (tmp_path / "adir").mkdir()
    with pytest.raises(InvalidParameterError, match="adir' is a directory, not a file"):
        ModelCodec.load(tmp_path / "adir")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:len(data) // 2])
    with pytest.raises(CorruptDataError, match="cut.safetensors"):
        ModelCodec.load(cut)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptDataError, match="garbage.safetensors"):
        ModelCodec.load(garbage)
    key = sorted(k for k in fitted.codecs)[0]
    name = f"{key[0]}.{key[1]}.{key[2]}"

    def flip(a):
        a = dict(a)
        x = a[f"{name}.analysis"].copy()
        x[0, 0] = np.nextafter(x[0, 0], np.float32(np.inf))
        a[f"{name}.analysis"] = x
        return a

    # A changed value under the old checksum; and under a recomputed one (the fingerprint).
    with pytest.raises(CorruptDataError, match="damaged"):
        ModelCodec.load(_rewrite(path, tmp_path / "a.safetensors", arrays=flip, keep_checksum=True))
    with pytest.raises(CorruptDataError, match="does not rebuild to its fingerprint"):
        ModelCodec.load(_rewrite(path, tmp_path / "b.safetensors", arrays=flip))
    with pytest.raises(CorruptDataError, match="damaged"):
        ModelCodec.load(_rewrite(path, tmp_path / "c.safetensors", keep_checksum=True,
                                 meta=lambda m: {**m, "recipe": m["recipe"].replace("calibrated", "calibrateD", 1)}))
    drop = lambda a: {k: v for k, v in a.items() if not k.startswith(f"{name}.")}
    with pytest.raises(CorruptDataError, match=f"{name}"):
        ModelCodec.load(_rewrite(path, tmp_path / "d.safetensors", arrays=drop))

    def one_less(m):
        heads = json.loads(m["heads"])
        del heads[name]
        return {**m, "heads": json.dumps(heads)}

    with pytest.raises(CorruptDataError, match="do not cover"):
        ModelCodec.load(_rewrite(path, tmp_path / "e.safetensors", arrays=drop, meta=one_less))
    nan = lambda a: {**a, f"{name}.spread": np.full_like(a[f"{name}.spread"], np.nan)}
    with pytest.raises(CorruptDataError, match="e.safetensors|f.safetensors"):
        ModelCodec.load(_rewrite(path, tmp_path / "f.safetensors", arrays=nan))
    with pytest.raises(CorruptDataError, match="not a kakeyaturbo codec file"):
        ModelCodec.load(_rewrite(path, tmp_path / "g.safetensors", meta=lambda m: {**m, "format": "x"}))
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        ModelCodec.load(_rewrite(path, tmp_path / "h.safetensors", meta=lambda m: {**m, "version": "2"}))
    block = json.dumps(recipes.load("balanced").as_dict())
    with pytest.raises(CorruptDataError, match="not calibrated"):
        ModelCodec.load(_rewrite(path, tmp_path / "i.safetensors", meta=lambda m: {**m, "recipe": block}))
    with pytest.raises(CorruptDataError, match="j.safetensors"):
        ModelCodec.load(_rewrite(path, tmp_path / "j.safetensors", meta=lambda m: {**m, "heads": "[1, 2"}))
    # JSON nested past Python's recursion limit.
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(CorruptDataError, match="k.safetensors"):
        ModelCodec.load(_rewrite(path, tmp_path / "k.safetensors", meta=lambda m: {**m, "recipe": deep}))

    # A kv-head index of 10^12 under a recomputed checksum: refused at once, before the set of
    # the 10^12 calibrations such a file would hold is built.
    huge = f"{key[0]}.{key[1]}.{10**12}"

    def renamed(a):
        return {(huge + k[len(name):] if k.startswith(f"{name}.") else k): v for k, v in a.items()}

    def renamed_meta(m):
        heads = json.loads(m["heads"])
        heads[huge] = heads.pop(name)
        return {**m, "heads": json.dumps(heads)}

    with pytest.raises(CorruptDataError, match="do not cover"):
        ModelCodec.load(_rewrite(path, tmp_path / "l.safetensors", arrays=renamed, meta=renamed_meta))


def test_recipe_as_dict_round_trips() -> None:
    for name in recipes.available():
        rec = recipes.load(name)
        assert recipes.Recipe(**json.loads(json.dumps(rec.as_dict()))) == rec
