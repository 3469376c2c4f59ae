"""A calibration that travels with its model: ONE self-contained safetensors file holding a
model's attention statistics and sensitivity, with metadata that says which model it was made
for (its type and a fingerprint of its attention weights), on which text and with which
settings, by which library version, and checksums of every array and of the metadata. A model
whose K/V layers come in several shapes (Gemma 4) has one pair per group of layers of one shape:
the first under ``stats/`` and ``sensitivity/``, the others under ``group1/``, ``group2/``, ...
(their metadata in ``groups``).

``kakeyaturbo calibrate --out FILE`` writes it; :meth:`Calibration.load` reads it back (numpy
only), :meth:`Calibration.check_model` refuses it for another model, and
``KakeyaCache.from_pretrained(model, recipe, calibration=FILE)`` builds the cache from it.
A recipe's ``[calibration] path`` may name such a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import __version__
from .._files import write_atomically
from ..errors import CorruptDataError, InvalidParameterError, ModelMismatchError, UnsupportedVersionError
from .checks import fingerprint
from .collect import weights_o_gram
from .compressed import COMPRESSED_POINT
from .latent import LATENT_POINT
from .mixture import O_GRAM_TOLERANCE
from .stats import AttentionStats, Sensitivity, require_file

#: The ``format`` entry of the metadata, and the version this build writes and reads.
FORMAT = "kakeyaturbo-calibration"
VERSION = 1

_STATS = "stats/"
_SENS = "sensitivity/"


def _checksum(arrays: Dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape}\n".encode())
        h.update(a.tobytes())
    return h.hexdigest()


#: The metadata entry holding the checksum of every other metadata entry. Added to version 1
#: (readers ignore entries they do not know): files written before it are read unchecked.
_META_SUM = "meta_sha256"


def _meta_checksum(meta: Dict[str, str]) -> str:
    items = sorted((k, v) for k, v in meta.items() if k != _META_SUM)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


@dataclass
class Calibration:
    """A model's calibration: :class:`AttentionStats`, the :class:`Sensitivity` where it was
    gathered, and who it belongs to (``model_type``, ``fingerprint`` of the attention weights,
    ``shape`` = (layers, kv_heads, head_dim)); ``settings`` (corpus, windows, dtype, ...) and
    ``library`` (the version that made it) as recorded; ``path`` the file it came from.
    ``groups``: the ``(stats, sensitivity)`` of the model's further groups of K/V layers of one
    shape (:meth:`~kakeyaturbo.families.ModelLayout.shape_groups` after the first: Gemma 4's
    sliding layers), where they were calibrated too."""

    stats: AttentionStats
    sensitivity: Optional[Sensitivity]
    model_type: str
    fingerprint: str
    settings: Dict[str, Any] = field(default_factory=dict)
    library: str = f"kakeyaturbo {__version__}"
    path: Optional[Path] = None
    groups: Tuple[Tuple[AttentionStats, Optional[Sensitivity]], ...] = ()

    @property
    def shape(self) -> Tuple[int, int, int]:
        return (self.stats.num_layers, self.stats.kv_heads, int(self.stats.q2.shape[-1]))

    @classmethod
    def for_model(cls, model: Any, stats: AttentionStats, sensitivity: Optional[Sensitivity] = None,
                  settings: Optional[Dict[str, Any]] = None,
                  groups: Sequence[Tuple[AttentionStats, Optional[Sensitivity]]] = ()) -> "Calibration":
        """The calibration of a loaded ``model`` from statistics gathered on it (its type and
        fingerprint are read from the model); checked against the model's shapes and weights:
        ModelMismatchError when the statistics or sensitivity record another model's fingerprint
        (:func:`~kakeyaturbo.calibration.collect` records it) or, where statistics record none,
        their ``o_gram`` is not the model's output projections' (multi-head latent attention's
        is data, not weights: not compared)."""
        from ..families import describe

        fp = fingerprint(model)
        cal = cls(stats=stats, sensitivity=sensitivity, model_type=describe(model).model_type,
                  fingerprint=fp, settings=dict(settings or {}), groups=tuple(groups))
        for st, se in cal.pairs():
            if se is not None and not se.fits(st):
                raise InvalidParameterError(f"sensitivity of shape {se.k.shape} does not match the "
                                            f"statistics' {st.q2.shape} (or not over the same layers)")
        cal._check_shapes(model, "statistics")
        cal._check_weights(model, fp)
        return cal

    def _check_weights(self, model: Any, fp: str) -> None:
        """ModelMismatchError unless every part was gathered on ``model`` (fingerprint ``fp``)."""
        for n, (st, se) in enumerate(self.pairs()):
            for what, part in (("statistics", st), ("sensitivity", se)):
                got = None if part is None else part.meta.get("fingerprint")
                if got is not None and got != fp:
                    raise ModelMismatchError(
                        f"{what} were gathered on another model: fingerprint of the attention weights "
                        f"{got} in their meta, {fp} for this model")
            hooks = st.meta.get("hooks")
            if st.meta.get("fingerprint") is None and hooks not in (LATENT_POINT, COMPRESSED_POINT):
                want = weights_o_gram(model, None if n == 0 else st.layer_index)
                if float(np.abs(st.o_gram - want).max()) > O_GRAM_TOLERANCE * float(np.abs(want).max()):
                    raise ModelMismatchError(
                        "statistics were gathered on another model: their o_gram (the output "
                        "projection's Gram matrix) is not this model's")

    def pairs(self) -> List[Tuple[AttentionStats, Optional[Sensitivity]]]:
        """``(stats, sensitivity)`` of every group of layers it calibrates, the main one first."""
        return [(self.stats, self.sensitivity), *self.groups]

    def _where(self) -> str:
        return f"calibration file {str(self.path)!r}" if self.path else "calibration"

    def _check_shapes(self, model: Any, what: str) -> None:
        from ..families import describe

        layout = describe(model)
        groups = layout.shape_groups()
        layers, (_, kv, d) = groups[0]
        want = (len(layers), kv, d)
        if self.shape != want:
            raise ModelMismatchError(
                f"{what}: (layers, kv-heads, head_dim) = {self.shape}, but the model "
                f"({layout.model_type!r}) has {want}")
        dv = layout.layers[layers[0]].v_dim or d
        if self.stats.dims[1] != dv:  # multi-head latent attention: the rotated key part
            raise ModelMismatchError(f"{what}: values {self.stats.dims[1]} wide, but the model "
                                     f"({layout.model_type!r}) caches them {dv} wide")
        if self.stats.layer_index != layers:
            raise ModelMismatchError(
                f"{what} are of layers {list(self.stats.layer_index)}, but the model's calibrated K/V "
                f"layers ({layout.model_type!r}) are {list(layers)}")
        others = {g[0]: g[1][1:] for g in groups[1:]}
        if len({st.layer_index for st, _ in self.groups}) != len(self.groups):
            raise ModelMismatchError(f"{what} hold a group of layers twice")
        for st, _ in self.groups:
            if others.get(st.layer_index) != (st.kv_heads, int(st.q2.shape[-1])):
                raise ModelMismatchError(
                    f"{what} hold a group of layers {list(st.layer_index)} ({st.kv_heads} kv-heads, "
                    f"head_dim {st.q2.shape[-1]}) that is not one of the model's "
                    f"({layout.model_type!r}: {[(list(g[0]), g[1][1:]) for g in groups[1:]]})")

    def check_model(self, model: Any) -> "Calibration":
        """Itself when it was made for ``model``; ModelMismatchError naming the file and what
        differs (model type, shapes, fingerprint of the attention weights) otherwise."""
        from ..families import describe

        where = self._where()
        mtype = describe(model).model_type
        if mtype != self.model_type:
            raise ModelMismatchError(f"{where} was made for a {self.model_type!r} model, not {mtype!r}")
        self._check_shapes(model, where)
        got = fingerprint(model)
        if got != self.fingerprint:
            raise ModelMismatchError(
                f"{where} was made for another model: fingerprint of the attention weights "
                f"{self.fingerprint} in the file, {got} for this model")
        return self

    def parts(self, recipe: Any) -> Tuple[AttentionStats, Optional[Sensitivity]]:
        """``(stats, sensitivity)`` of the main group for a calibrated recipe;
        InvalidParameterError when the recipe needs the sensitivity and the file holds none."""
        return self.all_parts(recipe)[0]

    def all_parts(self, recipe: Any) -> List[Tuple[AttentionStats, Optional[Sensitivity]]]:
        """:meth:`parts` of every group it calibrates, the main one first."""
        if getattr(recipe, "needs_sensitivity", False) and any(se is None for _, se in self.pairs()):
            raise InvalidParameterError(
                f"recipe {recipe.name!r} needs the model's sensitivity, which {self._where()} does "
                "not hold (it was calibrated with --sensitivity-windows 0)")
        return self.pairs()

    # --- the file ---------------------------------------------------------------------------

    def save(self, path: "os.PathLike[str] | str") -> Path:
        """Writes the one file (safetensors; see the module doc) and returns its path."""
        arrays: Dict[str, np.ndarray] = {}
        for n, (st, se) in enumerate(self.pairs()):
            pre = "" if n == 0 else f"group{n}/"
            arrays.update({pre + _STATS + k: np.ascontiguousarray(getattr(st, k)) for k in st.ARRAYS})
            if se is not None:
                arrays.update({pre + _SENS + k: np.ascontiguousarray(getattr(se, k)) for k in se.ARRAYS})
        meta = {
            "format": FORMAT, "version": str(VERSION), "library": self.library,
            "model_type": self.model_type, "fingerprint": self.fingerprint,
            "shape": json.dumps(list(self.shape)),
            "settings": json.dumps(self.settings, sort_keys=True),
            "stats_meta": json.dumps(self.stats.meta, sort_keys=True),
            "sensitivity_meta": json.dumps(self.sensitivity.meta if self.sensitivity else None,
                                           sort_keys=True),
            "sha256": _checksum(arrays),
        }
        if self.groups:
            meta["groups"] = json.dumps([[st.meta, se.meta if se is not None else None] for st, se in self.groups],
                                        sort_keys=True)
        meta[_META_SUM] = _meta_checksum(meta)
        return write_file(path, arrays, meta)

    @classmethod
    def load(cls, path: "os.PathLike[str] | str") -> "Calibration":
        """Reads a file :meth:`save` wrote. Raises InvalidParameterError when it does not exist,
        CorruptDataError naming the file when it is not such a file, is truncated or damaged
        (the checksums of its arrays and, where it has one, of its metadata), lacks an array or
        holds wrong shapes or non-finite values, UnsupportedVersionError when a newer version
        wrote it."""
        p = Path(path)
        where = f"calibration file {str(p)!r}"
        meta, arrays = read_file(p, where, FORMAT, VERSION, "a kakeyaturbo calibration",
                                 "kakeyaturbo calibrate --out")
        if _checksum(arrays) != meta.get("sha256"):
            raise CorruptDataError(f"{where} is damaged: the checksum of its arrays does not match")
        try:
            def js(key: str) -> Any:
                return json.loads(meta[key])

            metas = [[js("stats_meta"), js("sensitivity_meta")]] + list(js("groups") if "groups" in meta else [])
            if not all(isinstance(m, list) and len(m) == 2 for m in metas):
                raise CorruptDataError(f"{where}: its groups record does not read")
            pairs = []
            for n, (st_meta, se_meta) in enumerate(metas):
                pre = "" if n == 0 else f"group{n}/"
                missing = [pre + _STATS + k for k in AttentionStats.ARRAYS if pre + _STATS + k not in arrays]
                if missing:
                    raise CorruptDataError(f"{where} lacks the arrays {missing}")
                st = AttentionStats(meta=st_meta, **{k: arrays[pre + _STATS + k] for k in AttentionStats.ARRAYS})
                se = None
                if any(k.startswith(pre + _SENS) for k in arrays):
                    se = Sensitivity(meta=se_meta or {}, **{k: arrays[pre + _SENS + k] for k in Sensitivity.ARRAYS})
                if se is not None and not se.fits(st):
                    raise CorruptDataError(f"{where}: its arrays disagree with the shapes it records")
                pairs.append((st, se))
            read = {f"{'' if n == 0 else f'group{n}/'}{part}{k}" for n in range(len(pairs))
                    for part, names in ((_STATS, AttentionStats.ARRAYS), (_SENS, Sensitivity.ARRAYS)) for k in names}
            if set(arrays) - read:
                raise CorruptDataError(f"{where} holds arrays no group record describes "
                                       f"({sorted(set(arrays) - read)[:3]} ...)")
            (stats, sens), groups = pairs[0], tuple(pairs[1:])
            cal = cls(stats=stats, sensitivity=sens, model_type=str(meta["model_type"]),
                      fingerprint=str(meta["fingerprint"]), settings=js("settings"),
                      library=str(meta.get("library", "")), path=p, groups=groups)
            if list(cal.shape) != js("shape"):
                raise CorruptDataError(f"{where}: its arrays disagree with the shapes it records")
        except CorruptDataError:
            raise
        # InvalidParameterError is a ValueError; JSON nested past Python's recursion limit
        # raises RecursionError.
        except (KeyError, ValueError, TypeError, RecursionError) as e:
            raise CorruptDataError(f"{where}: {e}") from None
        # Last, so that a record that does not read is named as such.
        if _META_SUM in meta and _meta_checksum(meta) != meta[_META_SUM]:
            raise CorruptDataError(f"{where} is damaged: the checksum of its metadata does not match")
        return cal


def write_file(path: "os.PathLike[str] | str", arrays: Dict[str, np.ndarray],
               meta: Dict[str, str]) -> Path:
    """One safetensors file of ``arrays`` and ``meta``, written to a temporary name beside it
    and then moved into place (a reader never sees half a file, no other file is touched, the
    temporary file is removed on failure); its directory made if need be. InvalidParameterError
    when ``path`` is a directory or its folder cannot be made or written."""
    from safetensors.numpy import save_file

    p = Path(path)
    write_atomically([(p, lambda t: save_file(arrays, str(t), metadata=meta))], "the file")
    return p


def read_file(p: Path, where: str, fmt: str, version: int, what: str, writer: str
              ) -> Tuple[Dict[str, str], Dict[str, np.ndarray]]:
    """The metadata and arrays of one of this package's safetensors files, after the checks
    every such file gets: InvalidParameterError when ``p`` does not exist, CorruptDataError
    naming it (``where``) when it cannot be read or its ``format`` is not ``fmt`` (``what`` it
    should be, and ``writer``, what writes one), UnsupportedVersionError when its version is
    above ``version``."""
    require_file(p, where)
    meta, arrays = _read(p, where)
    if meta.get("format") != fmt:
        raise CorruptDataError(f"{where} is not {what} (format {meta.get('format')!r}); "
                               f"write one with {writer}")
    try:
        got = int(meta.get("version", ""))
    except ValueError:
        raise CorruptDataError(f"{where}: version {meta.get('version')!r} is not a number") from None
    if got > version:
        raise UnsupportedVersionError(f"{where} is version {got}; this build reads up to {version}")
    return meta, arrays


def _read(p: Path, where: str) -> Tuple[Dict[str, str], Dict[str, np.ndarray]]:
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="np") as f:
            meta = dict(f.metadata() or {})
            arrays = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type on garbage
        raise CorruptDataError(f"{where} cannot be read: {e}") from None
    return meta, arrays


def file_format(path: "os.PathLike[str] | str") -> Optional[str]:
    """The ``format`` a safetensors file's metadata records (None: not such a file, or none)."""
    p = Path(path)
    try:
        if not p.is_file():  # OSError, caught below, for a name too long to look up
            return None
        from safetensors import safe_open

        with safe_open(str(p), framework="np") as f:
            return (f.metadata() or {}).get("format")
    except Exception:
        return None


def is_calibration_file(path: "os.PathLike[str] | str") -> bool:
    """Whether ``path`` is a file :meth:`Calibration.save` wrote (its metadata says so)."""
    return file_format(path) == FORMAT


def load(path: "os.PathLike[str] | str") -> Calibration:
    """:meth:`Calibration.load`."""
    return Calibration.load(path)
