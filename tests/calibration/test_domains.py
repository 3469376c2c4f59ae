"""The text domains and the calibration mixture: every domain's split is disjoint down to the
windows (no evaluation document in any calibration window, the chat domain's sources included,
and the mixture's), the mixture apportions its windows by weight, and a domain this machine
lacks is left out with a warning. A word-level stand-in tokenizer keeps this to seconds."""

from __future__ import annotations

import warnings
from typing import Dict, Set

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kakeyaturbo import texts
from kakeyaturbo.calibration import corpus, sources
from kakeyaturbo.calibration.sources import CorpusUnavailableError
from kakeyaturbo.errors import InvalidParameterError

LENGTH = 96


def _available(domain: str) -> bool:
    try:
        if domain != "chat":
            sources.documents(domain)
        return True
    except CorpusUnavailableError:
        return False


DOMAINS = [d for d in texts.DOMAINS if _available(d)]


def _sources_of(doc_id: str) -> Set[str]:
    """The stored documents a document id stands for: a chat conversation's sources (its id
    joins them), any other document itself."""
    if doc_id.startswith("chat:"):
        return set(doc_id[len("chat:"):].split("|"))
    return {doc_id}


def _evaluation_ids(tok) -> Dict[str, Set[str]]:
    return {d: {i for i, _ in corpus.parts(d, tok)[1].docs} for d in DOMAINS}


@pytest.mark.parametrize("domain", DOMAINS)
def test_each_domain_splits_by_document_down_to_the_windows(domain, word_tok) -> None:
    cal, ev = corpus.parts(domain, word_tok)
    cal_ids, ev_ids = {i for i, _ in cal.docs}, {i for i, _ in ev.docs}
    assert cal_ids and ev_ids and not cal_ids & ev_ids
    assert len(cal_ids) == len(cal.docs) and len(ev_ids) == len(ev.docs)
    # The split is stable: made again, the same documents on each side, in the same order.
    again = corpus.parts(domain, word_tok)
    assert [i for i, _ in again[0].docs] == [i for i, _ in cal.docs]
    cw = corpus.corpus_windows(word_tok, domain, 6, LENGTH, side="calibration")
    ew = corpus.corpus_windows(word_tok, domain, 6, LENGTH, side="evaluation")
    assert len(cw) == 6 and len(ew) == 6
    assert cw.all_docs() <= cal_ids and ew.all_docs() <= ev_ids
    # The documents a window names are those its tokens came from: its body is a run of the
    # named documents' tokens (as the windows join them), so the ids above are not a label.
    text = dict(cal.docs)
    for ids, docs in zip(cw.ids, cw.docs):
        assert ids[0] == word_tok.bos_token_id and len(ids) == LENGTH
        joined = []
        for d in docs:
            joined += word_tok.encode(text[d] + ("" if cal.coherent else "\n\n"))
        body = ids[1:]
        assert any(joined[i:i + len(body)] == body for i in range(len(joined) - len(body) + 1))
    if domain in corpus.COHERENT:  # long documents: a window inside one document
        assert all(len(d) == 1 for d in cw.docs)
        assert max(list(cw.docs).count(d) for d in cw.docs) <= corpus.PER_DOCUMENT


def test_chat_is_made_inside_each_side_of_its_sources_split(word_tok) -> None:
    cal, ev = corpus.parts("chat", word_tok)
    ev_src = _evaluation_ids(word_tok)
    src_ev = ev_src["wiki-en"] | ev_src.get("prose", set())
    cal_src = set().union(*(_sources_of(i) for i, _ in cal.docs))
    assert cal_src and not cal_src & src_ev
    assert any(s.startswith("wiki-en:") for s in cal_src)
    if "prose" in DOMAINS:
        assert any(s.startswith("prose:") for s in cal_src)
    # The conversations are the model's template applied to the sources' text.
    first_id, first_text = cal.docs[0]
    assert first_text.startswith("<|user|> ") and "<|assistant|> " in first_text
    # And the evaluation conversations are made of evaluation documents only.
    cal_of = {d: {i for i, _ in corpus.parts(d, word_tok)[0].docs} for d in DOMAINS if d != "chat"}
    ev_used = set().union(*(_sources_of(i) for i, _ in ev.docs))
    assert not ev_used & (cal_of["wiki-en"] | cal_of.get("prose", set()))


