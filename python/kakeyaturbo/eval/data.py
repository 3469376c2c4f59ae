"""Evaluation text: token windows from the **evaluation** split of a domain or a text file (the
documents the calibration never sees; `kakeyaturbo.calibration.corpus` defines the split)."""

from __future__ import annotations

import os
from typing import Any, List

from ..calibration import corpus


def evaluation_windows(tok: Any, text_path: "os.PathLike[str] | str", count: int,
                       length: int) -> List[List[int]]:
    """Up to ``count`` windows of ``length`` tokens (each starting with BOS when the tokenizer
    has one) from the evaluation split of a domain (``wiki-en``, ``code``, ``chat``...) or a
    file: documents run together in title order, or, for ``code`` and ``prose``, windows inside
    one file or page (:func:`kakeyaturbo.calibration.corpus.part_windows`)."""
    return corpus.evaluation_windows(tok, text_path, count, length)
