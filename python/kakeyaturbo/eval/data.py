"""Evaluation text: token windows from the **evaluation** split of a text (the documents the
calibration never sees; `kakeyaturbo.calibration.corpus` defines the split)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List

from ..calibration.corpus import load_articles, split, windows_of


def evaluation_windows(tok: Any, text_path: "os.PathLike[str] | str", count: int,
                       length: int) -> List[List[int]]:
    """Up to ``count`` consecutive windows of ``length`` tokens (each starting with BOS when the
    tokenizer has one) from the evaluation split of the text, in document order."""
    _, texts = split(load_articles(Path(text_path)))
    ids: List[int] = []
    for t in texts:
        ids.extend(tok.encode(t + "\n\n", add_special_tokens=False))
        if len(ids) >= count * length:
            break
    return windows_of(ids, length, count, tok.bos_token_id)
