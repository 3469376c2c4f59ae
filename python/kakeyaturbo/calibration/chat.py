"""The ``chat`` domain: what an instruct model serves, made from the stored domains with the
model's own chat template (``tok.apply_chat_template``).

A conversation is either :data:`WIKI_TURNS` English Wikipedia articles, each answering a user's
question about its title, or one documentation page (its first :data:`PROSE_CHARS` characters,
cut at a paragraph) answering a question about the page's title. Conversations are made inside
each side of the split of their sources (calibration articles and pages make calibration
conversations), so the chat domain's split is disjoint wherever theirs are; the two kinds
alternate while both last. The questions' wording is picked by a hash of the document id.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Dict, List, Sequence, Tuple

from . import sources
from .split import CALIBRATION_SHARE, Part, split_ids
from .sources import CorpusUnavailableError

WIKI_TURNS = 3
PROSE_CHARS = 4000

WIKI_QUESTIONS = (
    "Tell me about {t}.",
    "What is {t}?",
    "Can you give me a short summary of {t}?",
    "I'd like to learn about {t}. What should I know?",
    "Please explain {t} briefly.",
)
PROSE_QUESTIONS = (
    "Can you explain \"{t}\" from the Python documentation?",
    "How does this part of Python work: {t}?",
    "Please walk me through the Python docs on {t}.",
    "I'm reading about {t} in Python. Can you summarise it for me?",
)


def _pick(options: Sequence[str], doc_id: str) -> str:
    h = int.from_bytes(hashlib.sha256(("question:" + doc_id).encode("utf-8")).digest()[:4], "little")
    return options[h % len(options)]


def has_template(tok: Any) -> bool:
    return bool(getattr(tok, "chat_template", None))


def render(tok: Any, turns: Sequence[Tuple[str, str]]) -> str:
    """One conversation, ``(user, assistant)`` turns, as the model's chat template writes it.
    Raises :class:`CorpusUnavailableError` for a tokenizer without a chat template."""
    if tok is None or not has_template(tok):
        raise CorpusUnavailableError("the 'chat' domain needs the model's chat template; this "
                                     "tokenizer has none")
    messages: List[Dict[str, str]] = []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return str(tok.apply_chat_template(messages, tokenize=False))


def clip(text: str, chars: int = PROSE_CHARS) -> str:
    """The first paragraphs of ``text`` up to ``chars`` characters (at least the first one)."""
    out: List[str] = []
    n = 0
    for para in text.split("\n\n"):
        if out and n + len(para) > chars:
            break
        out.append(para)
        n += len(para) + 2
    return "\n\n".join(out)


def prose_title(title: str) -> str:
    """A page title without its section number (``9. Classes`` -> ``Classes``)."""
    return re.sub(r"^[0-9.]+\s+", "", title).strip() or title


def conversations(wiki: Sequence[Tuple[str, str]], prose: Sequence[Tuple[str, str, str]]
                  ) -> List[Tuple[str, List[Tuple[str, str]]]]:
    """``(id, turns)`` of the conversations made of ``wiki`` ``(title, text)`` articles, in
    order, :data:`WIKI_TURNS` at a time, alternating with one per ``prose`` ``(page, title,
    text)``. The id joins the source ids (``chat:wiki-en:A|wiki-en:B|wiki-en:C``)."""
    wconv = []
    for i in range(0, len(wiki) - WIKI_TURNS + 1, WIKI_TURNS):
        group = wiki[i:i + WIKI_TURNS]
        turns = [(_pick(WIKI_QUESTIONS, t).format(t=t), text) for t, text in group]
        wconv.append(("chat:" + "|".join("wiki-en:" + t for t, _ in group), turns))
    pconv = [("chat:prose:" + page,
              [(_pick(PROSE_QUESTIONS, page).format(t=prose_title(title)), clip(text))])
             for page, title, text in prose]
    out = []
    for i in range(max(len(wconv), len(pconv))):
        out += wconv[i:i + 1] + pconv[i:i + 1]
    return out


def _sources() -> Tuple[Dict[str, str], Dict[str, Tuple[str, str]]]:
    wiki = sources.documents("wiki-en")
    try:
        titles, texts = sources.prose_titles(), sources.prose_documents()
        prose = {p: (titles[p], texts[p]) for p in texts}
    except CorpusUnavailableError:
        prose = {}
    return wiki, prose


def version() -> str:
    """What the chat domain is made of on this machine (its sources' versions)."""
    wiki, prose = _sources()
    v = f"wiki-en {sources.version('wiki-en')}; {WIKI_TURNS} turns; {PROSE_CHARS} chars"
    return v + (f"; prose {sources.version('prose')}" if prose else "; no prose")


def chat_parts(tok: Any, share: float = CALIBRATION_SHARE) -> Tuple[Part, Part]:
    """``(calibration part, evaluation part)`` of the chat domain for a tokenizer: each side's
    conversations rendered with its chat template (:func:`render`). The documentation pages
    join when the ``prose`` domain is available (:func:`version` says which)."""
    if tok is None or not has_template(tok):
        raise CorpusUnavailableError("the 'chat' domain needs the model's chat template; this "
                                     "tokenizer has none")
    wiki, prose = _sources()
    w_cal, w_ev = split_ids(wiki, share)
    p_cal, p_ev = split_ids({p: t for p, (_, t) in prose.items()}, share, "hash")
    out = []
    for w_ids, p_ids in ((w_cal, p_cal), (w_ev, p_ev)):
        convs = conversations([(t, wiki[t]) for t in w_ids],
                              [(p, prose[p][0], prose[p][1]) for p in p_ids])
        out.append(Part([(cid, render(tok, turns)) for cid, turns in convs]))
    return out[0], out[1]
