"""Evaluation windows come from the evaluation split only."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kakeyaturbo.calibration import corpus  # noqa: E402
from kakeyaturbo.eval import data, model  # noqa: E402


def test_evaluation_windows_never_see_calibration_text(tiny_model_dir) -> None:
    _, tok = model.load(tiny_model_dir)
    text = tiny_model_dir / "text.txt"
    wins = data.evaluation_windows(tok, text, 3, 50)
    assert len(wins) == 3 and all(len(w) == 50 and w[0] == tok.bos_token_id for w in wins)
    calib, evalu = corpus.split(corpus.load_articles(text))
    # The first window starts with the first evaluation paragraph's tokens.
    first = tok.encode(evalu[0] + "\n\n", add_special_tokens=False)
    assert wins[0][1:1 + min(len(first), 49)] == first[:49]
    cal = corpus.calibration_windows(tok, text, 2, 50)
    assert cal[0][1:] != wins[0][1:]
    assert len(data.evaluation_windows(tok, text, 10_000, 50)) < 10_000  # the text runs out
