"""Text for calibration and evaluation: a corpus split by document into a calibration part and an
evaluation part (disjoint by construction, stable, independent of order), and token windows cut
from either part, each with the documents it came from.

A corpus is named by a *spec* (what ``--text``, ``--calibration-text`` and a recipe's
``[calibration] corpus`` take):

- a domain of :data:`DOMAINS`: ``wiki-en``, ``wiki-fr``, ``wiki-es``, ``code``, ``prose``
  (:mod:`.sources`) or ``chat`` (:mod:`.chat`, made with the model's chat template);
- ``mixture`` (the shipped multi-domain calibration mixture) or ``mixture:DOMAIN=W,...``
  (:mod:`.mixture`; calibration only);
- a path: the wiki package's JSON (``title -> {extract, ...}``) or any UTF-8 text file (one
  document per blank-line-separated paragraph).

Every source is split by a hash of its document ids (titles, file paths, page paths), so a
document is either calibration or evaluation text, never both, whatever else is chosen.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import InvalidParameterError

#: Share of documents that go to calibration; the rest is evaluation text.
CALIBRATION_SHARE = 0.25

#: The named domains.
DOMAINS = ("wiki-en", "wiki-fr", "wiki-es", "code", "prose", "chat")

#: Domains of long documents: their windows are cut inside one document (a file, a page), at
#: most :data:`PER_DOCUMENT` from each, so that a long context is one coherent text. Their
#: documents are taken in the order of a hash of their paths (paths group by package or
#: section; the hash samples across them). Other texts run documents together in title order.
COHERENT = ("code", "prose")
PER_DOCUMENT = 2

MIXTURE = "mixture"


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
        except ValueError as e:
            raise InvalidParameterError(f"{str(p)!r} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise InvalidParameterError(f"{str(p)!r} must hold a JSON object title -> article")
        return {str(t): (v["extract"] if isinstance(v, dict) else str(v)) for t, v in data.items()}
    parts = [q.strip() for q in raw.split("\n\n") if q.strip()]
    return {f"paragraph-{i:06d}": q for i, q in enumerate(parts)}


def split(articles: Dict[str, str], share: float = CALIBRATION_SHARE) -> Tuple[List[str], List[str]]:
    """(calibration texts, evaluation texts), in title order, disjoint by construction."""
    calib, evalu = split_ids(articles, share)
    return [articles[t] for t in calib], [articles[t] for t in evalu]


def split_ids(articles: Dict[str, str], share: float = CALIBRATION_SHARE,
              order: str = "title") -> Tuple[List[str], List[str]]:
    """(calibration ids, evaluation ids) of a ``{id: text}``, each in ``order`` (``title``:
    sorted; ``hash``: by a hash of the id, independent of the split's)."""
    ids = sorted(articles)
    if order == "hash":
        ids.sort(key=lambda t: _hash01(t, "order:"))
    calib, evalu = [], []
    for t in ids:
        (calib if is_calibration(t, share) else evalu).append(t)
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


# --------------------------------------------------------------------------------------------
# Corpora


def is_mixture(spec: str) -> bool:
    return isinstance(spec, str) and (spec == MIXTURE or spec.startswith(MIXTURE + ":"))


def check_spec(spec: "os.PathLike[str] | str", *, allow_mixture: bool = True) -> str:
    """The spec as a string, checked: a domain, a mixture (where allowed) or an existing file.
    Raises InvalidParameterError naming what it accepts."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise InvalidParameterError(f"a text must be a domain, a mixture or a path, got {spec!r}")
    if spec in DOMAINS:
        return spec
    if is_mixture(spec):
        if not allow_mixture:
            raise InvalidParameterError(f"{spec!r}: a mixture is calibration text only; evaluate "
                                        f"on one of {', '.join(DOMAINS)} or a file")
        from .mixture import parse

        parse(spec)
        return spec
    if not Path(spec).expanduser().is_file():
        raise InvalidParameterError(
            f"text {spec!r} is neither a domain ({', '.join(DOMAINS)}), a mixture ('mixture', "
            f"'mixture:DOMAIN=WEIGHT,...') nor a file")
    return str(Path(spec).expanduser())


def describe(spec: str) -> str:
    """A short name of a corpus for tables and file names (a file's stem)."""
    spec = str(spec)
    if spec in DOMAINS or is_mixture(spec):
        return spec
    return Path(spec).stem


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


def _stored_docs(domain: str) -> Dict[str, str]:
    from . import sources

    return sources.documents(domain)


def parts(spec: str, tok: Any = None, share: float = CALIBRATION_SHARE) -> Tuple[Part, Part]:
    """``(calibration part, evaluation part)`` of a domain or file (not a mixture). ``tok``
    (a tokenizer with a chat template) is needed for ``chat``. Document ids are namespaced by
    domain (``code:asyncio/base_events.py``); a file's are its titles or paragraph numbers."""
    spec = check_spec(spec, allow_mixture=False)
    if spec == "chat":
        from .chat import chat_parts

        return chat_parts(tok, share)
    if spec in DOMAINS:
        docs = _stored_docs(spec)
        coherent = spec in COHERENT
        cal, ev = split_ids(docs, share, "hash" if coherent else "title")
        ns = spec + ":"
        return (Part([(ns + i, docs[i]) for i in cal], coherent),
                Part([(ns + i, docs[i]) for i in ev], coherent))
    docs = load_articles(spec)
    cal, ev = split_ids(docs, share)
    return Part([(i, docs[i]) for i in cal]), Part([(i, docs[i]) for i in ev])


def part_windows(tok: Any, part: Part, count: int, length: int,
                 per_document: int = PER_DOCUMENT) -> Windows:
    """Up to ``count`` windows of ``length`` tokens (each starting with BOS when the tokenizer
    has one) from a part: documents run together with a blank line between them, or, for a
    coherent part, at most ``per_document`` consecutive windows from the start of every document
    at least one window long."""
    bos = tok.bos_token_id
    out = Windows()
    if count <= 0:
        return out
    if part.coherent:
        for doc_id, text in part.docs:
            ids = tok.encode(text, add_special_tokens=False)
            for w in windows_of(ids, length, min(per_document, count - len(out)), bos):
                out.ids.append(w)
                out.docs.append((doc_id,))
            if len(out) >= count:
                break
        return out
    ids: List[int] = []
    starts: List[int] = []
    names: List[str] = []
    body = length - (1 if bos is not None else 0)
    for doc_id, text in part.docs:
        starts.append(len(ids))
        names.append(doc_id)
        ids.extend(tok.encode(text + "\n\n", add_special_tokens=False))
        if len(ids) >= count * body:
            break
    for i, w in enumerate(windows_of(ids, length, count, bos)):
        lo, hi = i * body, (i + 1) * body
        # documents whose tokens [starts[j], starts[j + 1]) meet the window's [lo, hi)
        j = max(bisect.bisect_right(starts, lo) - 1, 0)
        took = []
        while j < len(starts) and starts[j] < hi:
            took.append(names[j])
            j += 1
        out.ids.append(w)
        out.docs.append(tuple(took))
    return out


def corpus_windows(tok: Any, spec: "os.PathLike[str] | str", count: int, length: int, *,
                   side: str = "evaluation") -> Windows:
    """Up to ``count`` windows of ``length`` tokens from the ``side`` (``calibration`` or
    ``evaluation``) of a corpus; a mixture's calibration side apportions the windows over its
    domains (:func:`kakeyaturbo.calibration.mixture.windows`)."""
    if side not in ("calibration", "evaluation"):
        raise InvalidParameterError(f"side must be 'calibration' or 'evaluation', got {side!r}")
    spec = check_spec(spec, allow_mixture=side == "calibration")
    if is_mixture(spec):
        from .mixture import windows as mixture_windows

        out = Windows()
        for _, w in mixture_windows(tok, spec, count, length):
            out.ids += w.ids
            out.docs += w.docs
        return out
    cal, ev = parts(spec, tok)
    return part_windows(tok, cal if side == "calibration" else ev, count, length)


def calibration_windows(tok: Any, text_path: "os.PathLike[str] | str", windows: int,
                        window: int) -> List[List[int]]:
    """``windows`` token windows of ``window`` tokens from the **calibration** split of a corpus
    (a domain, a mixture or a file; split by document, disjoint from the evaluation split).
    Raises InvalidParameterError when it holds no full window."""
    wins = corpus_windows(tok, text_path, windows, window, side="calibration")
    if not wins.ids:
        raise InvalidParameterError(
            f"the calibration split of {describe(str(text_path))!r} holds no full window of "
            f"{window} tokens")
    return wins.ids


def evaluation_windows(tok: Any, text: "os.PathLike[str] | str", count: int,
                       length: int) -> List[List[int]]:
    """Up to ``count`` windows of ``length`` tokens from the **evaluation** split of a domain or
    file (see :func:`part_windows`)."""
    return corpus_windows(tok, text, count, length, side="evaluation").ids


def key(spec: str) -> str:
    """The part of a calibration cache key that names a corpus: a file's stem (as before
    domains existed), ``summaries_en-us`` for ``wiki-en`` (the same text as the default file),
    a domain with what identifies its text on this machine, a mixture with a hash of its
    composition."""
    spec = str(spec)
    if is_mixture(spec):
        from .mixture import key as mixture_key

        return mixture_key(spec)
    if spec in DOMAINS:
        from . import sources

        if spec == "wiki-en":
            return Path(sources.WIKI[spec]).stem
        if spec == "chat":
            from .chat import version as chat_version

            v = chat_version()
        else:
            v = sources.version(spec)
        return f"{spec}-{hashlib.sha256(v.encode()).hexdigest()[:8]}"
    return Path(spec).stem


def meta(spec: str) -> Dict[str, Any]:
    """What a statistics file records about its text."""
    spec = str(spec)
    return {"text": describe(spec), "split": "calibration", "corpus_key": key(spec)}


def optional(spec: "os.PathLike[str] | str | None") -> Optional[str]:
    """``None`` stays None; anything else is checked (:func:`check_spec`)."""
    return None if spec is None else check_spec(spec)
