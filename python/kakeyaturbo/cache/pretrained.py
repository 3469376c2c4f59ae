"""The codec of a recipe for a loaded model, from a calibration file that travels with the model
(``kakeyaturbo calibrate --out FILE``): what :meth:`KakeyaCache.from_pretrained` builds on."""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple, Union

from ..calibration import Calibration, ModelCodec
from ..calibration.model_codec import is_codec_file
from ..errors import InvalidParameterError
from ..recipes import Recipe
from ..recipes import load as load_recipe
from .codecs import BlockCodec, StreamCodec, codec_for

CalibrationLike = Union[Calibration, "os.PathLike[str]", str, None]


def recipe_of(recipe: Union[Recipe, str, "os.PathLike[str]"]) -> Recipe:
    """A :class:`Recipe`, or a shipped recipe's name, or a recipe file, as a checked Recipe."""
    return recipe if isinstance(recipe, Recipe) else load_recipe(recipe)


def codec_for_model(model: Any, recipe: Union[Recipe, str, "os.PathLike[str]"],
                    calibration: CalibrationLike = None,
                    threads: Optional[int] = None) -> Tuple[StreamCodec, Recipe]:
    """``(codec, recipe)`` for a loaded ``model``: a per-block recipe's :class:`BlockCodec`, or
    a calibrated recipe's :class:`~kakeyaturbo.calibration.ModelCodec` fitted from
    ``calibration`` (a :class:`~kakeyaturbo.calibration.Calibration` or its file; default: the
    file the recipe's ``[calibration] path`` names), or loaded from it where it is a codec file
    (``ModelCodec.save``: the codecs fitted once, the same on every machine; it must have
    been fitted for this recipe and, where it records one, this model).

    Raises InvalidParameterError when a calibrated recipe has no calibration or a per-block one
    is given one, ModelMismatchError (one) when the calibration was made for another model,
    CorruptDataError naming the file when it is damaged."""
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
    if not isinstance(source, Calibration) and is_codec_file(source):
        # Codecs fitted once and saved (ModelCodec.save): the same on every machine.
        codec = ModelCodec.load(source, threads=threads)
        if codec.recipe != rec:
            raise InvalidParameterError(
                f"codec file {str(source)!r} was fitted for recipe {codec.recipe.name!r}, not "
                f"{rec.name!r} (or with other settings)")
        return codec.check_model(model), rec
    cal = source if isinstance(source, Calibration) else Calibration.load(source)
    # One codec per group of K/V layers of one shape the calibration covers (Gemma 4: full and
    # sliding layers), each fitted from its own statistics.
    (stats, sens), *groups = cal.check_model(model).all_parts(rec)
    return codec_for(rec, stats=stats, sensitivity=sens, threads=threads, groups=groups), rec
