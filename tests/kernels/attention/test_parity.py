"""The Triton decode attention against the Rust kernel. The CI subset runs by default (CPU:
Triton's interpreter, a few seconds); ``KAKEYATURBO_FULL_FUZZ=1`` runs 300 random cases."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from . import parity  # noqa: E402
from ..conftest import DEVICE, FULL_FUZZ  # noqa: E402

CASES = parity.make_cases(FULL_FUZZ)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: f"seed{s.seed}")
def test_triton_attention_matches_rust(spec: parity.Spec) -> None:
    r = parity.run(spec, DEVICE)
    assert r.out_error <= parity.TOL["attention_triton"]


def test_the_subset_covers_the_brief() -> None:
    assert all(parity.covered(list(parity.SUBSET)))
