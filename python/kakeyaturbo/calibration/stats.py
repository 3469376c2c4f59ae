"""Calibration statistics and their store: per (layer, kv-head) moments of a model's attention
(:class:`AttentionStats`) and its measured sensitivity (:class:`Sensitivity`), each saved as
safetensors with a JSON sidecar, checked (shapes, finiteness) whenever they are made or loaded."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Type, TypeVar

import numpy as np

from .._files import write_atomically
from .._limits import MAX_LAYERS
from ..errors import CorruptDataError, InvalidInputError, InvalidParameterError

_S = TypeVar("_S", bound="_Stored")


class _Stored:
    """Arrays (``ARRAYS``) saved as safetensors with a JSON sidecar holding ``meta``; ``KIND``
    names the file in errors."""

    ARRAYS: Tuple[str, ...] = ()
    KIND = "file"
    meta: Dict[str, Any]

    def save(self, path: "os.PathLike[str] | str") -> Tuple[Path, Path]:
        """Writes ``path`` (safetensors) and ``path`` + ``.json`` (the sidecar: meta), each to a
        temporary name beside it first, then moved into place, the sidecar first (an
        interrupted write leaves no entry that looks complete). InvalidParameterError when
        ``path`` is a directory or its folder cannot be made."""
        from safetensors.numpy import save_file

        p = _named(path, self.KIND)
        side = p.with_name(p.name + ".json")
        arrays = {k: np.ascontiguousarray(getattr(self, k)) for k in self.ARRAYS}
        text = json.dumps(self.meta, indent=2, sort_keys=True) + "\n"
        write_atomically([(side, lambda t: t.write_text(text, encoding="utf-8")),
                          (p, lambda t: save_file(arrays, str(t)))], self.KIND)
        return p, side

    @classmethod
    def load(cls: Type[_S], path: "os.PathLike[str] | str") -> _S:
        """Reads what :meth:`save` wrote and checks it. Raises InvalidParameterError when a file
        is missing, CorruptDataError (naming the file and what is wrong) when it is unreadable,
        lacks an array or holds arrays of the wrong shape or non-finite values."""
        from safetensors.numpy import load_file

        p = _named(path, cls.KIND)
        side = p.with_name(p.name + ".json")
        for f in (p, side):
            require_file(f, f"{cls.KIND} file {str(f)!r}")
        try:
            arrays = load_file(str(p))
            meta = json.loads(side.read_text(encoding="utf-8"))
        except Exception as e:  # safetensors raises its own error type on garbage
            raise CorruptDataError(f"cannot read {cls.KIND} {str(p)!r}: {e}") from e
        if not isinstance(meta, dict):
            raise CorruptDataError(f"{cls.KIND} sidecar {str(side)!r} must hold a JSON object")
        missing = [k for k in cls.ARRAYS if k not in arrays]
        if missing:
            raise CorruptDataError(f"{cls.KIND} {str(p)!r} lacks the arrays {missing}")
        try:
            return cls(meta=meta, **{k: arrays[k] for k in cls.ARRAYS})  # type: ignore[call-arg]
        except (InvalidParameterError, InvalidInputError) as e:  # inconsistent, or no covariances
            raise CorruptDataError(f"{cls.KIND} {str(p)!r}: {e}") from None


def _named(path: "os.PathLike[str] | str", kind: str) -> Path:
    """``path``, which names a file (its sidecar is named after it): InvalidParameterError for
    one with no name (``""``, a root or ``..``)."""
    p = Path(path)
    if not p.name or p.name == "..":
        raise InvalidParameterError(f"{kind} file {str(path)!r} names no file")
    return p


def require_file(p: Path, where: str) -> None:
    """InvalidParameterError naming the file (``where``: what it is and its name) unless ``p``
    is a file: it does not exist, is a directory, or the system refuses to look it up (a name
    too long, a folder not searchable: an OSError from ``is_file`` no caller of a loader
    expects)."""
    try:
        if p.is_file():
            return
        why = ("is a directory, not a file" if p.is_dir() else
               "is not a regular file" if p.exists() else "does not exist")
    except OSError as e:
        short = where if len(where) <= 300 else where[:300] + " ..."
        raise InvalidParameterError(f"{short}: {e.strerror or e}") from None
    raise InvalidParameterError(f"{where} {why}")


def _check(owner: str, name: str, a: Any, shape: Tuple[Optional[int], ...], dtype: Any) -> np.ndarray:
    """``a`` as ``dtype``, with ``shape`` (None: any size) and finite values."""
    arr = np.asarray(a)
    if arr.dtype.kind not in "fiu":
        raise InvalidParameterError(f"{owner} {name!r} must be numeric, got dtype {arr.dtype}")
    arr = arr.astype(dtype, copy=False)
    if arr.ndim != len(shape) or any(w is not None and g != w for g, w in zip(arr.shape, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise InvalidParameterError(f"{owner} {name!r} must have shape {want}, got {list(arr.shape)}")
    if not np.all(np.isfinite(arr)):
        raise InvalidParameterError(f"{owner} {name!r} holds NaN or inf")
    return arr


#: Tolerance of :func:`covariance_defect`, relative to the largest magnitude of the matrix: the
#: statistics this library gathers are symmetric to ~1e-11 of it and have no negative variance.
SYMMETRY_RTOL = 1e-6


def covariance_defect(a: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Of float64 matrices ``a [..., D, D]``: (whether each is not symmetric, whether each has a
    negative diagonal entry), each within ``SYMMETRY_RTOL`` of that matrix's largest magnitude.
    A diagonal and symmetry check, not a full positive semi-definiteness test (which would need
    an eigendecomposition of every matrix): it refuses negative variances and asymmetric
    matrices; an indefinite matrix with a non-negative diagonal passes (its negative
    eigenvalues are clamped to 0 by :func:`~kakeyaturbo.calibration.fit.spectrum`)."""
    tol = SYMMETRY_RTOL * np.abs(a).max(axis=(-1, -2))
    asym = np.abs(a - np.swapaxes(a, -1, -2)).max(axis=(-1, -2)) > tol
    neg = np.diagonal(a, axis1=-2, axis2=-1).min(axis=-1) < -tol
    return asym, neg


