"""What a first run still has to calibrate, per domain of a mixture (``gather.missing``), and the
estimate announced up front covering exactly those parts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kakeyaturbo import assets, commands, recipes  # noqa: E402
from kakeyaturbo.calibration import AttentionStats, Sensitivity, gather  # noqa: E402

MIX = "mixture:wiki-en=1,code=1,wiki-fr=2"


def _fake_stats() -> AttentionStats:
    z = np.zeros((1, 1, 2, 2))
    return AttentionStats(meta={}, q2=z, k_mean=z[..., 0], k_cov=z, v_mean=z[..., 0], v_cov=z,
                          o_gram=z, k_samples=np.zeros((1, 1, 1, 2), np.float32),
                          v_samples=np.zeros((1, 1, 1, 2), np.float32))


def test_missing_names_each_domain_still_to_collect(tmp_path, monkeypatch, word_tok) -> None:
    monkeypatch.setattr(assets, "CACHE", tmp_path)
    model = torch.nn.Linear(2, 2)
    model_path = tmp_path / "m.gguf"
    model_path.write_bytes(b"x" * 10)
    rec = recipes.load("calibrated-3bit")
    rec = replace(rec, calibration=replace(rec.calibration, windows=8, sensitivity_windows=4))
    todo = gather.missing(rec, model, word_tok, model_path, MIX)
    assert todo == [("statistics", "wiki-en", 2), ("statistics", "code", 2),
                    ("statistics", "wiki-fr", 4), ("sensitivity", "wiki-en", 1),
                    ("sensitivity", "code", 1), ("sensitivity", "wiki-fr", 2)]
    # One domain's statistics cached: only the others are left.
    st = rec.calibration
    _fake_stats().save(gather.stats_path(model_path, "code", replace(st, windows=2)))
    Sensitivity(meta={}, k=np.zeros((1, 1, 2, 2)), v=np.zeros((1, 1, 2, 2))).save(
        gather.sensitivity_path(model_path, "wiki-fr", replace(st, sensitivity_windows=2), 1))
    todo = gather.missing(rec, model, word_tok, model_path, MIX)
    assert todo == [("statistics", "wiki-en", 2), ("statistics", "wiki-fr", 4),
                    ("sensitivity", "wiki-en", 1), ("sensitivity", "code", 1)]
    # A per-block recipe and a recipe naming its files need nothing.
    assert gather.missing(recipes.load("balanced"), model, word_tok, model_path, MIX) == []
    named = replace(rec, calibration=replace(st, path="a", sensitivity_path="b"))
    assert gather.missing(named, model, word_tok, model_path, MIX) == []

    # The announcement counts those windows, per domain, at the measured cost per window.
    monkeypatch.setattr(commands, "forward_seconds", lambda *a: 2.0)
    said = []
    monkeypatch.setattr(commands, "_say", said.append)
    plan = commands.calibration_plan(todo)
    assert plan == {"statistics": (6, "wiki-en 2, wiki-fr 4"),
                    "sensitivity": (2, "wiki-en 1, code 1")}
    est = commands.announce_calibration(None, None, tmp_path, st, 6, 2, todo)
    assert est == pytest.approx(2.0 * (6 * commands.STATS_PER_FORWARD
                                       + 2 * commands.SENSITIVITY_PER_FORWARD))
    assert "statistics on 6 windows (wiki-en 2, wiki-fr 4)" in said[0]
    assert "sensitivity on 2 windows (wiki-en 1, code 1)" in said[0]
    assert commands.duration(est) in said[0]
    # Everything of the settings (True), as `calibrate` asks.
    said.clear()
    est_all = commands.announce_calibration(None, None, tmp_path, st, True, False)
    assert est_all == pytest.approx(2.0 * 8 * commands.STATS_PER_FORWARD)
    assert "statistics on 8 windows" in said[0] and "sensitivity" not in said[0]


def test_sensitivity_of_model_labels_is_cached_apart() -> None:
    """A recipe whose sensitivity scores the model's own labels reads and writes its own file;
    the text labels' file keeps its name (caches made before the option stay valid)."""
    st = recipes.CalibrationSettings().checked()
    text = gather.sensitivity_path("m", "wiki-en", st, 1)
    model = gather.sensitivity_path("m", "wiki-en", replace(st, labels="model"), 1)
    assert text != model and "labels" not in text.name and "labelsmodel" in model.name
    assert text.parent == model.parent
