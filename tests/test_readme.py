"""The README's examples are tests: every ```python block runs, and a ```text block right after
one must equal what it printed."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```(?:\n\n?Output:\n\n```text\n(.*?)```)?", README, re.S)


def test_readme_has_examples() -> None:
    assert BLOCKS, "the README lost its quickstart"


@pytest.mark.parametrize("code, expected", BLOCKS)
def test_readme_example(code: str, expected: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    if expected:
        assert out.getvalue() == expected
