"""Shared test settings: hypothesis profiles chosen by HYPOTHESIS_PROFILE (default "ci")."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def kv_like(n: int, d: int, seed: int = 0, decay: float = 0.85) -> np.ndarray:
    """Rows with a decaying spectrum in a random basis, plus one heavy channel."""
    g = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    x = (g.standard_normal((n, d)) * decay ** np.arange(d)) @ q.T
    x[:, 0] += 3.0
    return x.astype(np.float32)


@pytest.fixture
def kv() -> np.ndarray:
    return kv_like(600, 32)
