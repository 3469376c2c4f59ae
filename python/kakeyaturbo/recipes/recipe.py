"""Recipes: how to code a model's cache, as TOML data files, typed and validated once.

A recipe file has ``name``, ``description``, ``mode`` (``"block"``, the default, or
``"calibrated"``), ``boundary_layers`` (indices; negative ones count from the end),
``n_sink`` (tokens at the start of the sequence kept uncompressed, default 0), ``streams``
(which of ``"k"``, ``"v"`` are compressed, default both) and tables ``[k]`` and ``[v]``:

- ``mode = "block"``: the tables hold per-block codec keyword arguments (the names of
  :data:`kakeyaturbo.DEFAULTS`); a :class:`BlockStream` is a read-only mapping of them, so
  ``encode_layer(x, **recipe.k)`` works.
- ``mode = "calibrated"``: the tables hold the fields of :class:`CalibratedStream` (target bits
  per element, whitening, centring, ...), and an optional ``[calibration]`` table the fields of
  :class:`CalibrationSettings` (how much calibration text, and optional ``path`` /
  ``sensitivity_path`` to statistics files written by ``kakeyaturbo calibrate``; relative paths
  are relative to the recipe file).

Every value is checked when the :class:`Recipe` is made (from a file or in code): a bad value
raises ``InvalidParameterError`` naming the recipe (and file), the field and what it must be.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python < 3.11 only
    import tomli as tomllib

from ..codec import _checks
from ..codec.calibrated import DEFAULT_ROTATION_SEED, METRICS
from ..codec.perblock import check_params
from ..errors import InvalidParameterError, KakeyaError
from ..texts import DOMAINS, check_spec, expand, is_mixture

HERE = Path(__file__).parent
STREAMS = ("k", "v")
MODES = ("block", "calibrated")


class BlockStream(Mapping[str, Any]):
    """The per-block codec keyword arguments of one stream, checked by the core on creation
    (:func:`kakeyaturbo.check_params`); a read-only mapping."""

    def __init__(self, kwargs: Optional[Mapping[str, Any]] = None) -> None:
        self._kw = dict(_checks.mapping(kwargs or {}, "block stream settings"))
        check_params(self._kw, None)

    def __getitem__(self, key: str) -> Any:
        return self._kw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kw)

    def __len__(self) -> int:
        return len(self._kw)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockStream) and self._kw == other._kw

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._kw.items())))

    def __repr__(self) -> str:
        return f"BlockStream({self._kw!r})"


@dataclass(frozen=True)
class CalibratedStream:
    """How one stream (K or V) is coded in the calibrated mode."""

    #: All-in bits per element of the per-token codes (the row's scale included), in (0, 16].
    bits: float = 4.0
    #: ``query`` (keys: the squared error of ``q . k``), ``output`` (values: ``o_proj``),
    #: ``fisher`` (the model's measured sensitivity) or ``none``.
    whiten: str = "none"
    #: Subtract the calibration mean before projecting.
    center: bool = True
    #: One fp16 scale per row.
    norm: bool = True
    metric: str = "mse"
    outlier_threshold: Optional[float] = None
    rotation_seed: int = DEFAULT_ROTATION_SEED
    #: At most this many bits for one component, 1..8.
    max_bits: int = 8
    #: ``gaussian`` (the N(0, 1) Lloyd-Max tables), ``calibrated`` (fitted per width on the
    #: codec's own ``z`` of the calibration rows, pooled over the stream's layers and kv-heads)
    #: or ``per-head`` (the same, fitted on each (layer, kv-head)'s own rows).
    tables: str = "gaussian"
    #: ``per-head`` water-filling, ``global`` (over every layer and kv-head of the stream) or
    #: ``sensitivity`` (one water-filling over every layer, kv-head and stream that asks for
    #: it, each component weighed by the measured sensitivity of the loss to it).
    allocation: str = "per-head"
    #: Keys only: code them ``before`` RoPE (the cache removes it and puts it back) or ``after``
    #: it (as the cache holds them: attention can then be computed from the codes).
    rope: str = "before"
    #: Shrinks the measured sensitivity ``F`` of every head toward a calibration-free prior
    #: before it whitens or weighs anything: ``(1 - a) F + a P``, ``P`` the prior scaled to
    #: ``tr F``; in [0, 1] (0: the measurement alone).
    fisher_shrink: float = 0.0
    #: The prior: ``identity`` (``tr(F) / D I``) or ``proxy`` (keys: the query second moment;
    #: values: the head's ``o_proj`` Gram matrix).
    fisher_prior: str = "identity"
    #: At least this many bits for every component (paid out of the row's bits first), 0..max_bits.
    min_bits: int = 0
    #: At most this many components of a (layer, kv-head) get any bits (None: no cap). Keys
    #: coded before RoPE are synthesised per row at ``m x D`` multiply-adds (``m`` the components
    #: with bits) by attention over the codes, so a cap bounds that work.
    max_components: Optional[int] = None
    #: What a component costs to have any bits, in multiples of the water level (the gain of
    #: the best bit the allocation without it leaves unspent; ``allocate_bits``): a component
    #: gets bits only where its first bit earns more than that, the budget going to the others.
    #: On K it trades accuracy for the attention kernel's ``m x D`` work per key where that
    #: costs least, instead of a cap in every head; 0 (the default): no cost.
    component_cost: float = 0.0

    WHITEN = ("none", "query", "output", "fisher")
    TABLES = ("gaussian", "calibrated", "per-head")
    ALLOCATION = ("per-head", "global", "sensitivity")
    ROPE = ("before", "after")
    PRIORS = ("identity", "proxy")

    def checked(self, stream: str) -> "CalibratedStream":
        """The same settings with every value checked (raises TypeError/InvalidParameterError)."""
        bits = _checks.real(self.bits, "bits", positive=True)
        if bits > 16:
            raise InvalidParameterError(f"bits must be in (0, 16], got {bits}")
        whiten = _checks.choice(self.whiten, "whiten", self.WHITEN)
        if whiten == "query" and stream != "k":
            raise InvalidParameterError("whiten = 'query' applies to keys only")
        if whiten == "output" and stream != "v":
            raise InvalidParameterError("whiten = 'output' applies to values only")
        rope = _checks.choice(self.rope, "rope", self.ROPE)
        if rope != "before" and stream != "k":
            raise InvalidParameterError("rope applies to keys only (values carry no RoPE)")
        thr = self.outlier_threshold
        shrink = _checks.real(self.fisher_shrink, "fisher_shrink")
        if not 0.0 <= shrink <= 1.0:
            raise InvalidParameterError(f"fisher_shrink must be in [0, 1], got {shrink}")
        max_bits = _checks.integer(self.max_bits, "max_bits", 1, 8)
        cost = _checks.real(self.component_cost, "component_cost")
        if not 0.0 <= cost <= 1e6:
            raise InvalidParameterError(f"component_cost must be in [0, 1e6], got {cost}")
        return CalibratedStream(
            bits=bits, whiten=whiten, center=_checks.boolean(self.center, "center"),
            norm=_checks.boolean(self.norm, "norm"), metric=_checks.choice(self.metric, "metric", METRICS),
            outlier_threshold=None if thr is None else _checks.real(thr, "outlier_threshold", positive=True),
            rotation_seed=_checks.seed(self.rotation_seed),
            max_bits=max_bits,
            tables=_checks.choice(self.tables, "tables", self.TABLES),
            allocation=_checks.choice(self.allocation, "allocation", self.ALLOCATION), rope=rope,
            fisher_shrink=shrink,
            fisher_prior=_checks.choice(self.fisher_prior, "fisher_prior", self.PRIORS),
            min_bits=_checks.integer(self.min_bits, "min_bits", 0, max_bits),
            max_components=None if self.max_components is None
            else _checks.integer(self.max_components, "max_components", 1, 1 << 16),
            component_cost=cost)


@dataclass(frozen=True)
class CalibrationSettings:
    """How the statistics of a calibrated recipe are gathered (``kakeyaturbo calibrate``)."""

    #: Windows of ``window`` tokens of the calibration text for the attention statistics.
    windows: int = 16
    window: int = 1024
    #: ``attention`` (rows weighed by the attention they draw) or ``uniform``.
    weighting: str = "attention"
    #: A statistics file (``kakeyaturbo calibrate --out``); None: gathered and cached.
    path: Optional[str] = None
    #: For ``allocation = "sensitivity"`` or ``whiten = "fisher"``: windows of the calibration
    #: text whose loss gradients are gathered, and the tokens at the end of each that are scored.
    sensitivity_windows: int = 16
    score: int = 64
    #: The next tokens the sensitivity's loss scores: ``text`` (the window's own) or ``model``
    #: (drawn from the model's own prediction: the Gauss-Newton curvature, see
    #: :func:`kakeyaturbo.calibration.collect_sensitivity`).
    labels: str = "text"
    sensitivity_path: Optional[str] = None
    #: The calibration text: ``mixture`` (the shipped multi-domain mixture), ``mixture:D=W,...``,
    #: a domain (``wiki-en``, ``wiki-fr``, ``wiki-es``, ``code``, ``prose``, ``chat``) or a file
    #: (relative to the recipe); only its calibration split is read
    #: (:mod:`kakeyaturbo.texts`). ``--calibration-text`` overrides it.
    corpus: str = "mixture"

    WEIGHTING = ("attention", "uniform")
    LABELS = ("text", "model")

    def checked(self) -> "CalibrationSettings":
        def path(v: Any, name: str) -> Optional[str]:
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path (str), got {type(v).__name__}")
            s = None if v is None else os.fspath(v)
            if s is not None and "\0" in s:  # refused now: the system would refuse it only when opened
                raise InvalidParameterError(f"{name} {s[:200]!r} is not a path: it holds a NUL character")
            return s


        if not isinstance(self.corpus, (str, os.PathLike)):
            raise TypeError(f"corpus must be a domain, a mixture or a path (str), got "
                            f"{type(self.corpus).__name__}")
        try:
            corpus = check_spec(self.corpus)
        except InvalidParameterError as e:
            raise InvalidParameterError(f"corpus: {e}") from None
        window = _checks.integer(self.window, "window", 2)
        score = _checks.integer(self.score, "score", 1)
        if score + 2 > window:
            raise InvalidParameterError(f"score must leave at least 2 tokens of the {window}-token "
                                        f"window for the cache, got {score}")
        return CalibrationSettings(
            windows=_checks.integer(self.windows, "windows", 1), window=window,
            weighting=_checks.choice(self.weighting, "weighting", self.WEIGHTING),
            path=path(self.path, "path"),
            sensitivity_windows=_checks.integer(self.sensitivity_windows, "sensitivity_windows", 1),
            score=score, labels=_checks.choice(self.labels, "labels", self.LABELS),
            sensitivity_path=path(self.sensitivity_path, "sensitivity_path"),
            corpus=corpus)


Stream = Union[BlockStream, CalibratedStream]


def _fields(cls: Any) -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


#: Every field of a calibrated stream and its default.
CALIBRATED_DEFAULTS: Dict[str, Any] = dataclasses.asdict(CalibratedStream())
#: Every field of ``[calibration]`` and its default.
CALIBRATION_DEFAULTS: Dict[str, Any] = dataclasses.asdict(CalibrationSettings())


def _stream(mode: str, name: str, v: Any) -> Stream:
    v = {} if v is None else v
    if mode == "block":
        if isinstance(v, CalibratedStream):
            raise InvalidParameterError(f"[{name}] holds calibrated settings in a block recipe")
        try:
            return v if isinstance(v, BlockStream) else BlockStream(v)
        except (TypeError, KakeyaError) as e:
            raise InvalidParameterError(f"[{name}] {e}") from None
    if isinstance(v, BlockStream):
        raise InvalidParameterError(f"[{name}] holds per-block settings in a calibrated recipe")
    if not isinstance(v, CalibratedStream):
        table = dict(_checks.mapping(v, f"[{name}]"))
        unknown = sorted(set(table) - set(_fields(CalibratedStream)))
        if unknown:
            raise InvalidParameterError(
                f"unknown field(s) {unknown} in [{name}]; known: {list(_fields(CalibratedStream))}")
        v = CalibratedStream(**table)
    try:
        return v.checked(name)
    except (TypeError, KakeyaError) as e:
        raise InvalidParameterError(f"[{name}] {e}") from None


@dataclass(frozen=True)
class Recipe:
    """A recipe: the mode, each stream's settings (typed), the cache settings (boundary layers,
    sink, streams) and, for the calibrated mode, how the calibration is gathered. Plain dicts
    given for ``k``, ``v`` and ``calibration`` are turned into the typed settings and checked."""

    name: str
    description: str = ""
    boundary_layers: Tuple[int, ...] = ()
    #: Each stream's settings; None (or a dict) is turned into the mode's typed settings.
    k: Any = None
    v: Any = None
    n_sink: int = 0
    streams: Tuple[str, ...] = STREAMS
    mode: str = "block"
    calibration: CalibrationSettings = field(default_factory=CalibrationSettings)

    def __post_init__(self) -> None:
        try:
            self._check()
        except (TypeError, KakeyaError) as e:
            raise InvalidParameterError(f"recipe {self.name!r}: {e}") from None

    def _check(self) -> None:
        put = object.__setattr__
        for key in ("name", "description"):
            if not isinstance(getattr(self, key), str):
                raise TypeError(f"{key} must be a str, got {type(getattr(self, key)).__name__}")
        mode = _checks.choice(self.mode, "mode", MODES)
        layers = self.boundary_layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (list, tuple)):
            raise TypeError(f"boundary_layers must be a list of ints, got {layers!r}")
        put(self, "boundary_layers", tuple(_checks.integer(i, "a boundary layer") for i in layers))
        put(self, "n_sink", _checks.integer(self.n_sink, "n_sink", 0))
        if isinstance(self.streams, dict):
            raise TypeError(f"streams must be a list of stream names, got a table {self.streams!r}")
        streams = (self.streams,) if isinstance(self.streams, str) else tuple(self.streams)
        for s in streams:
            _checks.choice(s, "streams entry", STREAMS)
        if len(set(streams)) != len(streams):
            raise InvalidParameterError(f"streams {list(streams)} name a stream twice")
        put(self, "streams", streams)
        put(self, "k", _stream(mode, "k", self.k))
        put(self, "v", _stream(mode, "v", self.v))
        cal = self.calibration
        if not isinstance(cal, CalibrationSettings):
            table = dict(_checks.mapping(cal, "[calibration]"))
            unknown = sorted(set(table) - set(_fields(CalibrationSettings)))
            if unknown:
                raise InvalidParameterError(f"unknown field(s) {unknown} in [calibration]; "
                                            f"known: {list(_fields(CalibrationSettings))}")
            if table and mode != "calibrated":
                raise InvalidParameterError("[calibration] needs mode = 'calibrated'")
            cal = CalibrationSettings(**table)
        elif mode != "calibrated" and cal != CalibrationSettings():
            raise InvalidParameterError("[calibration] needs mode = 'calibrated'")
        try:
            put(self, "calibration", cal.checked())
        except (TypeError, KakeyaError) as e:
            raise InvalidParameterError(f"[calibration] {e}") from None

    def as_dict(self) -> Dict[str, Any]:
        """Every field as plain values (JSON-ready): ``Recipe(**recipe.as_dict())`` is the same
        recipe. Saved prefixes and codec files record their recipe this way."""
        out: Dict[str, Any] = {
            "name": self.name, "description": self.description, "mode": self.mode,
            "boundary_layers": list(self.boundary_layers), "n_sink": self.n_sink,
            "streams": list(self.streams),
        }
        for s in STREAMS:
            st = self.stream(s)
            out[s] = dataclasses.asdict(st) if dataclasses.is_dataclass(st) else dict(st)
        if self.mode == "calibrated":
            out["calibration"] = dataclasses.asdict(self.calibration)
        return out

    def stream(self, name: str) -> Stream:
        """The settings of stream ``"k"`` or ``"v"``."""
        return self.k if _checks.choice(name, "stream", STREAMS) == "k" else self.v

    @property
    def needs_sensitivity(self) -> bool:
        """Whether the calibrated codecs need the model's measured sensitivity
        (:class:`kakeyaturbo.calibration.Sensitivity`) besides its attention statistics."""
        return any(st.allocation == "sensitivity" or st.whiten == "fisher"
                   for _, st in self.calibrated_streams())

    @property
    def key_rope(self) -> str:
        """Which side of RoPE a calibrated recipe codes its keys on (``"before"`` when keys are
        not compressed or the recipe is per-block)."""
        return next((st.rope for s, st in self.calibrated_streams() if s == "k"), "before")

    def calibrated_streams(self) -> List[Tuple[str, CalibratedStream]]:
        """``(name, settings)`` of every compressed stream of a calibrated recipe."""
        out = []
        for s in self.streams:
            st = self.stream(s)
            if isinstance(st, CalibratedStream):
                out.append((s, st))
        return out

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


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; False where the system refuses to look (a name too long)."""
    try:
        return path.exists()
    except OSError:
        return False


