"""Parity of the calibrated mode's torch reference and Triton kernels with the Rust codec.

Each is checked against Rust on its own. The CI subset runs by default (CPU: Triton's
interpreter); ``KAKEYATURBO_FULL_FUZZ=1`` runs the full set of 1,000 heads (cases)."""

from __future__ import annotations

from typing import Callable, Dict

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from . import parity  # noqa: E402
from ..conftest import DEVICE, FULL_FUZZ, RESULTS  # noqa: E402

GROUPS = parity.make_groups(FULL_FUZZ)
_PREPARED: Dict[int, parity.Prepared] = {}


@pytest.fixture(scope="module")
def prepared() -> Callable[[parity.GroupCase], parity.Prepared]:
    """Rust calibrates and encodes each group once for both implementations."""

    def get(group: parity.GroupCase) -> parity.Prepared:
        if group.gid not in _PREPARED:
            _PREPARED[group.gid] = parity.prepare(group)
        return _PREPARED[group.gid]

    return get


@pytest.mark.parametrize("impl", ["reference", "kernels"])
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.label)
def test_calibrated_parity_with_rust(group: parity.GroupCase, impl: str, prepared: Callable) -> None:
    prep = prepared(group)
    run = parity.run_reference if impl == "reference" else parity.run_kernels
    res = run(prep, DEVICE)
    RESULTS.append(res)
    assert res.compared["indices"] > 0
    assert res.max_decode_error <= 1e-5
    violations = res.near_violations()
    assert not violations, "\n".join(violations + [str(n) for n in res.nears[:20]])


def test_calibrated_case_set_covers_the_brief() -> None:
    full = parity.make_groups(True)
    heads = [h for g in full for h in g.heads]
    assert len(heads) >= 1000
    ns = {h.n for h in heads}
    assert {1, 63, 512, 1024} <= ns and len(ns - {1, 63, 512, 1024}) > 50
    assert {g.d for g in full} == set(parity.DIMS)
    assert {g.metric for g in full} == set(parity.METRICS)
    assert {(g.metric, g.norm) for g in full} >= {("mse", True), ("mse", False), ("linf", False),
                                                   ("inner_product", True)}
    assert {g.threshold for g in full} == set(parity.THRESHOLDS)
    assert {g.input_dtype for g in full} == {"float32", "bfloat16"}
    water = [h.target for h in heads if h.layout == "water"]
    assert set(water) == set(parity.TARGETS) and min(water) == 1.5 and max(water) == 8.0
    assert sum(h.layout == "hand" for h in heads) >= 300
    assert {h.table for h in heads} == set(parity.TABLES)
    assert {h.data for h in heads} == set(parity.DATA)
    assert sum(h.whiten for h in heads) >= 200
    assert sum(h.rotation_seed != parity.DEFAULT_SEED for h in heads) >= 100
    # The subset: inner_product with outliers (f32) and mse without norm (bf16).
    sub = parity.make_groups(False)
    assert {(g.metric, g.norm, g.input_dtype) for g in sub} == {("inner_product", True, "float32"),
                                                                 ("mse", False, "bfloat16")}
    assert all(g.threshold is not None for g in sub)


def test_layouts_have_unaligned_bands_and_custom_tables(prepared: Callable) -> None:
    """What makes the calibrated layout hard for a kernel must occur in the cases that run:
    runs of equal bits whose lengths are not powers of two (sub-bands at unaligned offsets),
    several widths per head, and custom tables."""
    codecs = [c for g in GROUPS for c in prepared(g).codecs]
    bands = [b for c in codecs for b in c.bands]
    assert any(off % w for off, w, _ in bands)
    assert np.mean([len({b for _, _, b in c.bands}) > 1 for c in codecs]) >= 0.5
    assert any(cal.tables for g in GROUPS for cal in prepared(g).cals)
