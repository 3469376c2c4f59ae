"""Which optional packages a part of the library needs, and the one error that says how to
install them (checked before the import, so a wheel without the ``eval`` extra reads a command
to run instead of ``No module named 'torch'``)."""

from __future__ import annotations

import importlib.util
from typing import Sequence

from .errors import MissingDependencyError

#: The command that installs the ``eval`` extra (torch, transformers, gguf, accelerate, ...).
EVAL_EXTRA = "pip install 'kakeyaturbo[eval]'"


def missing(modules: Sequence[str]) -> list:
    """The top-level modules of ``modules`` that cannot be found (nothing is imported)."""
    out = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing, or a broken one
            found = False
        if not found:
            out.append(name)
    return out


def require(what: str, modules: Sequence[str] = ("torch", "transformers"),
            install: str = EVAL_EXTRA) -> None:
    """Raises MissingDependencyError naming ``what`` needs, the modules that are missing and
    ``install`` (the command to run) when any of ``modules`` is not installed."""
    gone = missing(modules)
    if gone:
        names = ", ".join(gone)
        raise MissingDependencyError(f"{what} needs {names}, which {'is' if len(gone) == 1 else 'are'} "
                                     f"not installed: {install}", install)
