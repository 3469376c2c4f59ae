"""Settings of the kernel tests.

Without CUDA the Triton kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set
here, before ``kakeyaturbo.kernels`` (whose ``@triton.jit`` decorators read it) is imported.
``KAKEYATURBO_FULL_FUZZ=1`` selects the full parity fuzz (over 1,000 blocks) instead of the CI
subset. Near-threshold disagreements of the parity tests are printed in the terminal summary.
"""

from __future__ import annotations

import os
from typing import Any, List

try:
    import torch

    CUDA = torch.cuda.is_available()
except ModuleNotFoundError:  # the test modules skip themselves (pytest.importorskip)
    CUDA = False
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if CUDA else "cpu"
FULL_FUZZ = os.environ.get("KAKEYATURBO_FULL_FUZZ", "0") == "1"

#: harness.GroupResult objects of the parity tests of this session.
RESULTS: List[Any] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    tr = terminalreporter
    blocks = sum(r.cases for r in RESULTS)
    nears = [n for r in RESULTS for n in r.nears]
    und = sum(r.undetermined_rows for r in RESULTS)
    rows = sum(r.rows for r in RESULTS)
    tr.section("kakeyaturbo kernel parity")
    tr.write_line(
        f"{len(RESULTS)} group runs, {blocks} block / head comparisons on {DEVICE}; "
        f"{len(nears)} near-threshold disagreements; {und} of {rows} rows with undetermined indices"
    )
    for n in nears[:50]:
        tr.write_line(f"  near: {n}")
    if len(nears) > 50:
        tr.write_line(f"  ... {len(nears) - 50} more")
