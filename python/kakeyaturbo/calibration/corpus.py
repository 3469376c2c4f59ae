"""Text for calibration and evaluation: a corpus named by a spec (:mod:`kakeyaturbo.texts`:
a domain, a mixture or a file), split by document (:mod:`.split`) into a calibration part and
an evaluation part, and token windows cut from either part, each with the documents it came
from.

A mixture's calibration side apportions its windows over its domains by their weights (largest
remainders, ties to the domain listed first); a domain that is not on this machine (``prose``
without Debian's documentation, ``chat`` for a tokenizer without a chat template) is left out
with a warning. Every source is split by a hash of its document ids (titles, file paths, page
paths), so a document is either calibration or evaluation text, never both, whatever else is
chosen.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import numbers
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._files import sha256_of
from ..errors import InvalidParameterError, KakeyaError
from ..texts import DOMAINS, MIXTURE, check_spec, describe, is_mixture, parse
from . import chat, sources
from .split import (CALIBRATION_SHARE, COHERENT, PER_DOCUMENT, Part, Windows, check_length, check_share,
                    is_calibration, load_articles, split, split_ids, windows_of)
from .sources import CorpusUnavailableError

__all__ = ["CALIBRATION_SHARE", "COHERENT", "DOMAINS", "MIXTURE", "PER_DOCUMENT", "Part", "Windows",
           "apportion", "calibration_windows", "check_spec", "composition", "corpus_windows",
           "describe", "evaluation_windows", "is_calibration", "is_mixture", "key", "load_articles",
           "meta", "mixture_windows", "optional", "part_windows", "parts", "split", "split_ids",
           "usable", "windows_of"]


def _stored_docs(domain: str) -> Dict[str, str]:
    return sources.documents(domain)


def parts(spec: str, tok: Any = None, share: float = CALIBRATION_SHARE) -> Tuple[Part, Part]:
    """``(calibration part, evaluation part)`` of a domain or file (not a mixture). ``tok``
    (a tokenizer with a chat template) is needed for ``chat``. Document ids are namespaced by
    domain (``code:asyncio/base_events.py``); a file's are its titles or paragraph numbers."""
    spec = check_spec(spec, allow_mixture=False)
    share = check_share(share)
    if spec == "chat":
        return chat.chat_parts(tok, share)
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
    domains (:func:`mixture_windows`)."""
    if side not in ("calibration", "evaluation"):
        raise InvalidParameterError(f"side must be 'calibration' or 'evaluation', got {side!r}")
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
        raise InvalidParameterError(f"the number of windows must be an integer >= 0, got {count!r}")
    check_length(length, getattr(tok, "bos_token_id", None) is not None)
    spec = check_spec(spec, allow_mixture=side == "calibration")
    if is_mixture(spec):
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
    Raises InvalidParameterError when it holds no full window (or ``windows < 1``, or a window
    too short to hold a token besides BOS)."""
    if isinstance(windows, bool) or not isinstance(windows, numbers.Integral) or windows < 1:
        raise InvalidParameterError(f"calibration needs an integer >= 1 of windows, got {windows!r}")
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
    """The part of a calibration cache key that names a corpus: a file's stem and a hash of its
    content (two texts of one name are not one corpus; the shipped Wikipedia files keep their
    stem, as before domains existed), ``summaries_en-us`` for ``wiki-en`` (the same text as the
    default file), a domain with what identifies its text on this machine, a mixture with a hash
    of its composition."""
    spec = str(spec)
    if is_mixture(spec):
        return mixture_key(spec)
    if spec in DOMAINS:
        if spec == "wiki-en":
            return Path(sources.WIKI[spec]).stem
        if spec == "chat":
            v = chat.version()
        else:
            v = sources.version(spec)
        return f"{spec}-{hashlib.sha256(v.encode()).hexdigest()[:8]}"
    p = Path(spec)
    if not p.is_file() or _shipped(p):
        return p.stem
    return f"{p.stem}-{_content_hash(p)}"


def _shipped(p: Path) -> bool:
    """Whether ``p`` is one of the installed Wikipedia files (the default text): their cache
    entries keep the names they always had."""
    for d in sources.WIKI:
        try:
            if sources.wiki_path(d).resolve() == p.resolve():
                return True
        except (KakeyaError, OSError, CorpusUnavailableError):  # not installed: not that file
            continue
    return False