def square(a: Any, name: str, d: Optional[int] = None, *, covariance: bool = False) -> np.ndarray:
    """``a`` as a finite float64 ``[D, D]`` matrix (``D == d`` if given): TypeError when it is
    not numeric, InvalidInputError naming ``name`` when it is of another shape, holds NaN or inf,
    or (``covariance``) is not symmetric or has a negative diagonal entry
    (:func:`covariance_defect`)."""
    arr = np.asarray(a)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be a numeric matrix, got {type(a).__name__} of dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] < 1:
        raise InvalidInputError(f"{name} must be a square [D, D] matrix, got shape {list(arr.shape)}")
    if d is not None and arr.shape[0] != d:
        raise InvalidInputError(f"{name} is {arr.shape[0]}x{arr.shape[1]}, it must be {d}x{d}")
    arr = arr.astype(np.float64, copy=False)
    if not np.all(np.isfinite(arr)):
        raise InvalidInputError(f"{name} holds NaN or inf")
    if covariance:
        asym, neg = covariance_defect(arr)
        if asym or neg:
            raise InvalidInputError(
                f"{name} is not a covariance: "
                + ("it is not symmetric" if asym else "a diagonal entry (a variance) is negative"))
    return arr


def _check_covariances(owner: str, name: str, a: np.ndarray, layers: Tuple[int, ...]) -> None:
    """InvalidInputError naming the array, layer and kv-head of the first matrix of ``a [L, H,
    D, D]`` that :func:`covariance_defect` refuses."""
    asym, neg = covariance_defect(a)
    bad = np.argwhere(asym | neg)
    if len(bad):
        row, h = (int(i) for i in bad[0])
        what = "is not symmetric" if asym[row, h] else "has a negative diagonal entry (variance)"
        raise InvalidInputError(
            f"{owner} {name!r} at layer {layers[row]}, kv-head {h} {what}: it is not a covariance "
            f"({len(bad)} of {asym.size} matrices are not)")


