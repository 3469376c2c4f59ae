"""The calibrated codecs of a whole model for one recipe (a :class:`StreamCodec` of the cache)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ..codec import CalibratedCodec, _checks
from ..errors import InvalidParameterError
from ..recipes import Recipe
from .allocation import global_allocation, row_budget
from .fit import fit_codec, fit_tables, head_spectrum, shrunk_sensitivity, weighted_variances
from .stats import AttentionStats, Sensitivity


class ModelCodec:
    """The calibrated codecs of a whole model for one recipe: a
    :class:`kakeyaturbo.cache.StreamCodec` (keys are coded without RoPE, as calibrated).

    Per compressed (stream, layer, kv-head) the spectrum is computed once
    (:func:`~kakeyaturbo.calibration.fit.head_spectrum`); the allocation (per head, ``global``
    over a stream, or ``sensitivity`` pooled over every stream that asks for it) and the fit
    read it. ``model_bytes``: the calibrations' bytes, stored once per model and counted apart
    from the per-token bits. Raises InvalidParameterError for a recipe that is not calibrated
    or statistics that do not fit it, NumericalError (naming the head) for statistics that
    cannot be factored.
    """

    pre_rope_keys: bool

    def __init__(self, stats: AttentionStats, recipe: Recipe, *, threads: Optional[int] = None,
                 sensitivity: Optional[Sensitivity] = None) -> None:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a kakeyaturbo.recipes.Recipe, got {type(recipe).__name__}")
        if not isinstance(stats, AttentionStats):
            raise TypeError(f"stats must be AttentionStats, got {type(stats).__name__}")
        if recipe.mode != "calibrated":
            raise InvalidParameterError(f"recipe {recipe.name!r} is not calibrated")
        if recipe.needs_sensitivity and sensitivity is None:
            raise InvalidParameterError(
                f"recipe {recipe.name!r} allocates by sensitivity or whitens by it: pass the "
                "model's Sensitivity (kakeyaturbo.calibration.cached_sensitivity)")
        if sensitivity is not None and sensitivity.k.shape != stats.q2.shape:
            raise InvalidParameterError(
                f"sensitivity of shape {sensitivity.k.shape} (layers, kv-heads, D, D) does not "
                f"match the statistics' {stats.q2.shape}")
        rope = recipe.key_rope
        for what, obj in (("statistics", stats), ("sensitivity", sensitivity)):
            have = (getattr(obj, "meta", None) or {}).get("rope", "before") if obj is not None else rope
            if have != rope:
                raise InvalidParameterError(
                    f"recipe {recipe.name!r} codes keys {rope} RoPE but the {what} were taken "
                    f"{have} it: collect them with rope={rope!r}")
        #: Keys are handed to the codec without RoPE (the cache removes it and puts it back).
        self.pre_rope_keys = rope == "before"
        if sensitivity is not None:
            sensitivity = shrunk_sensitivity(sensitivity, stats, dict(recipe.calibrated_streams()))
        self.recipe = recipe
        self.threads = _checks.threads(threads)
        self.codecs: Dict[Tuple[str, int, int], CalibratedCodec] = {}
        #: Custom Lloyd-Max tables by stream and bit width (``tables = "calibrated"``).
        self.tables: Dict[str, Dict[int, np.ndarray]] = {}
        keys = [(layer, h) for layer in range(stats.num_layers) for h in range(stats.kv_heads)]
        streams = recipe.calibrated_streams()
        spectra = {(s, *key): head_spectrum(stats, s, *key, st, sensitivity)
                   for s, st in streams for key in keys}
        alloc: Dict[Tuple[str, int, int], Optional[np.ndarray]] = {k: None for k in spectra}
        # allocation = "sensitivity": one pooled water-filling over every (stream, layer,
        # kv-head) that asks for it, on variances weighed by what their errors cost the loss.
        pooled = [((s, *key), st) for s, st in streams if st.allocation == "sensitivity"
                  for key in keys]
        if pooled:
            assert sensitivity is not None
            weighted = [weighted_variances(spectra[k], sensitivity.of(k[0])[k[1], k[2]])
                        for k, _ in pooled]
            budgets = [row_budget(st.bits, w.size, st.norm) for (_, st), w in zip(pooled, weighted)]
            max_bits = min(st.max_bits for _, st in pooled)
            floors = [st.min_bits for _, st in pooled]  # each stream's own floor
            caps = [st.max_components for _, st in pooled]  # and cap
            costs = [st.component_cost for _, st in pooled]  # and component cost
            for (k, _), b in zip(pooled, global_allocation(weighted, budgets, max_bits, floors,
                                                           caps, costs)):
                alloc[k] = b
        for s, st in streams:
            if st.allocation == "global":
                lams = [spectra[(s, *key)].variances for key in keys]
                budget = row_budget(st.bits, lams[0].size, st.norm)
                for key, b in zip(keys, global_allocation(lams, [budget] * len(keys), st.max_bits,
                                                          st.min_bits, st.max_components,
                                                          st.component_cost)):
                    alloc[(s, *key)] = b
            samples = stats.k_samples if s == "k" else stats.v_samples
            tables: Dict[Tuple[int, int], Optional[Dict[int, np.ndarray]]] = {}
            if st.tables != "gaussian":
                first = {key: fit_codec(spectra[(s, *key)], st, bits=alloc[(s, *key)])
                         for key in keys}
                if st.tables == "calibrated":
                    self.tables[s] = fit_tables(first, samples)
                    tables = {key: self.tables[s] for key in keys}
                else:  # per-head: each (layer, kv-head) its own rows' tables
                    tables = {key: fit_tables({key: first[key]}, samples) for key in keys}
            for key in keys:
                self.codecs[(s, *key)] = fit_codec(spectra[(s, *key)], st, tables.get(key),
                                                   alloc[(s, *key)])
        self.model_bytes = sum(c.model_bytes for c in self.codecs.values())

    def __repr__(self) -> str:
        return f"ModelCodec({self.recipe.name!r}, {len(self.codecs)} calibrations)"

    def _codec(self, stream: str, layer: int, head: int) -> CalibratedCodec:
        try:
            return self.codecs[(stream, layer, head)]
        except KeyError:
            raise InvalidParameterError(
                f"no calibration for stream {stream!r}, layer {layer}, kv-head {head}") from None

    def encode(self, stream: str, layer: int, head: int, x: np.ndarray) -> bytes:
        return self._codec(stream, layer, head).encode(x, threads=self.threads)

    def decode(self, stream: str, layer: int, head: int, blob: bytes) -> np.ndarray:
        return self._codec(stream, layer, head).decode(blob, threads=self.threads)