def _content_hash(p: Path) -> str:
    """The first 8 hex digits of the SHA-256 of a file's bytes (read once a run:
    :func:`~kakeyaturbo._files.sha256_of`)."""
    try:
        return sha256_of(p)[:8]
    except OSError as e:
        raise InvalidParameterError(f"cannot read text {str(p)!r}: {e.strerror or e}") from None


def meta(spec: str) -> Dict[str, Any]:
    """What a statistics file records about its text."""
    spec = str(spec)
    return {"text": describe(spec), "split": "calibration", "corpus_key": key(spec)}


def optional(spec: "os.PathLike[str] | str | None") -> Optional[str]:
    """``None`` stays None; anything else is checked (:func:`check_spec`)."""
    return None if spec is None else check_spec(spec)


# --------------------------------------------------------------------------------------------
# Mixtures


#: The most windows :func:`apportion` shares out: float64 holds every count up to it exactly.
MAX_WINDOWS = 2 ** 53


def apportion(weights: Sequence[Tuple[str, float]], n: int) -> List[Tuple[str, int]]:
    """``n`` windows over the domains in proportion to their weights (largest remainders; ties
    to the domain listed first); domains given no window are left out. ``n`` up to
    :data:`MAX_WINDOWS`."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n <= MAX_WINDOWS:
        raise InvalidParameterError(f"need an integer n in 0..2**53 of windows, got {n!r}")
    bad = [(d, w) for d, w in weights
           if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w < 0]
    top = max((w for _, w in weights), default=0) if not bad else 0
    if bad or top <= 0:
        raise InvalidParameterError(f"mixture weights must be finite numbers >= 0, not all 0; got "
                                    f"{[(d, w) for d, w in weights]!r}")
    # Weights near float64's limit would sum (and n * w grow) to inf: scaled first by the power
    # of two that brings the largest below 1, which is exact, so ordinary weights apportion
    # exactly as they would unscaled.
    shift = -math.frexp(top)[1]
    scaled = [math.ldexp(w, shift) for _, w in weights]
    total = sum(scaled)
    exact = [n * w / total for w in scaled]
    counts = [int(x + 1e-9) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:n - sum(counts)]:
        counts[i] += 1
    return [(d, c) for (d, _), c in zip(weights, counts) if c > 0]


def usable(spec: str, tok: Any = None) -> List[Tuple[str, float]]:
    """The mixture's ``(domain, weight)`` that this machine and tokenizer can make, warning
    (``UserWarning``) about each one left out; InvalidParameterError when none is left."""
    out = []
    for d, w in parse(spec):
        try:
            if d == "chat":
                if not chat.has_template(tok):
                    raise CorpusUnavailableError("the tokenizer has no chat template")
                sources.documents("wiki-en")
            elif d in sources.STORED:
                sources.documents(d)
        except CorpusUnavailableError as e:
            warnings.warn(f"calibration mixture without {d}: {e}", UserWarning, stacklevel=2)
            continue
        out.append((d, w))
    if not out:
        raise InvalidParameterError(f"no domain of mixture {spec!r} is available here")
    return out


def composition(spec: str, n: int, tok: Any = None) -> List[Tuple[str, int]]:
    """``[(corpus, windows)]``: a mixture's ``n`` windows apportioned over its usable domains;
    any other corpus alone with all ``n``."""
    spec = check_spec(spec)
    if not is_mixture(spec):
        return [(spec, n)]
    return apportion(usable(spec, tok), n)


def mixture_windows(tok: Any, spec: str, n: int, length: int) -> List[Tuple[str, Windows]]:
    """``[(domain, windows)]``: each domain's share of ``n`` windows of ``length`` tokens from
    its calibration part."""
    out = []
    for d, c in composition(spec, n, tok):
        cal, _ = parts(d, tok)
        out.append((d, part_windows(tok, cal, c, length)))
    return out


def mixture_key(spec: str) -> str:
    """A name for a mixture's pooled statistics: ``mixture-<hash>`` of its composition."""
    comp = ",".join(f"{d}={w:g}" for d, w in parse(spec))
    return "mixture-" + hashlib.sha256(comp.encode()).hexdigest()[:8]
