"""Shipped recipes load, their parameters are valid codec parameters, and bad files fail."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import kv_like

import kakeyaturbo as kt
from kakeyaturbo import recipes


@pytest.mark.parametrize("name", recipes.available())
def test_shipped_recipes_run(name: str) -> None:
    r = recipes.load(name)
    x = kv_like(700, 64)
    for stream in (r.k, r.v):
        y, rep = kt.roundtrip_layer(x, **stream)
        assert y.shape == x.shape and rep["bits_per_element"] < 16


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


def test_sink_and_stream_fields(tmp_path) -> None:
    p = tmp_path / "r.toml"
    p.write_text('name = "s"\nn_sink = 4\nstreams = ["v"]\n')
    r = recipes.load(p)
    assert r.n_sink == 4 and r.streams == ("v",)
    for bad in ("n_sink = -1\n", 'streams = ["q"]\n', "n_sink = true\n"):
        p.write_text(bad)
        with pytest.raises(kt.InvalidParameterError):
            recipes.load(p)
