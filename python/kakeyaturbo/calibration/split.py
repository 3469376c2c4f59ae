"""A text split by document into a calibration part and an evaluation part (disjoint by
construction, stable, independent of order: by a hash of each document's id), and the pieces a
window is cut from (:class:`Part`, :class:`Windows`)."""

from __future__ import annotations

import hashlib
import json
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ..errors import InvalidParameterError

#: Share of documents that go to calibration; the rest is evaluation text.
CALIBRATION_SHARE = 0.25

#: Domains of long documents: their windows are cut inside one document (a file, a page), at
#: most :data:`PER_DOCUMENT` from each, so that a long context is one coherent text. Their
#: documents are taken in the order of a hash of their paths (paths group by package or
#: section; the hash samples across them). Other texts run documents together in title order.
COHERENT = ("code", "prose")
PER_DOCUMENT = 2

def _hash01(text: str, salt: str = "") -> float:
    h = hashlib.sha256((salt + text).encode("utf-8")).digest()[:8]
    return int.from_bytes(h, "little") / 2**64


def is_calibration(title: str, share: float = CALIBRATION_SHARE) -> bool:
    """Split by document, by a hash of its id: stable, disjoint, independent of order."""
    return _hash01(title) < share


def load_articles(path: "os.PathLike[str] | str") -> Dict[str, str]:
    """title -> text. The wiki package's JSON (title -> {extract, ...}); any other UTF-8
    file is one article per blank-line-separated paragraph, titled by its position."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidParameterError(f"cannot read text {str(p)!r}: {e}") from None
    if p.suffix == ".json":
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise InvalidParameterError(f"{str(p)!r} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise InvalidParameterError(f"{str(p)!r} must hold a JSON object title -> article")
        return {str(t): _article(p, str(t), v) for t, v in data.items()}
    parts = [q.strip() for q in raw.split("\n\n") if q.strip()]
    return {f"paragraph-{i:06d}": q for i, q in enumerate(parts)}


def _article(p: Path, title: str, v: object) -> str:
    """The text of one article of a wiki-style JSON: a string, or an object whose ``extract``
    is one; InvalidParameterError naming the file and the article otherwise."""
    text = v.get("extract") if isinstance(v, dict) else v
    if not isinstance(text, str):
        what = ("has no 'extract'" if isinstance(v, dict) and "extract" not in v
                else f"has no text (got {type(text).__name__})")
        raise InvalidParameterError(f"{str(p)!r}: article {title[:80]!r} {what}; each article must be "
                                    "a string or an object with a string 'extract'")
    return text


def check_share(share: float) -> float:
    """``share`` as a float in [0, 1]; InvalidParameterError otherwise (NaN included)."""
    try:
        ok = 0.0 <= float(share) <= 1.0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidParameterError(f"the calibration share must be a number in [0, 1], got {share!r}")
    return float(share)


def check_length(length: int, bos: bool = True) -> int:
    """``length`` as an int, long enough for a window to hold a token besides BOS (``bos``:
    the tokenizer has one); InvalidParameterError otherwise."""
    least = 2 if bos else 1
    if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < least:
        raise InvalidParameterError(f"a window must be an integer of at least {least} tokens (one "
                                    f"besides BOS), got {length!r}")
    return int(length)


def split(articles: Dict[str, str], share: float = CALIBRATION_SHARE) -> Tuple[List[str], List[str]]:
    """(calibration texts, evaluation texts), in title order, disjoint by construction."""
    calib, evalu = split_ids(articles, share)
    return [articles[t] for t in calib], [articles[t] for t in evalu]


def split_ids(articles: Dict[str, str], share: float = CALIBRATION_SHARE,
              order: str = "title") -> Tuple[List[str], List[str]]:
    """(calibration ids, evaluation ids) of a ``{id: text}``, each in ``order`` (``title``:
    sorted; ``hash``: by a hash of the id, independent of the split's)."""
    share = check_share(share)
    ids = sorted(articles)
    if order == "hash":
        ids.sort(key=lambda t: _hash01(t, "order:"))
    calib, evalu = [], []
    for t in ids:
        (calib if is_calibration(t, share) else evalu).append(t)
    return calib, evalu


def windows_of(ids: Sequence[int], length: int, count: int, bos: "int | None") -> List[List[int]]:
    """`count` consecutive, non-overlapping windows of `length` tokens from a token stream,
    each starting with `bos` when the tokenizer has one (it does not add it itself).
    InvalidParameterError unless a window holds a token besides BOS."""
    length = check_length(length, bos is not None)
    body = length - (1 if bos is not None else 0)
    out = []
    for i in range(count):
        chunk = list(ids[i * body:(i + 1) * body])
        if len(chunk) < body:
            break
        out.append(([bos] if bos is not None else []) + chunk)
    return out



@dataclass
class Part:
    """One side of a split corpus: ``(document id, text)`` in the order windows read them, and
    whether windows stay inside one document (:data:`COHERENT`)."""

    docs: List[Tuple[str, str]]
    coherent: bool = False


@dataclass
class Windows:
    """Token windows and, for each, the ids of the documents its tokens came from."""

    ids: List[List[int]] = field(default_factory=list)
    docs: List[Tuple[str, ...]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def all_docs(self) -> set:
        return {d for ds in self.docs for d in ds}
