"""The codec of a recipe for a loaded model, from a calibration file that travels with the model
(``kakeyaturbo calibrate --out FILE``): what :meth:`KakeyaCache.from_pretrained` builds on."""

from __future__ import annotations

import os
import weakref
from typing import Any, Optional, Tuple, Union

from ..calibration import Calibration, ModelCodec
from ..calibration.model_codec import is_codec_file
from ..errors import InvalidParameterError
from ..recipes import Recipe
from ..recipes import load as load_recipe
from .codecs import BlockCodec, StreamCodec, codec_for

CalibrationLike = Union[Calibration, ModelCodec, "os.PathLike[str]", str, None]

#: Calibrated codecs already checked against a model (:func:`check_codec_model`): the codec ->
#: the model, both weakly, so that a cache built by :func:`codec_for_model` does not hash the
#: model's attention weights twice.
_CHECKED: "weakref.WeakKeyDictionary[ModelCodec, Any]" = weakref.WeakKeyDictionary()


def recipe_of(recipe: Union[Recipe, str, "os.PathLike[str]"]) -> Recipe:
    """A :class:`Recipe`, or a shipped recipe's name, or a recipe file, as a checked Recipe."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, (str, os.PathLike)):
        raise TypeError(f"recipe must be a Recipe, a shipped recipe name or a path, got {type(recipe).__name__}")
    return load_recipe(recipe)


def check_codec_model(codec: Any, model: Any) -> None:
    """ModelMismatchError when ``codec`` is a calibrated codec made for another model than
    ``model`` (:meth:`ModelCodec.check_model`: layers, kv-heads, head_dim, and the weights'
    fingerprint where a codec file recorded it); other codecs are not tied to a model."""
    if not isinstance(codec, ModelCodec):
        return
    seen = _CHECKED.get(codec)
    if seen is not None and seen() is model:
        return
    codec.check_model(model)
    _CHECKED[codec] = weakref.ref(model)


def codec_for_model(model: Any, recipe: Union[Recipe, str, "os.PathLike[str]"],
                    calibration: CalibrationLike = None,
                    threads: Optional[int] = None) -> Tuple[StreamCodec, Recipe]:
    """``(codec, recipe)`` for a loaded ``model``: a per-block recipe's :class:`BlockCodec`, or
    a calibrated recipe's :class:`~kakeyaturbo.calibration.ModelCodec` fitted from
    ``calibration`` (a :class:`~kakeyaturbo.calibration.Calibration` or its file; default: the
    file the recipe's ``[calibration] path`` names), or loaded from it where it is a codec file
    (``ModelCodec.save``: the codecs fitted once, the same on every machine; it must have
    been fitted for this recipe and, where it records one, this model), or that
    :class:`~kakeyaturbo.calibration.ModelCodec` itself (checked alike).

    Raises TypeError for a ``model`` of None or a ``recipe`` / ``calibration`` of another type.

    Raises InvalidParameterError when a calibrated recipe has no calibration or a per-block one
    is given one, ModelMismatchError (one) when the calibration was made for another model,
    CorruptDataError naming the file when it is damaged."""
    if model is None:
        raise TypeError("model must be a loaded transformers model, got None")
    if not isinstance(calibration, (Calibration, ModelCodec, str, os.PathLike, type(None))):
        raise TypeError(f"calibration must be a Calibration, a ModelCodec, a calibration or codec file path, "
                        f"or None, got {type(calibration).__name__}")
    rec = recipe_of(recipe)
    if rec.mode == "block":
        if calibration is not None:
            raise InvalidParameterError(f"recipe {rec.name!r} is per-block: it takes no calibration")
        return BlockCodec(rec, threads=threads), rec
    source = calibration if calibration is not None else rec.calibration.path
    if source is None:
        raise InvalidParameterError(
            f"recipe {rec.name!r} is calibrated: pass calibration=FILE (written by "
            "`kakeyaturbo calibrate --out FILE` for this model)")
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        raise InvalidParameterError(f"calibration {os.fspath(source)!r} is a directory, not a calibration or "
                                    "codec file")
    if isinstance(source, ModelCodec):
        if source.recipe != rec:
            raise InvalidParameterError(f"the codec given as calibration was fitted for recipe "
                                        f"{source.recipe.name!r}, not {rec.name!r} (or with other settings)")
        check_codec_model(source, model)
        return source, rec
    if not isinstance(source, Calibration) and is_codec_file(source):
        # Codecs fitted once and saved (ModelCodec.save): the same on every machine.
        codec = ModelCodec.load(source, threads=threads)
        if codec.recipe != rec:
            raise InvalidParameterError(
                f"codec file {str(source)!r} was fitted for recipe {codec.recipe.name!r}, not "
                f"{rec.name!r} (or with other settings)")
        check_codec_model(codec, model)
        return codec, rec
    cal = source if isinstance(source, Calibration) else Calibration.load(source)
    # One codec per group of K/V layers of one shape the calibration covers (Gemma 4: full and
    # sliding layers), each fitted from its own statistics.
    (stats, sens), *groups = cal.check_model(model).all_parts(rec)
    codec = codec_for(rec, stats=stats, sensitivity=sens, threads=threads, groups=groups)
    if isinstance(codec, ModelCodec):  # fitted from the calibration just checked against the model
        _CHECKED[codec] = weakref.ref(model)
    return codec, rec
