"""Names of texts (``--text``, ``--calibration-text``, ``[calibration] corpus``) and their check:
what is accepted, and a typed error naming what is wrong for everything else."""

from __future__ import annotations

from pathlib import Path

import pytest

from kakeyaturbo import texts
from kakeyaturbo.errors import InvalidParameterError


@pytest.mark.parametrize("name", texts.DOMAINS)
def test_domains_are_accepted_as_themselves(name: str) -> None:
    assert texts.check_spec(name) == name
    assert texts.check_spec(name, allow_mixture=False) == name
    assert texts.describe(name) == name


def test_a_file_is_accepted_by_its_path_and_described_by_its_stem(tmp_path: Path) -> None:
    f = tmp_path / "my-text.txt"
    f.write_text("a\n\nb\n")
    assert texts.check_spec(f) == str(f)
    assert texts.check_spec(str(f), allow_mixture=False) == str(f)
    assert texts.describe(str(f)) == "my-text"


@pytest.mark.parametrize("bad", ["", "wiki-de", "nosuchfile.txt", None, 3])
def test_anything_else_is_a_typed_error(bad, tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="domain"):
        texts.check_spec(bad)


def test_a_folder_is_not_a_text(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="neither"):
        texts.check_spec(tmp_path)


def test_the_mixture_is_calibration_text_only() -> None:
    assert texts.check_spec("mixture") == "mixture"
    assert texts.check_spec("mixture:code=1,chat=2") == "mixture:code=1,chat=2"
    for spec in ("mixture", "mixture:code=1"):
        assert texts.is_mixture(spec)
        with pytest.raises(InvalidParameterError, match="calibration text only"):
            texts.check_spec(spec, allow_mixture=False)
    assert not texts.is_mixture("mixtures") and not texts.is_mixture("code")


def test_parse_the_default_and_custom_mixtures() -> None:
    assert texts.parse("mixture") == list(texts.DEFAULT_MIXTURE)
    assert {d for d, _ in texts.DEFAULT_MIXTURE} == set(texts.DOMAINS)
    assert texts.parse("mixture:code=1.5, wiki-fr=2,chat") == [
        ("code", 1.5), ("wiki-fr", 2.0), ("chat", 1.0)]


@pytest.mark.parametrize("spec, why", [
    ("mixture:", "not a domain"),
    ("mixture:wiki-de=1", "not a domain"),
    ("mixture:code=x", "not a number"),
    ("mixture:code=0", "must be > 0"),
    ("mixture:code=-1", "must be > 0"),
    ("mixture:code=nan", "must be > 0"),
    ("mixture:code=inf", "must be > 0"),
    ("mixture:code=1,code=2", "named twice"),
    ("code", "not a mixture"),
])
def test_bad_mixtures_name_what_is_wrong(spec: str, why: str) -> None:
    with pytest.raises(InvalidParameterError, match=why):
        texts.parse(spec)
    if spec.startswith("mixture"):
        with pytest.raises(InvalidParameterError):
            texts.check_spec(spec)
