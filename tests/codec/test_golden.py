"""Fixtures that must keep decoding in every later version (see tests/golden/make_golden.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kakeyaturbo as kt

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
CASES = json.loads((GOLDEN / "cases.json").read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_container_decodes(name: str) -> None:
    data = (GOLDEN / f"{name}.kkyt").read_bytes()
    want = np.load(GOLDEN / f"{name}.decoded.npy")
    # Decoding sums in a fixed order per platform; allow float32 rounding across CPUs.
    np.testing.assert_allclose(kt.decode_layer(data), want, rtol=1e-5, atol=1e-6)
    assert kt.inspect_layer(data)["compressed_bytes"] == len(data)


@pytest.mark.parametrize("name", sorted(CASES))
def test_encoder_reproduces_golden_bytes(name: str) -> None:
    x = np.load(GOLDEN / "input.npy")
    assert kt.encode_layer(x, **CASES[name]) == (GOLDEN / f"{name}.kkyt").read_bytes()
