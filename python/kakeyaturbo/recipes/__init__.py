"""Recipes: per-stream (K, V) codec settings, boundary layers, sink tokens and how a calibration
is gathered, as TOML data files shipped here (`available()`) or given by path (`load()`).
Ship a new recipe by adding a ``*.toml`` file to this folder; see `recipe` for the fields."""

from .recipe import (
    CALIBRATED_DEFAULTS,
    CALIBRATION_DEFAULTS,
    BlockStream,
    CalibratedStream,
    CalibrationSettings,
    Recipe,
    available,
    load,
)

__all__ = [
    "CALIBRATED_DEFAULTS",
    "CALIBRATION_DEFAULTS",
    "BlockStream",
    "CalibratedStream",
    "CalibrationSettings",
    "Recipe",
    "available",
    "load",
]
