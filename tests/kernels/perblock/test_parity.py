"""Parity of the torch reference and of the Triton kernels with the Rust codec (the oracle).

Each is checked against Rust on its own. The CI subset runs by default (CPU: Triton's
interpreter); ``KAKEYATURBO_FULL_FUZZ=1`` runs the full set of over 1,000 blocks."""

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
    """Rust fits each group once for both implementations."""

    def get(group: parity.GroupCase) -> parity.Prepared:
        if group.gid not in _PREPARED:
            _PREPARED[group.gid] = parity.prepare(group)
        return _PREPARED[group.gid]

    return get


@pytest.mark.parametrize("impl", ["reference", "kernels"])
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.label)
def test_parity_with_rust(group: parity.GroupCase, impl: str, prepared: Callable) -> None:
    prep = prepared(group)
    run = parity.run_reference if impl == "reference" else parity.run_kernels
    res = run(prep, DEVICE)
    RESULTS.append(res)
    assert res.compared["residual_codes"] + res.undetermined_rows > 0
    assert res.max_decode_error <= 1e-5
    violations = res.near_violations()
    assert not violations, "\n".join(violations + [str(n) for n in res.nears[:20]])


def test_case_set_covers_the_brief() -> None:
    full = parity.make_groups(True)
    blocks = [b for g in full for b in g.blocks]
    assert len(blocks) >= 1000
    ns = {b.n for b in blocks}
    assert {1, 63, 512, 1024} <= ns and len(ns - {1, 63, 512, 1024}) > 50
    assert {g.d for g in full} == set(parity.DIMS)
    assert {g.metric for g in full} == set(parity.METRICS)
    assert {g.bit_width for g in full} == {1, 2, 3, 4}
    assert {g.outlier_threshold for g in full} == set(parity.THRESHOLDS)
    assert {g.input_dtype for g in full} == {"float32", "bfloat16"}
    assert {b.pca for b in blocks} == {"exact", "randomized"}
    assert {b.skeleton_dtype for b in blocks} == {"fp16", "fp32"}
    assert {b.kind for b in blocks} == set(parity.KINDS)
    assert sum(g.centroids is not None for g in full) >= 30
    assert sum(g.rotation_seed != parity.DEFAULT_SEED for g in full) >= 20
    # The subset keeps every metric x bit width and both input dtypes.
    sub = parity.make_groups(False)
    assert {(g.metric, g.bit_width) for g in sub} == {(m, b) for m in parity.METRICS for b in (1, 2, 3, 4)}
    assert {g.input_dtype for g in sub} == {"float32", "bfloat16"}


def test_most_d_eff_are_not_powers_of_two(prepared: Callable) -> None:
    """The band layout only matters when d_eff is not a power of two: most cases must not be.
    (One row gives d_eff 1; three repeated rows give d_eff <= 2, the zero-residual case.)"""
    pairs = [(b, int(p["d_eff"])) for g in GROUPS for b, p in zip(g.blocks, prepared(g).rust)]
    not_pow2 = [d & (d - 1) != 0 for _, d in pairs]
    assert np.mean(not_pow2) >= 0.5, sorted(d for _, d in pairs)
    general = [d & (d - 1) != 0 for b, d in pairs if b.n > 1 and b.kind != "repeat"]
    assert np.mean(general) >= 0.75
    assert np.mean([d > 16 for _, d in pairs]) > 0.4
