"""The calibrated codecs of a whole model for one recipe (a :class:`StreamCodec` of the cache)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._core import __version__
from ..codec import CalibratedCodec, _checks
from ..codec.calibrated import decode_blocks, decode_blocks_into, encode_blocks
from ..errors import CorruptDataError, InvalidParameterError, KakeyaError, ModelMismatchError
from ..recipes import Recipe
from .allocation import global_allocation, row_budget
from .bundle import _checksum, file_format, fingerprint, read_file, write_file
from .fit import fit_codec, fit_tables, head_spectrum, shrunk_sensitivity, weighted_variances
from .stats import AttentionStats, Sensitivity, check_types


#: The ``format`` entry of a codec file's metadata, and the version this build writes and reads.
CODEC_FORMAT = "kakeyaturbo-codec"
CODEC_VERSION = 1
_ARRAYS = ("mean", "analysis", "synthesis", "spread", "bits")


def _codec_checksum(arrays: Dict[str, np.ndarray], meta: Dict[str, str]) -> str:
    """SHA-256 of a codec file's arrays and of its recipe and per-calibration records."""
    h = hashlib.sha256(_checksum(arrays).encode())
    for k in ("recipe", "heads", "model"):
        h.update(f"\n{k}:{meta.get(k, '')}".encode())
    return h.hexdigest()


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
        check_types(stats, sensitivity)
        if recipe.mode != "calibrated":
            raise InvalidParameterError(f"recipe {recipe.name!r} is not calibrated")
        if recipe.needs_sensitivity and sensitivity is None:
            raise InvalidParameterError(
                f"recipe {recipe.name!r} allocates by sensitivity or whitens by it: pass the "
                "model's Sensitivity (kakeyaturbo.calibration.cached_sensitivity)")
        if sensitivity is not None and not sensitivity.fits(stats):
            raise InvalidParameterError(
                f"sensitivity of shapes {sensitivity.k.shape} and {sensitivity.v.shape} (layers, kv-heads, "
                f"D, D) over layers {list(sensitivity.layer_index)} does not match the statistics' "
                f"{stats.q2.shape} and {stats.v_cov.shape} over {list(stats.layer_index)}")
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
        #: The model a loaded codec file was fitted for (``{"type", "fingerprint"}``), and the file.
        self.model_info: Optional[Dict[str, str]] = None
        self.path: Optional[Path] = None
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
            for key in keys:  # rows of the statistics -> the model's layer indices
                self.codecs[(s, stats.layer_index[key[0]], key[1])] = fit_codec(
                    spectra[(s, *key)], st, tables.get(key), alloc[(s, *key)])
        self.model_bytes = sum(c.model_bytes for c in self.codecs.values())

    def __repr__(self) -> str:
        return f"ModelCodec({self.recipe.name!r}, {len(self.codecs)} calibrations)"

    # --- the codec file ---------------------------------------------------------------------

    def save(self, path: "os.PathLike[str] | str", model: Any = None) -> Path:
        """Writes the fitted codecs to one file (safetensors: every calibration's float32
        arrays as the codec holds them, the recipe, each calibration's fingerprint, a checksum;
        with ``model``, also its type and the fingerprint of its attention weights, which
        :meth:`check_model` compares) and returns its path. :meth:`load` gives back the same
        codecs on any machine; fitting again from the statistics need not (its
        eigendecompositions differ in their last bits between BLAS kernels, and with them the
        fingerprints every container records: ``benches/codec_portability.py``)."""
        arrays: Dict[str, np.ndarray] = {}
        heads: Dict[str, Any] = {}
        for (s, layer, h), c in sorted(self.codecs.items()):
            key = f"{s}.{layer}.{h}"
            d = c.as_dict()
            for name in _ARRAYS:
                arrays[f"{key}.{name}"] = np.ascontiguousarray(d[name])
            for b, t in (d["centroids"] or {}).items():
                arrays[f"{key}.table{b}"] = np.ascontiguousarray(t)
            heads[key] = {"rotation_seed": d["rotation_seed"], "metric": d["metric"], "norm": d["norm"],
                          "outlier_threshold": d["outlier_threshold"],
                          "tables": sorted(int(b) for b in (d["centroids"] or {})),
                          "fingerprint": f"{c.fingerprint:016x}"}
        meta = {"format": CODEC_FORMAT, "version": str(CODEC_VERSION),
                "library": f"kakeyaturbo {__version__}",
                "recipe": json.dumps(self.recipe.as_dict(), sort_keys=True),
                "heads": json.dumps(heads, sort_keys=True)}
        made_for = self.model_info
        if model is not None:
            from ..families import describe

            made_for = {"type": describe(model).model_type, "fingerprint": fingerprint(model)}
            self.check_model(model)  # the codecs fit its shapes
        meta["model"] = json.dumps(made_for, sort_keys=True)
        meta["sha256"] = _codec_checksum(arrays, meta)
        return write_file(path, arrays, meta)

    @classmethod
    def load(cls, path: "os.PathLike[str] | str", *, threads: Optional[int] = None) -> "ModelCodec":
        """The codecs a :meth:`save` wrote, each rebuilt from its arrays and checked against
        the fingerprint recorded for it. Raises InvalidParameterError when the file does not
        exist, CorruptDataError naming the file when it is not such a file, is truncated or
        damaged (checksum, fingerprints), lacks a calibration of its recipe's streams or holds
        unusable ones, UnsupportedVersionError when a newer version wrote it."""
        p = Path(path)
        where = f"codec file {str(p)!r}"
        meta, arrays = read_file(p, where, CODEC_FORMAT, CODEC_VERSION, "a kakeyaturbo codec file",
                                 "ModelCodec.save")
        if _codec_checksum(arrays, meta) != meta.get("sha256"):
            raise CorruptDataError(f"{where} is damaged: the checksum of its arrays and records "
                                   "does not match")
        try:
            recipe = Recipe(**json.loads(meta["recipe"]))
            if recipe.mode != "calibrated":
                raise CorruptDataError(f"{where}: its recipe {recipe.name!r} is not calibrated")
            heads = json.loads(meta["heads"])
            codecs: Dict[Tuple[str, int, int], CalibratedCodec] = {}
            pooled: Dict[str, Dict[int, np.ndarray]] = {}  # a stream's tables, every width in use
            for key, st in heads.items():
                s, layer, h = key.split(".")
                kw = {name: arrays[f"{key}.{name}"] for name in _ARRAYS}
                tables = {int(b): arrays[f"{key}.table{int(b)}"] for b in st["tables"]}
                c = CalibratedCodec(**kw, rotation_seed=st["rotation_seed"], metric=st["metric"],
                                    norm=st["norm"], outlier_threshold=st["outlier_threshold"],
                                    centroids=tables or None)
                if f"{c.fingerprint:016x}" != st["fingerprint"]:
                    raise CorruptDataError(f"{where}: calibration {key} does not rebuild to its "
                                           f"fingerprint {st['fingerprint']}")
                codecs[(s, int(layer), int(h))] = c
                pooled.setdefault(s, {}).update(tables)
        except CorruptDataError:
            raise
        except (KeyError, ValueError, TypeError, AttributeError, RecursionError, KakeyaError) as e:
            raise CorruptDataError(f"{where}: {e}") from None
        # Every layer's kv-heads 0..n-1 (n per layer: a model's groups of layers may differ), for
        # every stream of the recipe. A damaged index (kv-head 10^12) is refused before the set
        # of what a file of it would hold is built: every head counted has a codec of its own.
        heads = {layer: 1 + max(h for (_, la, h) in codecs if la == layer) for (_, layer, _) in codecs}
        if not codecs or sum(heads.values()) > len(codecs):
            want = None
        else:
            want = {(s, layer, h) for s, _ in recipe.calibrated_streams() for layer, n in heads.items()
                    for h in range(n)}
        if want is None or set(codecs) != want or min(heads) < 0:
            raise CorruptDataError(f"{where}: its calibrations do not cover the recipe's streams "
                                   f"over layers {sorted(heads)} and their kv-heads")
        try:
            made_for = json.loads(meta.get("model", "null"))
            if made_for is not None:
                made_for = {"type": str(made_for["type"]), "fingerprint": str(made_for["fingerprint"])}
        except (KeyError, ValueError, TypeError, RecursionError) as e:
            raise CorruptDataError(f"{where}: its model record does not read ({e})") from None
        out = cls.__new__(cls)
        out.model_info = made_for
        out.path = p
        out.recipe = recipe
        out.threads = _checks.threads(threads)
        out.pre_rope_keys = recipe.key_rope == "before"
        out.codecs = codecs
        # Each codec holds the tables of the widths it uses; the stream's are their union.
        out.tables = {s: pooled.get(s, {}) for s, st in recipe.calibrated_streams()
                      if st.tables == "calibrated"}
        out.model_bytes = sum(c.model_bytes for c in codecs.values())
        return out

    def _heads(self, layers: Sequence[int]) -> Any:
        """The kv-head count of the codecs of ``layers`` (a set of counts where they differ)."""
        got = {1 + max(h for (_, la, h) in self.codecs if la == layer) for layer in layers
               if any(la == layer for (_, la, _) in self.codecs)}
        return next(iter(got)) if len(got) == 1 else sorted(got)

    def _width(self, layers: Sequence[int], stream: str) -> Any:
        """The row width of the codecs of ``stream`` for ``layers`` (a set where they differ;
        None where none codes it)."""
        got = {c.d for (s, la, _), c in self.codecs.items() if s == stream and la in set(layers)}
        return None if not got else next(iter(got)) if len(got) == 1 else sorted(got)

    @classmethod
    def merged(cls, parts: Sequence["ModelCodec"]) -> "ModelCodec":
        """One codec of several fitted for the same recipe over disjoint layers (a model's groups
        of K/V layers of one shape, each fitted from its own statistics: Gemma 4's full and
        sliding layers); the first itself when there is one."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        out = cls.__new__(cls)
        out.__dict__.update(first.__dict__)
        out.codecs, out.tables = {}, {}
        for part in parts:
            if part.recipe != first.recipe or part.pre_rope_keys != first.pre_rope_keys:
                raise InvalidParameterError("codecs of different recipes do not merge")
            if set(part.codecs) & set(out.codecs):
                raise InvalidParameterError("codecs fitted for the same layers do not merge")
            out.codecs.update(part.codecs)
            for stream, tables in part.tables.items():
                out.tables.setdefault(stream, {}).update(tables)
        out.model_bytes = sum(c.model_bytes for c in out.codecs.values())
        return out

    @property
    def layers(self) -> Tuple[int, ...]:
        """The model's layer indices the codecs were fitted for (its K/V layers)."""
        return tuple(sorted({k[1] for k in self.codecs}))

    def check_model(self, model: Any) -> "ModelCodec":
        """Itself when its codecs fit ``model`` (whole groups of its K/V layers of one shape,
        :meth:`~kakeyaturbo.families.ModelLayout.shape_groups`, the calibration group among
        them, with their kv-heads and head_dim; and where a codec file recorded one, the model's
        type and the fingerprint of its attention weights); ModelMismatchError saying what
        differs otherwise."""
        from ..families import describe

        where = f"codec file {str(self.path)!r}" if self.path else "the codec"
        layout = describe(model)
        groups = layout.shape_groups()
        mine = set(self.layers)
        extra = sorted(mine - set(layout.kv_layers))
        if extra:
            raise ModelMismatchError(f"{where} holds layers {extra}, which the model ({layout.model_type!r}) "
                                     f"has no K/V rows for (its K/V layers: {list(layout.kv_layers)})")
        for n, (layers, (_, kv, d)) in enumerate(groups):
            if n and not mine & set(layers):
                continue  # another shape's layers left raw (Gemma 4's sliding ones)
            dv = layout.layers[layers[0]].v_dim or d  # multi-head latent attention: another width
            kw, vw = self._width(layers, "k"), self._width(layers, "v")
            have = (_span(tuple(sorted(mine & set(layers)))), self._heads(layers), kw if kw is not None else vw)
            want = (_span(layers), kv, d if kw is not None else dv)
            if have == want and kw is not None and vw is not None and vw != dv:
                have, want = have + (vw,), want + (dv,)  # the values' width too
            if have != want:
                raise ModelMismatchError(f"{where} holds (layers, kv-heads, head_dim) = {have}, but the "
                                         f"model ({layout.model_type!r}) has {want}")
        if self.model_info is not None:
            if self.model_info["type"] != layout.model_type:
                raise ModelMismatchError(f"{where} was fitted for a {self.model_info['type']!r} model, "
                                         f"not {layout.model_type!r}")
            got = fingerprint(model)
            if got != self.model_info["fingerprint"]:
                raise ModelMismatchError(
                    f"{where} was fitted for another model: fingerprint of the attention weights "
                    f"{self.model_info['fingerprint']} in the file, {got} for this model")
        return self

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

    def encode_blocks(self, stream: str, layer: int, x: np.ndarray, block_rows: int) -> List[List[List[bytes]]]:
        """Every block of ``block_rows`` rows of float32 ``x [B, H, T, D]`` (``T`` a multiple):
        the blobs ``[block][batch][head]``, each :meth:`encode`'s, in one call over the codec's
        threads (:func:`~kakeyaturbo.codec.calibrated.encode_blocks`)."""
        b, h = x.shape[:2]
        codecs = [self._codec(stream, layer, j) for j in range(h)] * b
        flat = encode_blocks(codecs, x.reshape(b * h, *x.shape[2:]), block_rows, threads=self.threads)
        return [[blobs[i * h:(i + 1) * h] for i in range(b)] for blobs in flat]

    def decode_blocks(self, stream: str, layer: int, blobs: Sequence[Sequence[Sequence[bytes]]],
                      block_rows: int) -> np.ndarray:
        """The blobs ``[block][batch][head]`` (at least one block, each of ``block_rows`` rows)
        decoded: float32 ``[B, H, blocks * block_rows, D]``, each block as :meth:`decode` gives
        it, in one call over the codec's threads (:func:`~kakeyaturbo.codec.calibrated.decode_blocks`)."""
        b, h = len(blobs[0]), len(blobs[0][0])
        codecs = [self._codec(stream, layer, j) for j in range(h)] * b
        y = decode_blocks(codecs, [[blob for row in block for blob in row] for block in blobs], block_rows,
                          threads=self.threads)
        return y.reshape(b, h, *y.shape[1:])

    def decode_blocks_into(self, stream: str, layer: int, blobs: Sequence[Sequence[Sequence[bytes]]],
                           block_rows: int, out: np.ndarray, at: int) -> None:
        """:meth:`decode_blocks` into rows ``at ..`` of ``out``, a C-contiguous float32
        ``[B, H, rows, D]`` array (:func:`~kakeyaturbo.codec.calibrated.decode_blocks_into`)."""
        b, h = len(blobs[0]), len(blobs[0][0])
        flat = _checks.out_heads(out, b, h)
        codecs = [self._codec(stream, layer, j) for j in range(h)] * b
        decode_blocks_into(codecs, [[blob for row in block for blob in row] for block in blobs], block_rows,
                           flat, at, threads=self.threads)


def _span(layers: Tuple[int, ...]) -> Any:
    """Layer indices as a count where they are ``0 .. n-1`` (a model of K/V layers only), else
    the list (a hybrid model's K/V layers), for messages and comparisons."""
    return len(layers) if list(layers) == list(range(len(layers))) else list(layers)


def is_codec_file(path: "os.PathLike[str] | str") -> bool:
    """Whether ``path`` is a file :meth:`ModelCodec.save` wrote (its metadata says so)."""
    return file_format(path) == CODEC_FORMAT