def test_no_evaluation_document_of_any_domain_in_the_mixture(word_tok, prose_corpus) -> None:
    wins = corpus.corpus_windows(word_tok, "mixture", 16, LENGTH, side="calibration")
    assert len(wins) == 16
    used = set().union(*(_sources_of(i) for i in wins.all_docs()))
    every_ev = set().union(*_evaluation_ids(word_tok).values())
    assert used and not used & every_ev
    # Windows per domain as apportioned (the first document of each window names its domain).
    got: Dict[str, int] = {}
    for docs in wins.docs:
        got[docs[0].split(":")[0]] = got.get(docs[0].split(":")[0], 0) + 1
    assert got == dict(corpus.composition("mixture", 16, word_tok))
    with pytest.raises(InvalidParameterError, match="calibration text only"):
        corpus.corpus_windows(word_tok, "mixture", 2, LENGTH, side="evaluation")


def test_apportion_by_largest_remainders() -> None:
    mix = list(texts.DEFAULT_MIXTURE)
    assert corpus.apportion(mix, 16) == [("wiki-en", 3), ("wiki-fr", 2), ("wiki-es", 2),
                                         ("code", 3), ("prose", 3), ("chat", 3)]
    # 8 windows: 1.5 / 1 / 1 / 1.5 / 1.5 / 1.5; the two spare windows go to the largest
    # remainders, ties to the domain listed first.
    assert corpus.apportion(mix, 8) == [("wiki-en", 2), ("wiki-fr", 1), ("wiki-es", 1),
                                        ("code", 2), ("prose", 1), ("chat", 1)]
    # Domains given no window are left out.
    assert corpus.apportion(mix, 2) == [("wiki-en", 1), ("code", 1)]
    assert corpus.apportion(mix, 0) == []
    assert corpus.apportion([("code", 1.0), ("chat", 3.0)], 5) == [("code", 1), ("chat", 4)]
    for n in (-1, 2 ** 53 + 1, 10 ** 400):  # the last overflowed float range (OverflowError)
        with pytest.raises(InvalidParameterError, match="windows"):
            corpus.apportion(mix, n)
    assert sum(c for _, c in corpus.apportion(mix, 2 ** 53)) == 2 ** 53


@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=6), st.integers(0, 200))
def test_apportion_sums_to_n_within_one_of_the_exact_share(weights, n) -> None:
    mix = [(f"d{i}", w) for i, w in enumerate(weights)]
    out = dict(corpus.apportion(mix, n))
    assert sum(out.values()) == n
    total = sum(weights)
    for name, w in mix:
        assert abs(out.get(name, 0) - n * w / total) < 1.0 + 1e-9


def test_composition_of_a_single_corpus_is_itself(word_tok) -> None:
    assert corpus.composition("code", 7, word_tok) == [("code", 7)]


def test_an_unavailable_domain_is_left_out_with_a_warning(word_tok, monkeypatch, prose_corpus) -> None:
    real = sources.documents

    def no_prose(domain):
        if domain == "prose":
            raise CorpusUnavailableError("no python3.11-doc here")
        return real(domain)

    monkeypatch.setattr(sources, "documents", no_prose)
    with pytest.warns(UserWarning, match="without prose: no python3.11-doc"):
        comp = corpus.composition("mixture", 16, word_tok)
    assert "prose" not in dict(comp) and sum(c for _, c in comp) == 16
    assert dict(comp) == dict(corpus.apportion(
        [(d, w) for d, w in texts.DEFAULT_MIXTURE if d != "prose"], 16))

    with pytest.warns(UserWarning), pytest.raises(InvalidParameterError, match="no domain"):
        corpus.composition("mixture:prose=1", 4, word_tok)
    monkeypatch.undo()

    class NoTemplate(type(word_tok)):
        chat_template = None

    with pytest.warns(UserWarning, match="without chat"):
        comp = corpus.composition("mixture", 16, NoTemplate())
    assert "chat" not in dict(comp) and sum(c for _, c in comp) == 16

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every domain there: no warning
        assert corpus.composition("mixture:code=1,wiki-fr=1", 4, word_tok) == [
            ("code", 2), ("wiki-fr", 2)]
