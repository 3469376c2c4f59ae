"""Nonsense or mismatched input to the calibration API is refused with a typed error before any
work: windows that are not token ids of the model, statistics pooled or bundled across models
or sides of RoPE, a wiki JSON without its text, helpers' arguments out of range."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import calibration  # noqa: E402
from kakeyaturbo.calibration import AttentionStats, Calibration, Sensitivity, corpus, split  # noqa: E402
from kakeyaturbo.calibration.latent import LATENT_POINT  # noqa: E402
from kakeyaturbo.calibration.mixture import pool_sensitivity, pool_stats  # noqa: E402
from kakeyaturbo.errors import InvalidParameterError, ModelMismatchError  # noqa: E402

VOCAB, T = 61, 24


def _llama(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def two():
    """Two tiny Llamas of one shape and other weights, windows, and the first's statistics."""
    m1, m2 = _llama(0), _llama(1)
    g = np.random.default_rng(0)
    wins = [list(g.integers(0, VOCAB, T)) for _ in range(2)]
    st = calibration.collect(m1, wins, samples=8)
    se = calibration.collect_sensitivity(m1, wins, score=8)
    return m1, m2, wins, st, se


def _without(st: AttentionStats, key: str) -> AttentionStats:
    return AttentionStats(meta={k: v for k, v in st.meta.items() if k != key},
                          **{k: getattr(st, k) for k in AttentionStats.ARRAYS})


def _with(st: AttentionStats, **meta) -> AttentionStats:
    return AttentionStats(meta=dict(st.meta, **meta), **{k: getattr(st, k) for k in AttentionStats.ARRAYS})


# --- collect ---------------------------------------------------------------------------------


@pytest.mark.parametrize("windows, kw, match", [
    ("ragged", {}, "one length"),
    ([[0] + [VOCAB] * 10], {}, "vocabulary"),
    ([[0] + [-3] * 10], {}, "vocabulary"),
    ([[0.5] * 10], {}, "integer token ids"),
    ("ok", {"n_sink": -1}, "n_sink"),
    ("ok", {"samples": -1}, "samples"),
    ([[0]], {}, "more than n_sink"),
    ([], {}, "one or more windows"),
])
def test_collect_refuses_bad_windows_and_settings(two, windows, kw, match) -> None:
    m1, _, wins, _, _ = two
    windows = {"ragged": [wins[0], wins[1][:10]], "ok": wins}.get(windows, windows) \
        if isinstance(windows, str) else windows
    with pytest.raises(InvalidParameterError, match=match):
        calibration.collect(m1, windows, **kw)


def test_sensitivity_refuses_no_windows_and_bad_ids(two) -> None:
    m1 = two[0]
    with pytest.raises(InvalidParameterError, match="one or more windows"):
        calibration.collect_sensitivity(m1, [], score=8)
    with pytest.raises(InvalidParameterError, match="vocabulary"):
        calibration.collect_sensitivity(m1, [[0] + [VOCAB + 5] * 20], score=8)


def test_statistics_record_the_model(two) -> None:
    m1, _, _, st, se = two
    fp = calibration.fingerprint(m1)
    assert st.meta["fingerprint"] == fp and se.meta["fingerprint"] == fp


# --- bundling and pooling --------------------------------------------------------------------


def test_a_calibration_refuses_another_models_statistics(two) -> None:
    m1, m2, _, st, se = two
    assert Calibration.for_model(m1, st, se).fingerprint == calibration.fingerprint(m1)
    with pytest.raises(ModelMismatchError, match="statistics were gathered on another model"):
        Calibration.for_model(m2, st, se)
    with pytest.raises(ModelMismatchError, match="sensitivity were gathered on another model"):
        Calibration.for_model(m2, _without(st, "fingerprint"), se)
    # Statistics that do not record the model (older files): their o_gram is compared.
    bare = _without(st, "fingerprint")
    assert Calibration.for_model(m1, bare).fingerprint == calibration.fingerprint(m1)
    with pytest.raises(ModelMismatchError, match="o_gram"):
        Calibration.for_model(m2, bare)
    from kakeyaturbo.calibration.collect import weights_o_gram

    np.testing.assert_allclose(weights_o_gram(m1), st.o_gram, rtol=1e-12, atol=1e-15)


