"""Shipped recipes load, their parameters are valid codec parameters, and bad files fail."""

from __future__ import annotations

import numpy as np
import pytest
from tests.conftest import kv_like

import kakeyaturbo as kt
from kakeyaturbo import recipes


@pytest.mark.parametrize("name", [n for n in recipes.available() if recipes.load(n).mode == "block"])
def test_shipped_block_recipes_run(name: str) -> None:
    r = recipes.load(name)
    x = kv_like(700, 64)
    for stream in (r.k, r.v):
        y, rep = kt.roundtrip_layer(x, **stream)
        assert y.shape == x.shape and rep["bits_per_element"] < 16


@pytest.mark.parametrize("name", [n for n in recipes.available() if recipes.load(n).mode == "calibrated"])
def test_shipped_calibrated_recipes_fit(name: str) -> None:
    from kakeyaturbo import calibration

    r = recipes.load(name)
    x = kv_like(700, 64).astype(np.float64)
    q = kv_like(500, 64, seed=1).astype(np.float64)
    stats = calibration.AttentionStats(
        meta={}, q2=(q.T @ q / len(q))[None, None], k_mean=x.mean(0)[None, None],
        k_cov=np.cov(x.T)[None, None], v_mean=x.mean(0)[None, None], v_cov=np.cov(x.T)[None, None],
        o_gram=np.eye(64)[None, None], k_samples=np.zeros((1, 1, 0, 64), np.float32),
        v_samples=np.zeros((1, 1, 0, 64), np.float32))
    f = q.T @ q / len(q) * 1e-3  # a stand-in for the gradient second moment
    sens = calibration.Sensitivity(meta={}, k=f[None, None], v=(2.0 * f)[None, None])
    codec = calibration.ModelCodec(stats, r, sensitivity=sens if r.needs_sensitivity else None)
    used = nominal = 0.0
    for s in ("k", "v"):
        blob = codec.encode(s, 0, 0, x.astype(np.float32))
        y = codec.decode(s, 0, 0, blob)
        assert y.shape == x.shape
        used += 8 * len(blob) / x.size
        nominal += r.stream(s).bits
        if not r.needs_sensitivity:  # else K and V share one pooled budget
            assert 8 * len(blob) / x.size <= r.stream(s).bits + 0.05
    assert used <= nominal + 0.1


