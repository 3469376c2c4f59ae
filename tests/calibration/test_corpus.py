"""The calibration / evaluation split and the windows."""

from __future__ import annotations

import json

import pytest

from kakeyaturbo import assets
from kakeyaturbo.calibration import corpus as data


def test_split_is_disjoint_stable_and_near_its_share() -> None:
    articles = {f"Title {i}": f"text of article {i}" for i in range(4000)}
    calib, evalu = data.split(articles)
    assert not set(calib) & set(evalu)
    assert len(calib) + len(evalu) == 4000
    assert abs(len(calib) / 4000 - data.CALIBRATION_SHARE) < 0.03
    # Independent of insertion order.
    rev = dict(reversed(list(articles.items())))
    assert data.split(rev) == (calib, evalu)


def test_load_articles_json_and_text(tmp_path) -> None:
    p = tmp_path / "a.json"
    p.write_text(json.dumps({"A": {"extract": "alpha"}, "B": {"extract": "beta"}}))
    assert data.load_articles(p) == {"A": "alpha", "B": "beta"}
    t = tmp_path / "a.txt"
    t.write_text("one\n\ntwo\n\n\nthree")
    assert list(data.load_articles(t).values()) == ["one", "two", "three"]


def test_windows() -> None:
    ids = list(range(100))
    w = data.windows_of(ids, 10, 5, bos=-1)
    assert len(w) == 5 and all(len(x) == 10 and x[0] == -1 for x in w)
    assert w[1][1:] == list(range(9, 18))
    assert len(data.windows_of(ids, 30, 10, bos=None)) == 3


def test_shipped_text_split() -> None:
    calib, evalu = data.split(data.load_articles(assets.default_text()))
    assert len(calib) > 1000 and len(evalu) > 5000
    assert not set(calib) & set(evalu)


@pytest.mark.parametrize("spec, expected", [
    ("mixture:code=1e308,prose=1e308", [("code", 8), ("prose", 8)]),
    ("mixture:code=1.7e308,prose=1", [("code", 16)]),
    ("mixture:code=1.7e308,prose=0.85e308", [("code", 11), ("prose", 5)]),
])
def test_huge_mixture_weights_apportion_relative_to_each_other(spec, expected) -> None:
    # The sum of the weights (and n * w) overflowed to inf: NaN or inf to int.
    assert data.apportion(data.parse(spec), 16) == expected


def test_ordinary_weights_apportion_as_before() -> None:
    assert data.apportion([("a", 3.0), ("b", 1.0), ("c", 0.1)], 16) == [("a", 12), ("b", 4)]
    assert data.apportion([("a", 1), ("b", 1), ("c", 1)], 16) == [("a", 6), ("b", 5), ("c", 5)]
    assert data.apportion([("a", 0.3), ("b", 0.7)], 10) == [("a", 3), ("b", 7)]
    assert data.apportion([("a", 1e-300), ("b", 3e-300)], 8) == [("a", 2), ("b", 6)]