def test_pooling_refuses_parts_that_do_not_belong_together(two) -> None:
    m1, m2, wins, st, se = two
    after = calibration.collect(m1, wins, samples=8, rope="after")
    with pytest.raises(InvalidParameterError, match="'rope'"):
        pool_stats([(st, 1), (after, 1)])
    uniform = calibration.collect(m1, wins, samples=8, weighting="uniform")
    with pytest.raises(InvalidParameterError, match="'weighting'"):
        pool_stats([(st, 1), (uniform, 1)])
    other = calibration.collect(m2, wins, samples=8)
    with pytest.raises(InvalidParameterError, match="'fingerprint'"):
        pool_stats([(st, 1), (other, 1)])
    with pytest.raises(InvalidParameterError, match="o_gram"):  # the models' weights differ
        pool_stats([(_without(st, "fingerprint"), 1), (_without(other, "fingerprint"), 1)])
    # A part that records no RoPE side is "before": pools with "before", not with "after".
    assert pool_stats([(_without(st, "rope"), 1), (st, 1)]).meta["rope"] == "before"
    with pytest.raises(InvalidParameterError, match="'rope'"):
        pool_stats([(_without(st, "rope"), 1), (after, 1)])
    sens_after = calibration.collect_sensitivity(m1, wins, score=8, rope="after")
    with pytest.raises(InvalidParameterError, match="'rope'"):
        pool_sensitivity([(se, 1), (sens_after, 1)])
    # The pooled record says the side its parts were taken on, whatever the caller's meta says.
    with pytest.raises(InvalidParameterError, match="rope 'before'.*'after' RoPE"):
        pool_stats([(after, 1)], meta={"rope": "before"})
    assert pool_sensitivity([(sens_after, 1)], meta={"text": "x"}).meta["rope"] == "after"
    with pytest.raises(InvalidParameterError, match="Sensitivity"):
        pool_sensitivity([(st, 1)])
    with pytest.raises(InvalidParameterError, match="AttentionStats"):
        pool_stats([(se, 1)])
    for bad in (-1, 2.5, True):
        with pytest.raises(InvalidParameterError, match="samples"):
            pool_stats([(st, 1)], samples=bad)


def test_latent_o_gram_is_pooled_as_a_moment() -> None:
    """Multi-head latent attention's o_gram is a second moment of data (rotated queries): the
    parts' differ and pool like q2, not refused."""
    g = np.random.default_rng(0)

    def part(seed: int) -> AttentionStats:
        g = np.random.default_rng(seed)
        sq = lambda: np.stack([[np.cov(g.standard_normal((3, 20)))]])  # noqa: E731
        return AttentionStats(meta={"hooks": LATENT_POINT}, q2=sq(), k_mean=np.zeros((1, 1, 3)), k_cov=sq(),
                              v_mean=np.zeros((1, 1, 3)), v_cov=sq(), o_gram=sq(),
                              k_samples=g.standard_normal((1, 1, 2, 3)).astype(np.float32),
                              v_samples=g.standard_normal((1, 1, 2, 3)).astype(np.float32))

    a, b = part(1), part(2)
    assert g is not None and not np.allclose(a.o_gram, b.o_gram)
    np.testing.assert_allclose(pool_stats([(a, 1), (b, 3)]).o_gram, 0.25 * a.o_gram + 0.75 * b.o_gram)


# --- texts and helpers -----------------------------------------------------------------------


@pytest.mark.parametrize("article, match", [({"title": "x"}, "no 'extract'"), ({"extract": None}, "no text"),
                                            (None, "no text")])
def test_wiki_json_without_text_names_the_file_and_article(tmp_path, article, match) -> None:
    p = tmp_path / "wiki.json"
    p.write_text(json.dumps({"Good": {"extract": "some text"}, "Bad article": article}), encoding="utf-8")
    with pytest.raises(InvalidParameterError, match=f"wiki.json.*'Bad article' has {match}"):
        split.load_articles(p)
    p.write_text(json.dumps({"Good": {"extract": "some text"}, "Plain": "text too"}), encoding="utf-8")
    assert split.load_articles(p) == {"Good": "some text", "Plain": "text too"}


def test_helpers_refuse_nonsense(tmp_path, word_tok) -> None:
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"w{i} " * 30 for i in range(40)), encoding="utf-8")
    for length in (1, 0, -4):
        with pytest.raises(InvalidParameterError, match="window must be"):
            corpus.calibration_windows(word_tok, text, 2, length)
        with pytest.raises(InvalidParameterError, match="window must be"):
            corpus.evaluation_windows(word_tok, text, 2, length)
    for count in (0, -1):
        with pytest.raises(InvalidParameterError, match="windows"):
            corpus.calibration_windows(word_tok, text, count, 8)
    assert all(len(w) == 8 for w in corpus.calibration_windows(word_tok, text, 2, 8))
    for share in (2.0, -0.1, float("nan"), "a"):
        with pytest.raises(InvalidParameterError, match="share"):
            split.split({"a": "x", "b": "y"}, share)
    for weights in ([("code", -1.0), ("wiki-en", 2.0)], [("code", 0.0)], [], [("code", float("inf"))]):
        with pytest.raises(InvalidParameterError, match="weights"):
            corpus.apportion(weights, 4)
    assert corpus.apportion([("code", 0.0), ("wiki-en", 1.0)], 3) == [("wiki-en", 3)]


def test_sensitivity_meta_agreeing_pools(two) -> None:
    se = two[4]
    half = Sensitivity(meta=dict(se.meta), k=se.k / 2, v=se.v / 2)
    np.testing.assert_allclose(pool_sensitivity([(se, 1), (half, 1)]).k, 0.75 * se.k)