def _layer_index(owner: str, meta: Dict[str, Any], n: int) -> Tuple[int, ...]:
    """The model's layer index of each of the ``n`` rows: ``meta["layer_index"]`` (a hybrid
    model's K/V layers), else ``0 .. n-1``; InvalidParameterError unless it is ``n`` distinct
    increasing integers in ``0 .. MAX_LAYERS - 1``."""
    got = meta.get("layer_index") if isinstance(meta, dict) else None
    if got is None:
        return tuple(range(n))
    if not isinstance(got, list) or len(got) != n \
            or not all(type(i) is int and 0 <= i < MAX_LAYERS for i in got) \
            or any(a >= b for a, b in zip(got, got[1:])):
        raise InvalidParameterError(
            f"{owner} meta 'layer_index' must list {n} increasing layer indices in 0..{MAX_LAYERS - 1} "
            f"(one per row of the arrays), got {str(got)[:200]}")
    return tuple(got)


def _check_meta(owner: str, meta: Any) -> None:
    """TypeError unless ``meta`` is a dict; InvalidParameterError unless its ``windows`` (what
    gathered it: a count, which pooling sums) is absent or an int >= 0, not a bool."""
    if not isinstance(meta, dict):
        raise TypeError(f"{owner} meta must be a dict, got {type(meta).__name__}")
    w = meta.get("windows", 0)
    if type(w) is not int or w < 0:
        raise InvalidParameterError(f"{owner} meta 'windows' must be an integer >= 0, got {str(w)[:200]}")


@dataclass
class AttentionStats(_Stored):
    """Per (layer, kv-head) statistics of a model's attention, pre-RoPE. Arrays are float64
    ``[L, H_kv, ...]`` over the model's K/V layers (:attr:`layer_index`); ``*_samples`` float32
    ``[L, H_kv, S, D]``. The keys' arrays (``q2``, ``k_*``) are ``D_k`` wide, the values' (``v_*``,
    ``o_gram``) ``D_v``: the same but for multi-head latent attention, whose cached "keys" are a
    latent row and "values" the rotated key part."""

    meta: Dict[str, Any]
    q2: np.ndarray
    k_mean: np.ndarray
    k_cov: np.ndarray
    v_mean: np.ndarray
    v_cov: np.ndarray
    o_gram: np.ndarray
    k_samples: np.ndarray
    v_samples: np.ndarray

    ARRAYS = ("q2", "k_mean", "k_cov", "v_mean", "v_cov", "o_gram", "k_samples", "v_samples")
    KIND = "calibration"

    def __post_init__(self) -> None:
        """Checks that every array agrees on (layers, kv-heads, head_dim) and is finite (else
        InvalidParameterError naming the array), and that ``q2``, ``k_cov``, ``v_cov`` and
        ``o_gram`` are symmetric with non-negative diagonals (else InvalidInputError naming the
        array, layer and kv-head; see :func:`covariance_defect`), and the meta
        (:func:`_check_meta`)."""
        _check_meta("calibration", self.meta)
        q2, v_cov = np.asarray(self.q2), np.asarray(self.v_cov)
        if q2.ndim != 4 or v_cov.ndim != 4:
            raise InvalidParameterError(
                f"calibration 'q2' and 'v_cov' must be [layers, kv_heads, D, D], got shapes "
                f"{list(q2.shape)} and {list(v_cov.shape)}")
        n, h, d = q2.shape[0], q2.shape[1], q2.shape[2]
        dv = v_cov.shape[2]
        if min(n, h, d, dv) < 1:
            raise InvalidParameterError(
                f"calibration of {n} layers, {h} kv-heads, D {d} and D_v {dv}: every one must be >= 1")
        f64 = np.float64
        for name, shape, dtype in (("q2", (n, h, d, d), f64), ("k_mean", (n, h, d), f64),
                                   ("k_cov", (n, h, d, d), f64), ("v_mean", (n, h, dv), f64),
                                   ("v_cov", (n, h, dv, dv), f64), ("o_gram", (n, h, dv, dv), f64),
                                   ("k_samples", (n, h, None, d), np.float32),
                                   ("v_samples", (n, h, None, dv), np.float32)):
            setattr(self, name, _check("calibration", name, getattr(self, name), shape, dtype))
        layers = _layer_index("calibration", self.meta, n)
        for name in ("q2", "k_cov", "v_cov", "o_gram"):
            _check_covariances("calibration", name, getattr(self, name), layers)

    @property
    def num_layers(self) -> int:
        """Rows of the arrays: the model's K/V layers."""
        return int(self.q2.shape[0])

    @property
    def layer_index(self) -> Tuple[int, ...]:
        """The model's layer index of each row (``0 .. L-1`` unless a hybrid model's K/V
        layers are others: ``meta["layer_index"]``)."""
        return _layer_index("calibration", self.meta, self.num_layers)

    @property
    def kv_heads(self) -> int:
        return int(self.q2.shape[1])

    @property
    def dims(self) -> Tuple[int, int]:
        """``(D_k, D_v)``: the width of the keys' and the values' rows."""
        return int(self.q2.shape[2]), int(self.v_cov.shape[2])