def load(name_or_path: "str | os.PathLike[str]") -> Recipe:
    """A shipped recipe by name, or a recipe file by path. Raises InvalidParameterError (the
    file, the field, what it must be) for a missing, unreadable or invalid recipe."""
    path = Path(name_or_path)
    if not _exists(path):
        shipped = HERE / f"{name_or_path}.toml"
        if _exists(shipped):
            path = shipped
        elif path.suffix != ".toml":
            raise InvalidParameterError(
                f"no recipe named {str(name_or_path)[:200]!r}; shipped: {', '.join(available())}"
            )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    # ValueError: not UTF-8, not TOML or a NUL character in the name; RecursionError: tables or
    # arrays nested past Python's recursion limit.
    except (OSError, ValueError, RecursionError) as e:
        raise InvalidParameterError(f"cannot read recipe {str(path)[:200]!r}: {str(e)[:200]}") from e
    known = {f.name for f in dataclasses.fields(Recipe)}
    extra = sorted(set(data) - known)
    if extra:
        raise InvalidParameterError(f"recipe {str(path)!r}: unknown field(s) {extra}")
    calibration = data.get("calibration", {})
    if isinstance(calibration, dict):
        calibration = dict(calibration)
        for key in ("corpus", "path", "sensitivity_path"):  # paths: relative to the recipe
            v = calibration.get(key)
            if isinstance(v, str) and not (key == "corpus" and (v in DOMAINS or is_mixture(v))):
                try:
                    cp = expand(v, key)
                except InvalidParameterError as e:
                    raise InvalidParameterError(f"recipe {str(path)!r}: [calibration] {e}") from None
                calibration[key] = str(cp if cp.is_absolute() else path.parent / cp)
    try:
        return Recipe(
            name=data.get("name", path.stem), description=data.get("description", ""),
            boundary_layers=data.get("boundary_layers", ()), k=data.get("k", {}),
            v=data.get("v", {}), n_sink=data.get("n_sink", 0),
            streams=data.get("streams", STREAMS), mode=data.get("mode", "block"),
            calibration=calibration)
    except InvalidParameterError as e:
        raise InvalidParameterError(f"{e} (in {str(path)!r})") from None
