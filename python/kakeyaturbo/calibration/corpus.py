"""Calibration text: a corpus split by document into a calibration part and an evaluation part
(disjoint by construction, stable, independent of order), and token windows cut from it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from ..errors import InvalidParameterError

#: Share of documents that go to calibration; the rest is evaluation text.
CALIBRATION_SHARE = 0.25


def is_calibration(title: str, share: float = CALIBRATION_SHARE) -> bool:
    """Split by article, by a hash of its title: stable, disjoint, independent of order."""
    h = int.from_bytes(hashlib.sha256(title.encode("utf-8")).digest()[:8], "little")
    return h / 2**64 < share


def load_articles(path: Path) -> Dict[str, str]:
    """title -> text. The wiki package's JSON (title -> {extract, ...}); any other UTF-8
    file is one article per blank-line-separated paragraph, titled by its position."""
    raw = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix == ".json":
        data = json.loads(raw)
        return {t: (v["extract"] if isinstance(v, dict) else str(v)) for t, v in data.items()}
    parts = [p.strip() for p in raw.split("\n\n") if p.strip()]
    return {f"paragraph-{i:06d}": p for i, p in enumerate(parts)}


def split(articles: Dict[str, str], share: float = CALIBRATION_SHARE) -> Tuple[List[str], List[str]]:
    """(calibration texts, evaluation texts), in title order, disjoint by construction."""
    calib, evalu = [], []
    for title in sorted(articles):
        (calib if is_calibration(title, share) else evalu).append(articles[title])
    return calib, evalu


def windows_of(ids: Sequence[int], length: int, count: int, bos: "int | None") -> List[List[int]]:
    """`count` consecutive, non-overlapping windows of `length` tokens from a token stream,
    each starting with `bos` when the tokenizer has one (it does not add it itself)."""
    body = length - (1 if bos is not None else 0)
    out = []
    for i in range(count):
        chunk = list(ids[i * body:(i + 1) * body])
        if len(chunk) < body:
            break
        out.append(([bos] if bos is not None else []) + chunk)
    return out


def calibration_windows(tok: Any, text_path: "os.PathLike[str] | str", windows: int,
                        window: int) -> List[List[int]]:
    """``windows`` token windows of ``window`` tokens from the **calibration** split of the
    text (articles split by title hash, disjoint from the evaluation split)."""
    calib, _ = split(load_articles(Path(text_path)))
    ids: List[int] = []
    for t in calib:
        ids.extend(tok.encode(t + "\n\n", add_special_tokens=False))
        if len(ids) >= windows * window:
            break
    wins = windows_of(ids, window, windows, tok.bos_token_id)
    if not wins:
        raise InvalidParameterError("the calibration split holds no full window")
    return wins