@dataclass
class Sensitivity(_Stored):
    """How much a model's loss reacts to errors in its cached keys and values: per (layer,
    kv-head) the second moment ``sum_t g_t g_t^T`` of the gradient of the loss with respect to
    each cached pre-RoPE key (``k``) and value (``v``) row, float64 ``[L, H_kv, D, D]`` (``D_k``
    and ``D_v`` wide where they differ, as :class:`AttentionStats`), summed
    over the cached positions and averaged over windows (an empirical Fisher). To second order
    an error ``e_t`` in row ``t`` raises the loss by ``e_t^T F e_t / 2``, so ``F`` weighs every
    coded component by what it costs the model.

    Construction checks the shapes, finiteness, the meta (InvalidParameterError) and, as for
    :class:`AttentionStats`, that every matrix is symmetric with a non-negative diagonal
    (InvalidInputError naming the array, layer and kv-head: a damaged file is refused, not read
    through one triangle)."""

    meta: Dict[str, Any]
    k: np.ndarray
    v: np.ndarray

    ARRAYS = ("k", "v")
    KIND = "sensitivity"

    def __post_init__(self) -> None:
        _check_meta("sensitivity", self.meta)
        k, v = np.asarray(self.k), np.asarray(self.v)
        for name, a in (("k", k), ("v", v)):
            if a.ndim != 4 or a.shape[2] != a.shape[3] or min(a.shape) < 1:
                raise InvalidParameterError(
                    f"sensitivity {name!r} must be [layers, kv_heads, D, D] (each >= 1), got shape "
                    f"{list(a.shape)}")
        self.k = _check("sensitivity", "k", k, k.shape, np.float64)
        self.v = _check("sensitivity", "v", v, k.shape[:2] + v.shape[2:], np.float64)
        layers = _layer_index("sensitivity", self.meta, k.shape[0])
        for name in ("k", "v"):
            _check_covariances("sensitivity", name, getattr(self, name), layers)

    @property
    def layer_index(self) -> Tuple[int, ...]:
        """The model's layer index of each row, as :attr:`AttentionStats.layer_index`."""
        return _layer_index("sensitivity", self.meta, int(self.k.shape[0]))

    def of(self, stream: str) -> np.ndarray:
        return self.k if stream == "k" else self.v

    def fits(self, stats: "AttentionStats") -> bool:
        """Whether it is of the same layers, kv-heads and row widths as ``stats``."""
        return (self.k.shape == stats.q2.shape and self.v.shape == stats.v_cov.shape
                and self.layer_index == stats.layer_index)


def check_types(stats: Any, sensitivity: Any) -> None:
    """TypeError unless ``stats`` is :class:`AttentionStats` and ``sensitivity`` a
    :class:`Sensitivity` or None (the calibration entry points that take both)."""
    if not isinstance(stats, AttentionStats):
        raise TypeError(f"stats must be AttentionStats, got {type(stats).__name__}")
    if sensitivity is not None and not isinstance(sensitivity, Sensitivity):
        raise TypeError(f"sensitivity must be Sensitivity or None, got {type(sensitivity).__name__}")
