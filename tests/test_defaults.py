"""Every default the README documents is the default the code uses: the per-block keyword
arguments, the calibrated stream and [calibration] fields, and the command line's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict

import pytest

import kakeyaturbo as kt
from kakeyaturbo import cli, recipes

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def _value(text: str) -> Any:
    """A README default cell as a Python value (derived defaults, e.g. ``max(D/2, 8)``, are None)."""
    t = text.strip().strip("`")
    if t.startswith("None") or t.startswith("max("):
        return None
    if t in ("True", "False"):
        return t == "True"
    if t.startswith('"'):
        return t.strip('"')
    return int(t, 16) if t.startswith("0x") else float(t) if "." in t else int(t)


def _table(header: str) -> Dict[str, Any]:
    """name -> default of the README table whose header row is ``header``."""
    at = README.index(header)
    out: Dict[str, Any] = {}
    for line in README[at:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        names, default = [c.strip() for c in line.strip("|").split("|")][:2]
        keys = [n.strip().strip("`") for n in re.split(r",|/", names)]
        vals = re.split(r",(?![^(]*\))", default) if "," in names else [default] * len(keys)
        for k, v in zip(keys, vals):
            out[k] = _value(v)
    return out


def test_per_block_defaults_are_documented() -> None:
    doc = _table("| name | default | meaning |")
    extra = {"weights": None, "threads": None}
    assert {**kt.DEFAULTS, **extra} == doc


def test_calibrated_defaults_are_documented() -> None:
    tables = README.split("| field | default | meaning |")
    assert len(tables) == 3
    assert _table("| field | default | meaning |") == recipes.CALIBRATED_DEFAULTS
    second = README.index("| field | default | meaning |", README.index("| field | default | meaning |") + 1)
    rows: Dict[str, Any] = {}
    for line in README[second:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        name, default = [c.strip() for c in line.strip("|").split("|")][:2]
        rows[name.strip("`")] = _value(default)
    assert rows == recipes.CALIBRATION_DEFAULTS


@pytest.mark.parametrize("command", ["calibrate", "eval"])
def test_command_line_defaults_are_documented(command) -> None:
    sub = cli.parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    row = next(line for line in README.splitlines() if line.startswith(f"| `kakeyaturbo {command}"))
    documented = {m.group(1).replace("-", "_"): m.group(2)
                  for m in re.finditer(r"\[--([a-z-]+) ([0-9]+)\]", row)}
    assert documented, row
    defaults = vars(sub[command].parse_args([]))
    for name, value in documented.items():
        assert defaults[name] == int(value), name
