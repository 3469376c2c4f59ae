"""Calibrated containers of format version 1 that every later version must decode, and the
encoder must keep writing byte for byte (made by `tests/golden/make_golden.py calibrated`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kakeyaturbo as kt

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
CASES = json.loads((GOLDEN / "calibrated_cases.json").read_text())


def _codec(name: str) -> kt.CalibratedCodec:
    case = CASES[name]
    a = np.load(GOLDEN / f"{name}.npz")
    tables = {b: a[f"centroids_{b}"] for b in case["table_widths"]}
    return kt.CalibratedCodec(
        a["mean"], a["analysis"], a["synthesis"], a["spread"], a["bits"],
        rotation_seed=case["rotation_seed"], metric=case["metric"], norm=case["norm"],
        outlier_threshold=case["outlier_threshold"], centroids=tables or None,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_calibration_keeps_its_fingerprint(name: str) -> None:
    c = _codec(name)
    assert f"{c.fingerprint:016x}" == CASES[name]["fingerprint"]
    assert c.model_bytes == CASES[name]["model_bytes"] == len(c.canonical_bytes())


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_calibrated_container_decodes(name: str) -> None:
    c = _codec(name)
    data = (GOLDEN / f"{name}.kkyc").read_bytes()
    want = np.load(GOLDEN / f"{name}.decoded.npy")
    # Decoding sums in a fixed order per platform; allow float32 rounding across CPUs.
    np.testing.assert_allclose(c.decode(data), want, rtol=1e-5, atol=1e-6)
    info = c.inspect(data)
    assert info["compressed_bytes"] == len(data)
    assert info["num_outliers"] == CASES[name]["num_outliers"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_encoder_reproduces_golden_calibrated_bytes(name: str) -> None:
    x = np.load(GOLDEN / "input.npy")
    assert _codec(name).encode(x) == (GOLDEN / f"{name}.kkyc").read_bytes()
