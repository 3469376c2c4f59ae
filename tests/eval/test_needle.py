"""Needle retrieval: the prompt (exact length, the needle at the requested depth, the question at
the end), the answer's parsing, and a run on a tiny random-weight model through the compressed
cache (uncompressed reference, a baseline, a calibrated recipe)."""

from __future__ import annotations

import numpy as np
import pytest

from kakeyaturbo.errors import InvalidParameterError
from kakeyaturbo.eval import needle


def _haystack(tok, paragraphs: int = 60, words: int = 20):
    g = np.random.default_rng(0)
    return [tok.encode(" ".join(f"w{int(x)}" for x in g.integers(0, 500, words)) + "\n\n")
            for _ in range(paragraphs)]


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.3, 0.5, 0.77, 0.9, 1.0])
def test_prompt_has_the_needle_at_its_depth(word_tok, depth) -> None:
    hay = _haystack(word_tok)
    p = needle.build_prompt(word_tok, hay, 400, depth, key="copper kettle", number="4711042")
    assert len(p.ids) == 400 and p.ids[0] == word_tok.bos_token_id
    sentence = word_tok.encode(needle.NEEDLE.format(key="copper kettle", number="4711042"))
    assert p.ids[p.needle_at:p.needle_at + len(sentence)] == sentence
    assert word_tok.decode(p.ids).count("4711042") == 1
    question = word_tok.encode(needle.QUESTION.format(key="copper kettle"))
    assert p.ids[-len(question):] == question
    # Haystack tokens before the needle: a paragraph start, the one nearest the depth.
    room = 400 - 1 - len(sentence) - len(question)
    before = p.needle_at - 1
    assert p.actual_depth == pytest.approx(before / room)
    starts = np.cumsum([0] + [len(x) for x in hay])
    assert before in starts or before == room
    assert abs(before - depth * room) <= len(hay[0]) / 2 + 1e-9
    # The haystack around it is the paragraphs in order, unchanged.
    body = p.ids[1:p.needle_at] + p.ids[p.needle_at + len(sentence):len(p.ids) - len(question)]
    assert body == [t for x in hay for t in x][:room]


def test_prompt_errors_are_typed(word_tok) -> None:
    hay = _haystack(word_tok, paragraphs=3)
    with pytest.raises(InvalidParameterError, match="depth"):
        needle.build_prompt(word_tok, hay, 40, 1.5, key="k", number="1")
    with pytest.raises(InvalidParameterError, match="haystack holds"):
        needle.build_prompt(word_tok, hay, 400, 0.5, key="k", number="1")
    with pytest.raises(InvalidParameterError, match="no room"):
        needle.build_prompt(word_tok, hay, 10, 0.5, key="k", number="1")


@pytest.mark.parametrize("answer, number, hit", [
    (" 4711042.", "4711042", True),
    ("4711042 is the number", "4711042", True),
    (" the number is 4711042\n", "4711042", True),
    (" 47110420", "4711042", False),  # a longer number is not the needle
    (" 471104", "4711042", False),
    (" 12 and then 4711042", "4711042", False),  # the first number counts
    (" no number here", "4711042", False),
])
def test_answer_parsing(answer, number, hit) -> None:
    assert needle.retrieved(answer, number) is hit
    assert needle.answer_number(" no number") is None
    assert needle.answer_number("x 0042 y") == "0042"


def test_prompts_are_seeded_per_cell(word_tok, monkeypatch) -> None:
    hay = _haystack(word_tok, paragraphs=200)
    monkeypatch.setattr(needle, "haystacks", lambda tok, text=None, trials=1: [hay] * trials)
    a = needle.prompts(word_tok, [300, 600], [0.2, 0.8], trials=2)
    b = needle.prompts(word_tok, [600], [0.8], trials=2)
    assert len(a) == 8 and len(b) == 2
    assert [(p.number, p.key, p.ids) for p in a if p.length == 600 and p.depth == 0.8] == \
        [(p.number, p.key, p.ids) for p in b]
    assert len({p.number for p in a}) == 8
    assert all(len(p.number) == needle.DIGITS and p.key in needle.KEYS for p in a)


def test_haystacks_are_the_evaluation_split(word_tok, prose_corpus) -> None:
    from kakeyaturbo.calibration import corpus

    stacks = needle.haystacks(word_tok, "prose", trials=2)
    cal, ev = corpus.parts("prose", word_tok)
    first_ev = word_tok.encode(ev.docs[0][1].split("\n\n")[0] + "\n\n")
    assert stacks[0][0] == first_ev
    assert stacks[0][0] != word_tok.encode(cal.docs[0][1].split("\n\n")[0] + "\n\n")
    assert stacks[1][0] == word_tok.encode(ev.docs[needle.STRIDE][1].split("\n\n")[0] + "\n\n")
    assert sum(len(p) for p in stacks[0]) > max(needle.LENGTHS)


