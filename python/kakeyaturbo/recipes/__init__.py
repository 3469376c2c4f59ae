"""Recipes: per-stream (K, V) codec parameters and boundary layers, as TOML data files.

A recipe file has ``name``, ``description``, ``boundary_layers`` (indices; negative ones count
from the end), ``n_sink`` (tokens at the start of the sequence kept uncompressed, default 0),
``streams`` (which of ``"k"``, ``"v"`` are compressed, default both) and tables ``[k]`` and
``[v]`` of codec keyword arguments (the names of :data:`kakeyaturbo.DEFAULTS`). Ship new recipes by adding a ``*.toml`` file here.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11 only
    import tomli as tomllib

from .._api import DEFAULTS
from .._errors import InvalidParameterError

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    boundary_layers: Tuple[int, ...] = ()
    k: Dict[str, Any] = field(default_factory=dict)
    v: Dict[str, Any] = field(default_factory=dict)
    n_sink: int = 0
    streams: Tuple[str, ...] = ("k", "v")

    def boundary(self, num_layers: int) -> List[int]:
        """The boundary layer indices for a model of `num_layers` layers, sorted, in range."""
        out = set()
        for i in self.boundary_layers:
            j = i + num_layers if i < 0 else i
            if 0 <= j < num_layers:
                out.add(j)
        return sorted(out)


def available() -> List[str]:
    """Names of the shipped recipes."""
    return sorted(p.stem for p in HERE.glob("*.toml"))


def _check_stream(name: str, stream: str, table: Any) -> Dict[str, Any]:
    if not isinstance(table, dict):
        raise InvalidParameterError(f"recipe {name!r}: [{stream}] must be a table")
    unknown = sorted(set(table) - set(DEFAULTS))
    if unknown:
        raise InvalidParameterError(f"recipe {name!r}: unknown codec parameter(s) {unknown} in [{stream}]")
    return dict(table)


def load(name_or_path: "str | os.PathLike[str]") -> Recipe:
    """A shipped recipe by name, or a recipe file by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = HERE / f"{name_or_path}.toml"
        if not path.exists():
            raise InvalidParameterError(
                f"no recipe named {name_or_path!r}; shipped: {', '.join(available())}"
            )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InvalidParameterError(f"cannot read recipe {str(path)!r}: {e}") from e
    known = {"name", "description", "boundary_layers", "k", "v", "n_sink", "streams"}
    extra = sorted(set(data) - known)
    if extra:
        raise InvalidParameterError(f"recipe {str(path)!r}: unknown field(s) {extra}")
    name = str(data.get("name", path.stem))
    layers = data.get("boundary_layers", [])
    if not (isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise InvalidParameterError(f"recipe {name!r}: boundary_layers must be a list of ints")
    n_sink = data.get("n_sink", 0)
    if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
        raise InvalidParameterError(f"recipe {name!r}: n_sink must be an int >= 0")
    streams = data.get("streams", ["k", "v"])
    if not (isinstance(streams, list) and set(streams) <= {"k", "v"}):
        raise InvalidParameterError(f"recipe {name!r}: streams must be a list drawn from 'k', 'v'")
    return Recipe(
        name=name,
        n_sink=n_sink,
        streams=tuple(streams),
        description=str(data.get("description", "")),
        boundary_layers=tuple(layers),
        k=_check_stream(name, "k", data.get("k", {})),
        v=_check_stream(name, "v", data.get("v", {})),
    )