def test_calibrated_recipe_fields(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('mode = "calibrated"\n[k]\nbits = 3\nwhiten = "query"\n[calibration]\npath = "s.safetensors"\n')
    r = recipes.load(p)
    assert r.stream("k").bits == 3 and r.stream("v").bits == recipes.CALIBRATED_DEFAULTS["bits"]
    assert r.calibration.path == str(tmp_path / "s.safetensors")
    for bad in ('mode = "calibrated"\n[k]\nbit_width = 3\n',
                'mode = "calibrated"\n[v]\nwhiten = "query"\n',
                'mode = "calibrated"\n[k]\nbits = 0\n',
                'mode = "other"\n',
                '[calibration]\nwindows = 4\n'):
        p.write_text(bad)
        with pytest.raises(kt.InvalidParameterError):
            recipes.load(p)


def test_shipped_names() -> None:
    assert {"balanced", "max-compression", "predecessor"} <= set(recipes.available())


def test_boundary_layers_resolve_negative_indices() -> None:
    r = recipes.load("predecessor")
    assert r.boundary(28) == [0, 1, 7, 14, 26, 27]
    assert r.boundary(10) == [0, 1, 7, 8, 9]


def test_bad_recipes(tmp_path) -> None:
    with pytest.raises(kt.InvalidParameterError, match="shipped"):
        recipes.load("no-such-recipe")
    p = tmp_path / "r.toml"
    p.write_text('name = "x"\n[k]\nbitwidth = 3\n')
    with pytest.raises(kt.InvalidParameterError, match="bitwidth"):
        recipes.load(p)
    p.write_text('name = "x"\nboundary = [1]\n')
    with pytest.raises(kt.InvalidParameterError, match="unknown field"):
        recipes.load(p)
    p.write_text("name = \n")
    with pytest.raises(kt.InvalidParameterError):
        recipes.load(p)
    p.write_text('boundary_layers = [1.5]\n')
    with pytest.raises(kt.InvalidParameterError):
        recipes.load(p)
    p.write_text('name = "x"\nstreams = ["k", "k"]\n')
    with pytest.raises(kt.InvalidParameterError, match="twice"):
        recipes.load(p)
    p.write_text('name = "x"\nstreams = {k = 1}\n')
    with pytest.raises(kt.InvalidParameterError, match="streams"):
        recipes.load(p)
    with pytest.raises(kt.InvalidParameterError, match="needs mode = 'calibrated'"):
        recipes.Recipe(name="x", calibration=recipes.CalibrationSettings(windows=3))
    # Arrays nested past Python's recursion limit; a name the system refuses to look up.
    p.write_text("a = " + "[" * 2000 + "]" * 2000 + "\n")
    with pytest.raises(kt.InvalidParameterError, match="r.toml"):
        recipes.load(p)
    with pytest.raises(kt.InvalidParameterError):
        recipes.load(tmp_path / ("a" * 300 + ".toml"))


def test_sink_and_stream_fields(tmp_path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "s"\nn_sink = 4\nstreams = ["v"]\n')
    r = recipes.load(p)
    assert r.n_sink == 4 and r.streams == ("v",)
    for bad in ("n_sink = -1\n", 'streams = ["q"]\n', "n_sink = true\n"):
        p.write_text(bad)
        with pytest.raises(kt.InvalidParameterError):
            recipes.load(p)


def test_sensitivity_recipe_fields(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('mode = "calibrated"\n[k]\nwhiten = "fisher"\nallocation = "sensitivity"\n'
                 '[v]\nwhiten = "fisher"\n[calibration]\nsensitivity_windows = 4\n'
                 'sensitivity_path = "f.safetensors"\n')
    r = recipes.load(p)
    assert r.needs_sensitivity and r.calibration.score == 64 and r.calibration.labels == "text"
    assert r.calibration.sensitivity_path == str(tmp_path / "f.safetensors")
    for bad in ('mode = "calibrated"\n[k]\nallocation = "fisher"\n',
                'mode = "calibrated"\n[k]\nwhiten = "gradient"\n',
                'mode = "calibrated"\n[calibration]\nscore = 0\n',
                'mode = "calibrated"\n[calibration]\nsensitivity_windows = true\n',
                'mode = "calibrated"\n[calibration]\nlabels = "truth"\n',
                'mode = "calibrated"\n[calibration]\nlabels = 1\n'):
        p.write_text(bad)
        with pytest.raises(kt.InvalidParameterError):
            recipes.load(p)


def test_bad_sensitivity_is_refused() -> None:
    from kakeyaturbo import calibration

    good = np.zeros((2, 1, 4, 4))
    bad = good.copy()
    bad[0, 0, 1, 1] = np.nan
    for k, v in ((good, bad), (good, np.zeros((2, 1, 4, 3))), (np.zeros((2, 4, 4)), good),
                 (good, np.zeros((1, 1, 4, 4)))):
        with pytest.raises(kt.InvalidParameterError):
            calibration.Sensitivity(meta={}, k=k, v=v)


@pytest.mark.parametrize("body, field", [
    ('[k]\nbit_width = "four"\n', "bit_width"),
    ("[k]\nbit_width = 9\n", "bit_width"),
    ('[v]\nmetric = "l2"\n', "metric"),
    ("boundary_layers = [true]\n", "boundary"),
    ("[k]\noutlier_threshold = -1.0\n", "outlier_threshold"),
    ("[k]\nrotation_seed = -1\n", "rotation_seed"),
    ("[k]\nrotation_seed = 1.7\n", "rotation_seed"),
    ('mode = "calibrated"\n[calibration]\nwindows = -4\n', "windows"),
    ('mode = "calibrated"\n[calibration]\nweighting = "magic"\n', "weighting"),
    ('mode = "calibrated"\n[k]\nbits = "four"\n', "bits"),
    ('mode = "calibrated"\n[k]\nrotation_seed = 1.7\n', "rotation_seed"),
    ('mode = "calibrated"\n[k]\nmax_bits = 9\n', "max_bits"),
    ('mode = "calibrated"\n[k]\nnorm = 1\n', "norm"),
    ('mode = "calibrated"\n[k]\noutlier_threshold = -1.0\n', "outlier_threshold"),
    ('mode = "calibrated"\n[calibration]\npath = 3\n', "path"),
    # Paths the system cannot use: a user it does not know, a NUL character, a name too long.
    ('mode = "calibrated"\n[calibration]\ncorpus = "~nosuchuser_zz/x.txt"\n', "corpus"),
    ('mode = "calibrated"\n[calibration]\npath = "~nosuchuser_zz/s.st"\n', "path"),
    ('mode = "calibrated"\n[calibration]\nsensitivity_path = "~nosuchuser_zz/s.st"\n', "sensitivity_path"),
    ('mode = "calibrated"\n[calibration]\npath = "a\\u0000b"\n', "path 'a\\x00b'"),
    ('mode = "calibrated"\n[calibration]\ncorpus = "a\\u0000b"\n', "corpus"),
    ('mode = "calibrated"\n[calibration]\ncorpus = "' + "a" * 300 + '"\n', "corpus"),
    ('description = 5\n', "description"),
    ('streams = "kv"\n', "stream"),
])
def test_bad_values_are_refused_on_load_naming_file_and_field(tmp_path, body, field) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(body)
    with pytest.raises(kt.InvalidParameterError) as e:
        recipes.load(p)
    assert field in str(e.value) and "bad.toml" in str(e.value), str(e.value)


def test_non_utf8_and_non_toml_recipes_are_refused(tmp_path) -> None:
    p = tmp_path / "latin.toml"
    p.write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(kt.InvalidParameterError, match="latin.toml"):
        recipes.load(p)
    with pytest.raises(kt.InvalidParameterError, match="no recipe named"):
        recipes.load(tmp_path / "missing")
    with pytest.raises(kt.InvalidParameterError, match="cannot read recipe"):
        recipes.load("a\x00b.toml")  # a NUL character in the name


def test_recipes_made_in_code_are_checked_too() -> None:
    with pytest.raises(kt.InvalidParameterError, match="bit_width"):
        recipes.Recipe(name="x", k={"bit_width": 0})
    with pytest.raises(kt.InvalidParameterError, match="whiten"):
        recipes.Recipe(name="x", mode="calibrated", v={"whiten": "query"})
    with pytest.raises(kt.InvalidParameterError, match="calibrated settings"):
        recipes.Recipe(name="x", k=recipes.CalibratedStream())
    for key in ("path", "sensitivity_path"):  # refused when made, not when the file is opened
        with pytest.raises(kt.InvalidParameterError, match=f"{key} .* NUL character"):
            recipes.Recipe(name="x", mode="calibrated", calibration={key: "a\x00b"})
    r = recipes.Recipe(name="x", mode="calibrated", k=recipes.CalibratedStream(bits=3),
                       calibration={"windows": 2})
    assert r.k.bits == 3.0 and r.v == recipes.CalibratedStream() and r.calibration.windows == 2
    assert isinstance(r.k.bits, float) and r.streams == ("k", "v")
