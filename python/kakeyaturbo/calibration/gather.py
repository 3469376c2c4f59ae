"""The statistics a calibrated recipe needs, for a loaded model: from the file the recipe names,
from the cache, or collected on the calibration split of a corpus (and then cached).

The corpus is the one the caller names (``--calibration-text``), else the recipe's
``[calibration] corpus`` (default: the shipped mixture, :mod:`.mixture`). A mixture's statistics
are gathered per domain, cached so, and pooled (:func:`.mixture.pool_stats`). A model whose K/V
layers come in groups of two shapes (Gemma 4) has statistics per group
(:meth:`~kakeyaturbo.families.ModelLayout.shape_groups`), each cached apart
(:func:`for_recipe_groups`); the first group's keep the file names they always had."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import weakref
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from .. import assets
from ..errors import CorruptDataError, InvalidParameterError
from ..recipes import CalibrationSettings, Recipe
from . import corpus
from .bundle import Calibration, fingerprint, is_calibration_file
from .collect import collect_groups, collect_sensitivity_groups
from .mixture import pool_sensitivity, pool_stats
from .model_codec import is_codec_file
from .stats import AttentionStats, Sensitivity

Progress = Callable[[Iterable[Any]], Iterable[Any]]

#: Part of every cache key: statistics made by another collection method are not reused. "c2":
#: taken through the attention interface (after q/k norms, RoPE removed per layer), issue 13.
COLLECTION = "c2"


def _key(model_path: "os.PathLike[str] | str", text: "os.PathLike[str] | str") -> str:
    """The model and corpus part of a cache key: a model file by its stem and size (as always),
    a checkpoint directory by its name and a hash of what identifies its weights
    (:func:`_checkpoint_id`), anything else (a hub id) by its stem; the corpus by
    :func:`.corpus.key` (a file's content)."""
    mp = Path(model_path)
    if mp.is_dir():
        return f"{mp.name}-{_checkpoint_id(mp)}-{corpus.key(str(text))}"
    size = mp.stat().st_size if mp.is_file() else 0
    return f"{mp.stem}-{size}-{corpus.key(str(text))}"


#: Files of a checkpoint directory that decide its statistics: weights, their index, tokenizer.
_CHECKPOINT_FILES = ("model*.safetensors", "consolidated*.safetensors", "pytorch_model*.bin", "*.index.json",
                     "*.gguf", "tf_model.h5", "flax_model.msgpack", "tokenizer*", "vocab*", "merges.txt",
                     "special_tokens_map.json", "*.model", "*.tiktoken")


def _checkpoint_id(d: Path) -> str:
    """``d`` + 8 hex digits: SHA-256 over its ``config.json`` and the name, size and modification
    time of its weight and tokenizer files (two checkpoints of one name and shape, or one
    rewritten in place, do not share statistics; a copy whose times change collects anew)."""
    h = hashlib.sha256()
    try:
        cfg = d / "config.json"
        if cfg.is_file():
            h.update(cfg.read_bytes())
        names = sorted({f.name for pat in _CHECKPOINT_FILES for f in d.glob(pat) if f.is_file()})
        for name in names:
            st = (d / name).stat()
            h.update(f"\n{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError as e:
        raise InvalidParameterError(f"cannot read model directory {str(d)!r}: {e.strerror or e}") from None
    return "d" + h.hexdigest()[:8]


def _dtype_part(dtype: str) -> str:
    name = str(dtype).replace("torch.", "")
    return "" if name == "float32" else f"-{name}"


def model_dtype(model: Any) -> str:
    """The dtype name of a loaded model's weights (``"float32"``, ``"bfloat16"``, ...)."""
    p = next(iter(model.parameters()), None)
    return "float32" if p is None else str(p.dtype).replace("torch.", "")


def _rope_part(rope: str) -> str:
    return "" if rope == "before" else f"-rope{rope}"


def _labels_part(labels: str) -> str:
    return "" if labels == "text" else f"-labels{labels}"


Layers = Optional[Sequence[int]]


def _layers_part(layers: Layers) -> str:
    """Names a group of K/V layers other than the calibration group (None), by its size and a
    checksum of its indices."""
    if layers is None:
        return ""
    idx = [int(i) for i in layers]
    return f"-layers{len(idx)}x{zlib.crc32(','.join(map(str, idx)).encode()):08x}"


def stats_path(model_path: "os.PathLike[str] | str", text_path: "os.PathLike[str] | str",
               settings: CalibrationSettings, dtype: str = "float32", rope: str = "before",
               layers: Layers = None) -> Path:
    """Where :func:`cached_stats` keeps the statistics of a (model, corpus, settings, dtype, side
    of RoPE the keys are taken on, group of layers: None for the calibration group); a mixture's
    are kept per domain, this names its pooled file (what ``calibrate`` writes)."""
    key = (f"{_key(model_path, text_path)}-{settings.windows}x{settings.window}-"
           f"{settings.weighting}{_dtype_part(dtype)}{_rope_part(rope)}{_layers_part(layers)}-{COLLECTION}")
    return assets.CACHE / "calibration" / f"{key}.safetensors"


def sensitivity_path(model_path: "os.PathLike[str] | str", text_path: "os.PathLike[str] | str",
                     settings: CalibrationSettings, n_sink: int, dtype: str = "float32",
                     rope: str = "before", layers: Layers = None) -> Path:
    """Where :func:`cached_sensitivity` keeps the sensitivity of a (model, corpus, settings, dtype,
    side of RoPE, group of layers)."""
    key = (f"{_key(model_path, text_path)}-{settings.sensitivity_windows}x{settings.window}-"
           f"score{settings.score}{_labels_part(settings.labels)}-sink{n_sink}"
           f"{_dtype_part(dtype)}{_rope_part(rope)}{_layers_part(layers)}-"
           f"{COLLECTION}-sensitivity")
    return assets.CACHE / "calibration" / f"{key}.safetensors"


def _meta(model_path: "os.PathLike[str] | str", text: "os.PathLike[str] | str") -> dict:
    return {"model": Path(model_path).name, **corpus.meta(str(text))}


def _text(text: "os.PathLike[str] | str | None", settings: CalibrationSettings) -> str:
    return corpus.check_spec(settings.corpus if text is None else text)


def cached_stats(model: Any, tok: Any, model_path: "os.PathLike[str] | str",
                 text_path: "os.PathLike[str] | str | None", settings: CalibrationSettings, *,
                 n_sink: int = 1, samples: int = 512,
                 progress: Progress = lambda it: it, rope: str = "before",
                 layers: Layers = None) -> AttentionStats:
    """The statistics a recipe's ``[calibration]`` asks for: its ``path`` if given, else the
    cached file for this model, corpus (``text_path``; None: ``settings.corpus``), settings and
    group of layers (``layers``, one of the model's shape groups; None: the calibration group),
    collected (and cached) when missing; a mixture's per domain, pooled."""
    return _cached(model, tok, model_path, text_path, settings, [layers], n_sink=n_sink,
                   samples=samples, progress=progress, rope=rope, kind="statistics")[0]


def cached_sensitivity(model: Any, tok: Any, model_path: "os.PathLike[str] | str",
                       text_path: "os.PathLike[str] | str | None", settings: CalibrationSettings,
                       *, n_sink: int = 1, progress: Progress = lambda it: it,
                       rope: str = "before", layers: Layers = None) -> Sensitivity:
    """The :class:`Sensitivity` a recipe's ``[calibration]`` asks for: its
    ``sensitivity_path`` if given, else the cached file for this model, corpus, settings and
    group of layers (as :func:`cached_stats`), gathered (and cached) on the calibration split
    when missing; a mixture's per domain, pooled."""
    return _cached(model, tok, model_path, text_path, settings, [layers], n_sink=n_sink,
                   progress=progress, rope=rope, kind="sensitivity")[0]


def _cached(model: Any, tok: Any, model_path: "os.PathLike[str] | str",
            text_path: "os.PathLike[str] | str | None", settings: CalibrationSettings,
            groups: List[Layers], *, n_sink: int, progress: Progress, rope: str, kind: str,
            samples: int = 512) -> List[Any]:
    """:func:`cached_stats` (``kind`` ``"statistics"``) or :func:`cached_sensitivity`
    (``"sensitivity"``) of several groups of layers, in order: the groups missing from the cache
    collected in one pass over the windows (:func:`.collect.collect_groups`)."""
    stats = kind == "statistics"
    named = settings.path if stats else settings.sensitivity_path
    if named:
        if groups != [None]:
            raise InvalidParameterError(f"a recipe naming its {kind} file ({named!r}) has them for the "
                                        "calibration group of layers only")
        return [(AttentionStats if stats else Sensitivity).load(named)]
    text = _text(text_path, settings)
    n_windows = settings.windows if stats else settings.sensitivity_windows
    if corpus.is_mixture(text):
        parts = [(_cached(model, tok, model_path, d,
                          replace(settings, windows=c) if stats else replace(settings, sensitivity_windows=c),
                          groups, n_sink=n_sink, samples=samples, progress=progress, rope=rope, kind=kind), c)
                 for d, c in corpus.composition(text, n_windows, tok)]
        meta = {"text": text, "corpus_key": corpus.key(text), "rope": rope}
        out = []
        for n in range(len(groups)):
            got = [(part[n], c) for part, c in parts]
            if stats:
                out.append(pool_stats(got, meta=dict(meta, composition=[[st.meta.get("text"), c]
                                                                         for st, c in got])))
            else:
                out.append(pool_sensitivity(got, meta=meta))
        return out
    dtype = model_dtype(model)
    paths = [stats_path(model_path, text, settings, dtype, rope, g) if stats
             else sensitivity_path(model_path, text, settings, n_sink, dtype, rope, g) for g in groups]
    have = {n: got for n, got in ((n, _load_entry(AttentionStats if stats else Sensitivity, p, model))
                                  for n, p in enumerate(paths)) if got is not None}
    todo = [n for n in range(len(groups)) if n not in have]
    if todo:
        wins = corpus.calibration_windows(tok, text, n_windows, settings.window)
        asked = [groups[n] for n in todo]
        if stats:
            got = collect_groups(model, wins, groups=asked, n_sink=n_sink, weighting=settings.weighting,
                                 samples=samples, progress=progress, meta=_meta(model_path, text), rope=rope)
        else:
            got = collect_sensitivity_groups(model, wins, groups=asked, n_sink=n_sink, score=settings.score,
                                             labels=settings.labels, progress=progress,
                                             meta=_meta(model_path, text), rope=rope)
        for n, one in zip(todo, got):
            one.save(paths[n])
            have[n] = one
    return [have[n] for n in range(len(groups))]


_FINGERPRINTS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _fingerprint(model: Any) -> str:
    """:func:`.bundle.fingerprint`, once per loaded model object."""
    try:
        if model not in _FINGERPRINTS:
            _FINGERPRINTS[model] = fingerprint(model)
        return _FINGERPRINTS[model]
    except TypeError:  # not weakly referable
        return fingerprint(model)


def _load_entry(cls: Any, p: Path, model: Any) -> Any:
    """A cache entry, or None when there is none, it cannot be read (an interrupted write, a
    damaged file) or it records another model's fingerprint: warned about, collected again and
    rewritten."""
    if not p.exists():
        return None
    try:
        got = cls.load(p)
    except (InvalidParameterError, CorruptDataError) as e:
        warnings.warn(f"calibration cache entry {str(p)!r} cannot be read ({e}); collecting it again",
                      UserWarning, stacklevel=3)
        return None
    fp = got.meta.get("fingerprint")
    if fp is not None and fp != _fingerprint(model):
        warnings.warn(f"calibration cache entry {str(p)!r} was made for another model (fingerprint {fp}); "
                      "collecting it again", UserWarning, stacklevel=3)
        return None
    return got


def _readable(p: Path, model: Any) -> bool:
    """Whether a cache entry is there, its header and sidecar read and it records no other
    model's fingerprint (what :func:`missing` counts as cached; the arrays are read, and
    checked, when it is used)."""
    side = p.with_name(p.name + ".json")
    if not (p.is_file() and side.is_file()):
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="np") as f:
            f.keys()
        meta = json.loads(side.read_text(encoding="utf-8"))
    except Exception:  # safetensors raises its own error type on garbage
        return False
    if not isinstance(meta, dict):
        return False
    return meta.get("fingerprint") is None or meta["fingerprint"] == _fingerprint(model)


def _groups(recipe: Recipe, model: Any, all_groups: bool) -> List[Layers]:
    """The groups of K/V layers to gather for: the calibration group (None) and, with
    ``all_groups``, the model's other groups of one shape (Gemma 4's sliding layers), unless the
    recipe names its statistics or sensitivity file (those cover one group)."""
    st = recipe.calibration
    if not all_groups or st.path or st.sensitivity_path:
        return [None]
    from ..families import describe

    return [None] + [layers for layers, _ in describe(model).shape_groups()[1:]]


def missing(recipe: Recipe, model: Any, tok: Any, model_path: "os.PathLike[str] | str",
            text_path: "os.PathLike[str] | str | None" = None, *,
            all_groups: bool = False) -> List[Tuple[str, str, int]]:
    """``[(what, corpus, windows)]`` a recipe's calibration would still have to collect (nothing
    named by a file, nothing cached): ``what`` is ``statistics`` or ``sensitivity``; with
    ``all_groups``, a corpus that any group of layers :func:`for_recipe_groups` gathers misses
    (the missing groups are collected in one pass). For announcing the cost before it is paid."""
    if recipe.mode != "calibrated":
        return []
    st = recipe.calibration
    text = _text(text_path, st)
    n_sink = max(recipe.n_sink, 1)
    dtype = model_dtype(model)
    out = []
    jobs = [("statistics", st.windows)]
    if recipe.needs_sensitivity:
        jobs.append(("sensitivity", st.sensitivity_windows))
    groups = _groups(recipe, model, all_groups)
    for what, n in jobs:
        if (st.path if what == "statistics" else st.sensitivity_path):
            continue
        for d, c in corpus.composition(text, n, tok):
            if what == "statistics":
                paths = [stats_path(model_path, d, replace(st, windows=c), dtype, recipe.key_rope, g)
                         for g in groups]
            else:
                paths = [sensitivity_path(model_path, d, replace(st, sensitivity_windows=c), n_sink, dtype,
                                          recipe.key_rope, g) for g in groups]
            if not all(_readable(p, model) for p in paths):
                out.append((what, d, c))
    return out


Pair = Tuple[Optional[AttentionStats], Optional[Sensitivity]]


def for_recipe(recipe: Recipe, model: Any, tok: Any, model_path: "os.PathLike[str] | str",
               text_path: "os.PathLike[str] | str | None" = None, *,
               progress: Callable[[str], Progress] = lambda _desc: lambda it: it) -> Pair:
    """``(stats, sensitivity)`` of a recipe for a loaded model, each from its file, the cache or
    the calibration split of a corpus: ``text_path`` (a domain, a mixture or a file) when given,
    else the recipe's ``[calibration] corpus`` (``progress(description)`` wraps the windows);
    ``(None, None)`` for a per-block recipe, no sensitivity where the recipe needs none. A
    ``[calibration] path`` naming a calibration file (``kakeyaturbo calibrate --out``) gives
    both, refused with ModelMismatchError when it was made for another model. The statistics
    cover the calibration group of K/V layers (every K/V layer where they share one shape; for
    every group, :func:`for_recipe_groups`)."""
    return _for_recipe(recipe, model, tok, model_path, text_path, progress, False)[0]


def for_recipe_groups(recipe: Recipe, model: Any, tok: Any, model_path: "os.PathLike[str] | str",
                      text_path: "os.PathLike[str] | str | None" = None, *,
                      progress: Callable[[str], Progress] = lambda _desc: lambda it: it) -> List[Pair]:
    """:func:`for_recipe` for every group of K/V layers of one shape
    (:meth:`~kakeyaturbo.families.ModelLayout.shape_groups`; one pair where the layers share a
    shape): ``[(stats, sensitivity), ...]``, the calibration group first, each group gathered and
    cached apart (Gemma 4: its full layers, then its sliding ones). A calibration file gives the
    groups it holds; a recipe naming its statistics or sensitivity file, the first group only
    (the other layers then stay raw)."""
    return _for_recipe(recipe, model, tok, model_path, text_path, progress, True)


def _for_recipe(recipe: Recipe, model: Any, tok: Any, model_path: "os.PathLike[str] | str",
                text_path: "os.PathLike[str] | str | None", progress: Callable[[str], Progress],
                all_groups: bool) -> List[Pair]:
    if recipe.mode != "calibrated":
        return [(None, None)]
    if recipe.calibration.path and is_codec_file(recipe.calibration.path):
        raise InvalidParameterError(
            f"recipe {recipe.name!r}: [calibration] path {recipe.calibration.path!r} is a codec file "
            "(ModelCodec.save); this fits codecs from statistics: name the calibration file "
            "(kakeyaturbo calibrate --out) instead, or use the codec file as it is: "
            "KakeyaCache.from_pretrained(model, recipe, calibration=FILE), kakeyaturbo eval")
    if recipe.calibration.path and is_calibration_file(recipe.calibration.path):
        # One file made by `kakeyaturbo calibrate --out`: checked against this model.
        pairs = Calibration.load(recipe.calibration.path).check_model(model).all_parts(recipe)
        return pairs if all_groups else pairs[:1]
    n_sink = max(recipe.n_sink, 1)
    rope = recipe.key_rope
    groups = _groups(recipe, model, all_groups)
    stats = _cached(model, tok, model_path, text_path, recipe.calibration, groups, n_sink=n_sink,
                    progress=progress("calibration"), rope=rope, kind="statistics")
    sens: List[Optional[Sensitivity]] = [None] * len(groups)
    if recipe.needs_sensitivity:
        sens = _cached(model, tok, model_path, text_path, recipe.calibration, groups, n_sink=n_sink,
                       progress=progress("sensitivity"), rope=rope, kind="sensitivity")
    return list(zip(stats, sens))
