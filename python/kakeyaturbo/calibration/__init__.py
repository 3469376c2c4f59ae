"""Calibration: what a model's attention looks like on calibration text, and the calibrated
codecs fitted from it. Data flows one way through the modules:

- `corpus`: the calibration text (split by document, disjoint from evaluation text) and windows;
- `collect`: statistics gathered from a model of any family (torch), seen through the attention
  interface before RoPE: moments, and the sensitivity by gradients at the cached rows (`latent`:
  multi-head latent attention's, taken at the cache);
- `stats`: :class:`AttentionStats` and :class:`Sensitivity`, stored as safetensors + JSON;
- `bundle`: :class:`Calibration`, both in ONE file with the model's fingerprint (travels with
  the model: ``kakeyaturbo calibrate --out``);
- `gather`: the statistics a recipe needs, from its files, the cache, or collected;
- `allocation`: integer water-filling of the bits over components, heads, layers, streams;
- `fit`: whitening, the spectrum of each head (once), bases, spreads, Lloyd-Max tables;
- `model_codec`: :class:`ModelCodec`, the calibrated codecs of a whole model for one recipe.
"""

from .allocation import LLOYD_MAX_MSE, allocate_bits, global_allocation, row_budget, water_fill_rates
from .bundle import Calibration, fingerprint, is_calibration_file
from .collect import (attention_modules, collect, collect_groups, collect_sensitivity,
                      collect_sensitivity_groups)
from .corpus import calibration_windows
from .fit import (
    RIDGE,
    HeadSpectrum,
    StreamFit,
    fit_codec,
    fit_spectrum,
    fit_stream,
    fit_tables,
    head_spectrum,
    lloyd_max,
    sensitivity_weights,
    spectrum,
    stream_inputs,
    weighted_spectrum,
    weighted_variances,
    whitening_factor,
)
from .gather import (cached_sensitivity, cached_stats, for_recipe, for_recipe_groups, sensitivity_path,
                     stats_path)
from .model_codec import ModelCodec
from .stats import AttentionStats, Sensitivity

__all__ = [
    "LLOYD_MAX_MSE",
    "RIDGE",
    "AttentionStats",
    "Calibration",
    "HeadSpectrum",
    "ModelCodec",
    "Sensitivity",
    "StreamFit",
    "allocate_bits",
    "attention_modules",
    "cached_sensitivity",
    "cached_stats",
    "calibration_windows",
    "collect",
    "collect_sensitivity",
    "collect_groups",
    "collect_sensitivity_groups",
    "fingerprint",
    "fit_codec",
    "fit_spectrum",
    "fit_stream",
    "fit_tables",
    "for_recipe",
    "for_recipe_groups",
    "global_allocation",
    "head_spectrum",
    "is_calibration_file",
    "lloyd_max",
    "row_budget",
    "sensitivity_path",
    "sensitivity_weights",
    "spectrum",
    "stats_path",
    "stream_inputs",
    "water_fill_rates",
    "weighted_spectrum",
    "weighted_variances",
    "whitening_factor",
]
