"""The exception hierarchy. Every error the codec raises is a :class:`KakeyaError`; the
value-like ones are also :class:`ValueError`, so ``except ValueError`` keeps working."""

from __future__ import annotations

__all__ = [
    "KakeyaError",
    "InvalidInputError",
    "InvalidParameterError",
    "UnsupportedModelError",
    "ModelMismatchError",
    "CorruptDataError",
    "UnsupportedVersionError",
    "NumericalError",
    "InternalError",
    "MissingDependencyError",
]


class KakeyaError(Exception):
    """Base class of every kakeyaturbo error."""


class InvalidInputError(KakeyaError, ValueError):
    """The data is unusable: empty, NaN/inf, wrong length or shape, negative weights."""


class InvalidParameterError(KakeyaError, ValueError):
    """A parameter is outside its documented range."""


class UnsupportedModelError(InvalidParameterError):
    """A model the cache cannot serve as asked (its cache is not K/V rows, or its keys' RoPE cannot
    be recomputed from positions); the message names the model type and the reason."""


class ModelMismatchError(InvalidParameterError):
    """A file made for another model (a calibration whose fingerprint of the attention weights
    or whose shapes differ from the model's, a saved prefix of another codec); the message names
    the file and what differs."""


class CorruptDataError(KakeyaError, ValueError):
    """A container is truncated, corrupted or inconsistent."""


class UnsupportedVersionError(CorruptDataError):
    """A container was written by a newer format version than this build reads."""


class NumericalError(KakeyaError, ArithmeticError):
    """A numerical routine (eigen solver, SVD) failed."""


class InternalError(KakeyaError, RuntimeError):
    """A bug in the codec (a Rust panic, caught before it could abort the interpreter)."""


class MissingDependencyError(KakeyaError, ModuleNotFoundError):
    """An optional part of the library needs a package that is not installed (an extra such as
    ``eval``, or a data package of EVAL.md); the message and :attr:`install` give the exact
    command that installs it."""

    def __init__(self, message: str, install: str = "") -> None:
        super().__init__(message)
        self.install = install