def test_needle_run_on_a_tiny_model_through_the_compressed_cache(tiny_model_dir) -> None:
    torch = pytest.importorskip("torch")
    from kakeyaturbo import calibration, recipes
    from kakeyaturbo.eval import harness
    from kakeyaturbo.eval import model as model_mod

    model, tok = model_mod.load(tiny_model_dir)
    text = str(tiny_model_dir / "text.txt")
    wins = calibration.calibration_windows(tok, text, 3, 64)
    stats = calibration.collect(model, wins, n_sink=1, samples=64)
    sens = calibration.collect_sensitivity(model, wins, n_sink=1, score=16)
    rec = recipes.load("calibrated-4bit")
    layers = model.config.num_hidden_layers
    zero = harness.Method("zeroed", lambda s, x: (np.zeros_like(x), 0))
    methods = harness.baseline_methods(["identity", "turboquant3+sink"]) + [
        harness.codec_method(rec, layers, stats=stats, sensitivity=sens), zero]
    stacks = needle.haystacks(tok, text, trials=1)
    plist = [needle.build_prompt(tok, stacks[0], 200, d, key="hollow oak", number=str(n))
             for d, n in ((0.2, 1234567), (0.8, 7654321))]
    seen = []
    pre = tiny_model_dir.parent / "needle-prefill"
    recs = needle.run(model, tok, plist, methods, steps=6, on_prompt=seen.append,
                      prefill_dir=pre)
    assert len(recs) == 2 and seen == recs
    for r in recs:
        m = r["methods"]
        assert set(m) == {"reference", "identity", "turboquant3+sink", "kakeyaturbo:calibrated-4bit",
                          "zeroed"}
        # The identity goes through the same prefix path and changes nothing.
        assert m["identity"]["answer"] == m["reference"]["answer"]
        for v in m.values():
            assert v["retrieved"] == needle.retrieved(v["answer"], r["number"])
        assert m["turboquant3+sink"]["bits_per_element"] < 16
        assert 3.0 < m["kakeyaturbo:calibrated-4bit"]["bits_per_element"] < 8.0
        assert m["zeroed"]["bits_per_element"] == 0.0
        assert r["seconds"]["total"] > 0 and set(r["seconds"]) >= {"prefill", "reference"}
    # The answers are read from the compressed cache: a zeroed cache answers otherwise.
    assert any(r["methods"]["zeroed"]["answer"] != r["methods"]["reference"]["answer"]
               for r in recs)
    # Resuming: a finished record is kept and nothing runs again (the method would fail).
    boom = harness.Method("zeroed", lambda s, x: (_ for _ in ()).throw(AssertionError("ran")))
    done = {(r["length"], r["depth"], r["trial"]): r for r in recs}
    again = needle.run(model, tok, plist, [boom], done=done, on_prompt=seen.append)
    assert [a["methods"] for a in again] == [r["methods"] for r in recs] and len(seen) == 2
    # A method added later reads the kept prefills: no prompt is run through the model again.
    assert len(list(pre.glob("200-*.pt"))) == 2

    class DecodeOnly:
        def __init__(self, m):
            self.m, self.forward = m, m.forward

        def __call__(self, input_ids, **kw):
            assert input_ids.shape[1] == 1, "prefilled again"
            return self.m(input_ids=input_ids, **kw)

    fp8 = harness.baseline_methods(["fp8_e4m3"])
    more = needle.run(DecodeOnly(model), tok, plist, fp8, steps=6, done=done, prefill_dir=pre)
    for a, r in zip(more, recs):
        assert set(a["methods"]) == set(r["methods"]) | {"fp8_e4m3"}
        assert a["methods"]["reference"] == r["methods"]["reference"]
    with pytest.raises(AssertionError, match="prefilled again"):
        needle.run(DecodeOnly(model), tok, plist, fp8, steps=6)
    merged = needle.merge(recs, more)
    assert [set(m["methods"]) for m in merged] == [set(a["methods"]) for a in more]
    other = [dict(r, number="1") for r in recs]
    with pytest.raises(InvalidParameterError, match="other needles"):
        needle.merge(recs, other)
    s = needle.summary(recs)
    assert s["identity"]["differs_from_reference"] == 0 and s["identity"]["prompts"] == 2
    assert s["zeroed"]["retrieved"] == np.mean([r["methods"]["zeroed"]["retrieved"] for r in recs])
    table = needle.markdown(recs, "tiny")
    assert "| reference | 16.00 |" in table and "200 @ 0.2" in table
    del torch
