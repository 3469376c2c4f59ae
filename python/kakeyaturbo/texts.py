"""Names of texts: what ``--text``, ``--calibration-text`` and a recipe's ``[calibration]
corpus`` take, and their check (standard library only; :mod:`kakeyaturbo.calibration.corpus`
turns a name into token windows).

- a domain of :data:`DOMAINS`: ``wiki-en``, ``wiki-fr``, ``wiki-es``, ``code``, ``prose``
  (:mod:`kakeyaturbo.calibration.sources`) or ``chat`` (:mod:`kakeyaturbo.calibration.chat`,
  made with the model's chat template);
- ``mixture`` (the shipped multi-domain calibration mixture, :data:`DEFAULT_MIXTURE`) or
  ``mixture:DOMAIN=W,...``; calibration only;
- a path: the wiki package's JSON (``title -> {extract, ...}``) or any UTF-8 text file (one
  document per blank-line-separated paragraph).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import List, Tuple

from .errors import InvalidParameterError

#: The named domains.
DOMAINS = ("wiki-en", "wiki-fr", "wiki-es", "code", "prose", "chat")

MIXTURE = "mixture"

#: The shipped mixture: window weights per domain (of 16 windows, 3 / 2 / 2 / 3 / 3 / 3).
DEFAULT_MIXTURE: Tuple[Tuple[str, float], ...] = (
    ("wiki-en", 3.0), ("wiki-fr", 2.0), ("wiki-es", 2.0), ("code", 3.0), ("prose", 3.0),
    ("chat", 3.0))



def is_mixture(spec: str) -> bool:
    return isinstance(spec, str) and (spec == MIXTURE or spec.startswith(MIXTURE + ":"))


def check_spec(spec: "os.PathLike[str] | str", *, allow_mixture: bool = True) -> str:
    """The spec as a string, checked: a domain, a mixture (where allowed) or an existing file.
    Raises InvalidParameterError naming what it accepts."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec:
        raise InvalidParameterError(f"a text must be a domain, a mixture or a path, got {spec!r}")
    if spec in DOMAINS:
        return spec
    if is_mixture(spec):
        if not allow_mixture:
            raise InvalidParameterError(f"{spec!r}: a mixture is calibration text only; evaluate "
                                        f"on one of {', '.join(DOMAINS)} or a file")
        parse(spec)
        return spec
    p = expand(spec, "text")
    try:
        there = p.is_file()
    except OSError as e:  # a name the system refuses to look up (too long)
        raise InvalidParameterError(f"text {spec[:200]!r}: {e.strerror or e}") from None
    if not there:
        raise InvalidParameterError(
            f"text {spec!r} is neither a domain ({', '.join(DOMAINS)}), a mixture ('mixture', "
            f"'mixture:DOMAIN=WEIGHT,...') nor a file")
    return str(p)


def expand(path: str, what: str) -> Path:
    """``path`` with ``~`` and ``~user`` expanded. InvalidParameterError naming ``what`` when
    it holds a NUL character (no file has such a name: the system would refuse it only when
    the file is opened) or names a user (or, for ``~``, a home) the system does not know
    (``Path.expanduser`` raises RuntimeError)."""
    if "\0" in path:
        raise InvalidParameterError(f"{what} {path[:200]!r} is not a path: it holds a NUL character")
    try:
        return Path(path).expanduser()
    except RuntimeError as e:
        raise InvalidParameterError(f"{what} {path[:200]!r}: {e}") from None


def describe(spec: str) -> str:
    """A short name of a corpus for tables and file names (a file's stem)."""
    spec = str(spec)
    if spec in DOMAINS or is_mixture(spec):
        return spec
    return Path(spec).stem


def parse(spec: str) -> List[Tuple[str, float]]:
    """``[(domain, weight)]`` of a mixture spec: ``mixture`` (:data:`DEFAULT_MIXTURE`) or
    ``mixture:DOMAIN=WEIGHT,...`` (weights > 0, domains of :data:`DOMAINS`, each once).
    Raises InvalidParameterError naming what is wrong."""
    if spec == MIXTURE:
        return list(DEFAULT_MIXTURE)
    if not isinstance(spec, str) or not spec.startswith(MIXTURE + ":"):
        raise InvalidParameterError(f"not a mixture: {spec!r}")
    out: List[Tuple[str, float]] = []
    for item in spec[len(MIXTURE) + 1:].split(","):
        name, eq, w = item.strip().partition("=")
        name = name.strip()
        if name not in DOMAINS:
            raise InvalidParameterError(
                f"mixture {spec!r}: {name!r} is not a domain ({', '.join(DOMAINS)})")
        try:
            weight = float(w) if eq else 1.0
        except ValueError:
            raise InvalidParameterError(f"mixture {spec!r}: weight {w!r} of {name} is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise InvalidParameterError(f"mixture {spec!r}: the weight of {name} must be > 0")
        if any(name == d for d, _ in out):
            raise InvalidParameterError(f"mixture {spec!r}: {name} is named twice")
        out.append((name, weight))
    if not out:
        raise InvalidParameterError(f"mixture {spec!r} names no domain")
    return out
