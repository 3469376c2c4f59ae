"""Recipes: per-stream (K, V) codec parameters and boundary layers, as TOML data files.

A recipe file has ``name``, ``description``, ``mode`` (``"block"``, the default, or
``"calibrated"``), ``boundary_layers`` (indices; negative ones count from the end),
``n_sink`` (tokens at the start of the sequence kept uncompressed, default 0), ``streams``
(which of ``"k"``, ``"v"`` are compressed, default both) and tables ``[k]`` and ``[v]``.

- ``mode = "block"``: the tables hold codec keyword arguments (the names of
  :data:`kakeyaturbo.DEFAULTS`).
- ``mode = "calibrated"``: the tables hold the names of :data:`CALIBRATED_DEFAULTS` (target
  bits per element, whitening, centring, ...), and an optional ``[calibration]`` table the
  names of :data:`CALIBRATION_DEFAULTS` (how much calibration text, and a ``path`` to a
  statistics file written by ``kakeyaturbo calibrate``; without it one is made and cached).

Ship new recipes by adding a ``*.toml`` file here.
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
from ..errors import InvalidParameterError

HERE = Path(__file__).parent

#: Per-stream settings of the calibrated mode and their defaults.
CALIBRATED_DEFAULTS: Dict[str, Any] = {
    "bits": 4.0,  # all-in bits per element of the per-token codes (scale included)
    "whiten": "none",  # "query" (keys: E[(q . e)^2]), "output" (values: o_proj), "none"
    "center": True,  # subtract the calibration mean before projecting
    "norm": True,  # one fp16 scale per row
    "metric": "mse",
    "outlier_threshold": None,
    "rotation_seed": 0xCAFEBABE,
    "max_bits": 8,
    "tables": "gaussian",  # or "calibrated": Lloyd-Max fitted on the codec's own z (per width)
    # or "global": one water-filling over every layer and kv-head of the stream; or
    # "sensitivity": one water-filling over every layer, kv-head and stream that asks for it,
    # each component weighed by the measured sensitivity of the model's loss to it
    "allocation": "per-head",
}

#: How the calibration statistics are gathered (``kakeyaturbo calibrate``).
CALIBRATION_DEFAULTS: Dict[str, Any] = {
    "windows": 16,
    "window": 1024,
    "weighting": "attention",
    "path": None,
    # For allocation = "sensitivity" or whiten = "fisher": windows of the calibration split
    # whose loss gradients are gathered, and the tokens at the end of each that are scored.
    "sensitivity_windows": 16,
    "score": 64,
    "sensitivity_path": None,
}


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    boundary_layers: Tuple[int, ...] = ()
    k: Dict[str, Any] = field(default_factory=dict)
    v: Dict[str, Any] = field(default_factory=dict)
    n_sink: int = 0
    streams: Tuple[str, ...] = ("k", "v")
    mode: str = "block"
    calibration: Dict[str, Any] = field(default_factory=dict)

    def stream(self, name: str) -> Dict[str, Any]:
        """The settings of stream ``"k"`` or ``"v"``; in calibrated mode with defaults filled in."""
        table = self.k if name == "k" else self.v
        if self.mode == "calibrated":
            return {**CALIBRATED_DEFAULTS, **table}
        return dict(table)

    @property
    def needs_sensitivity(self) -> bool:
        """Whether the calibrated codecs need the model's measured sensitivity
        (:class:`kakeyaturbo.calibrate.Sensitivity`) besides its attention statistics."""
        return self.mode == "calibrated" and any(
            self.stream(s)["allocation"] == "sensitivity" or self.stream(s)["whiten"] == "fisher"
            for s in self.streams)

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


def _check_table(name: str, stream: str, table: Any, known: Dict[str, Any]) -> Dict[str, Any]:
    if not isinstance(table, dict):
        raise InvalidParameterError(f"recipe {name!r}: [{stream}] must be a table")
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise InvalidParameterError(f"recipe {name!r}: unknown parameter(s) {unknown} in [{stream}]")
    return dict(table)


def _check_calibrated(name: str, stream: str, t: Dict[str, Any]) -> None:
    full = {**CALIBRATED_DEFAULTS, **t}
    bits = full["bits"]
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits <= 16:
        raise InvalidParameterError(f"recipe {name!r}: [{stream}] bits must be in (0, 16]")
    if full["whiten"] not in ("none", "query", "output", "fisher"):
        raise InvalidParameterError(
            f"recipe {name!r}: [{stream}] whiten must be none, query, output or fisher")
    if full["whiten"] == "query" and stream != "k":
        raise InvalidParameterError(f"recipe {name!r}: whiten = 'query' applies to keys only")
    if full["whiten"] == "output" and stream != "v":
        raise InvalidParameterError(f"recipe {name!r}: whiten = 'output' applies to values only")
    for key in ("center", "norm"):
        if not isinstance(full[key], bool):
            raise InvalidParameterError(f"recipe {name!r}: [{stream}] {key} must be a bool")
    if full["allocation"] not in ("per-head", "global", "sensitivity"):
        raise InvalidParameterError(
            f"recipe {name!r}: [{stream}] allocation must be per-head, global or sensitivity")
    if full["tables"] not in ("gaussian", "calibrated"):
        raise InvalidParameterError(f"recipe {name!r}: [{stream}] tables must be gaussian or calibrated")
    if not isinstance(full["max_bits"], int) or not 1 <= full["max_bits"] <= 8:
        raise InvalidParameterError(f"recipe {name!r}: [{stream}] max_bits must be in 1..8")


def load(name_or_path: "str | os.PathLike[str]") -> Recipe:
    """A shipped recipe by name, or a recipe file by path."""
    path = Path(name_or_path)
    if not path.exists():
        shipped = HERE / f"{name_or_path}.toml"
        if shipped.exists():
            path = shipped
        elif path.suffix != ".toml":
            raise InvalidParameterError(
                f"no recipe named {name_or_path!r}; shipped: {', '.join(available())}"
            )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InvalidParameterError(f"cannot read recipe {str(path)!r}: {e}") from e
    known = {"name", "description", "boundary_layers", "k", "v", "n_sink", "streams", "mode",
             "calibration"}
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
    mode = data.get("mode", "block")
    if mode not in ("block", "calibrated"):
        raise InvalidParameterError(f"recipe {name!r}: mode must be 'block' or 'calibrated'")
    known_stream = CALIBRATED_DEFAULTS if mode == "calibrated" else DEFAULTS
    k = _check_table(name, "k", data.get("k", {}), known_stream)
    v = _check_table(name, "v", data.get("v", {}), known_stream)
    calibration = _check_table(name, "calibration", data.get("calibration", {}), CALIBRATION_DEFAULTS)
    if mode == "calibrated":
        _check_calibrated(name, "k", k)
        _check_calibrated(name, "v", v)
    elif calibration:
        raise InvalidParameterError(f"recipe {name!r}: [calibration] needs mode = 'calibrated'")
    for key in ("path", "sensitivity_path"):
        if calibration.get(key) is not None:
            cp = Path(calibration[key]).expanduser()
            calibration[key] = str(cp if cp.is_absolute() else path.parent / cp)
    for key in ("sensitivity_windows", "score"):
        val = calibration.get(key, CALIBRATION_DEFAULTS[key])
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise InvalidParameterError(f"recipe {name!r}: [calibration] {key} must be an int >= 1")
    return Recipe(
        name=name,
        n_sink=n_sink,
        streams=tuple(streams),
        description=str(data.get("description", "")),
        boundary_layers=tuple(layers),
        k=k,
        v=v,
        mode=mode,
        calibration={**CALIBRATION_DEFAULTS, **calibration},
    )
