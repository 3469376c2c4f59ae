"""Who a saved prefix's bytes belong to, codec-wise (:mod:`kakeyaturbo.cache.persist`): the
identity of the codec that coded them (a fingerprint of everything that decides its bytes) and
the codec rebuilt from what a file records."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Optional

from ..calibration import ModelCodec
from ..errors import CorruptDataError, InvalidParameterError, KakeyaError
from ..recipes import Recipe
from .codecs import STREAMS, BlockCodec, IdentityCodec, StreamCodec


def codec_identity(codec: StreamCodec) -> Dict[str, Any]:
    """``{"kind", "fingerprint", "pre_rope_keys"}`` of a codec: a SHA-256 (first 128 bits, hex)
    of everything that decides its bytes. :class:`IdentityCodec`: nothing else;
    :class:`BlockCodec`: the recipe's stream settings (each blob is self-describing);
    :class:`~kakeyaturbo.calibration.ModelCodec`: the fingerprint of every (stream, layer,
    kv-head) calibration (FORMAT.md), so a codec fitted from other statistics or another recipe
    differs. Another codec may define ``identity() -> str``. InvalidParameterError for a codec
    that cannot be identified."""
    pre = bool(getattr(codec, "pre_rope_keys", False))
    h = hashlib.sha256(f"pre_rope_keys={pre}\n".encode())
    if isinstance(codec, IdentityCodec):
        kind = "identity"
    elif isinstance(codec, BlockCodec):
        kind = "block"
        h.update(json.dumps({s: codec.params(s) for s in STREAMS}, sort_keys=True).encode())
    elif isinstance(codec, ModelCodec):
        kind = "calibrated"
        for key in sorted(codec.codecs):
            h.update(f"{key}:{codec.codecs[key].fingerprint:016x}\n".encode())
    elif callable(getattr(codec, "identity", None)):
        kind = f"custom:{type(codec).__qualname__}"
        h.update(str(codec.identity()).encode())
    else:
        raise InvalidParameterError(
            f"cannot save a prefix coded by {codec!r}: give the codec an identity() method "
            "(a string that changes whenever its bytes would)")
    h.update(kind.encode())
    return {"kind": kind, "fingerprint": h.hexdigest()[:32], "pre_rope_keys": pre}


def recipe_json(recipe: Optional[Recipe]) -> Optional[Dict[str, Any]]:
    return None if recipe is None else recipe.as_dict()


def codec_from_file(header: Dict[str, Any], where: str, model: Any, calibration: Any,
                     threads: Optional[int], codec_for_model: Any) -> StreamCodec:
    """The codec of a file's header (``kind``, ``recipe``): the identity codec, a per-block one,
    or a calibrated one fitted by ``codec_for_model`` from ``calibration`` (or the recipe's
    ``[calibration] path``); InvalidParameterError where none can be built."""
    kind = header["codec"]["kind"]
    pre = bool(header["codec"].get("pre_rope_keys", False))
    if kind == "identity":
        return IdentityCodec(pre_rope_keys=pre)
    rj = header.get("recipe")
    if rj is None:
        raise InvalidParameterError(f"{where} was coded by a {kind} codec without a recipe: pass codec=")
    try:
        recipe = Recipe(**rj)
    except (TypeError, KakeyaError) as e:
        raise CorruptDataError(f"{where}: its recipe does not load ({e})") from None
    if kind == "block":
        return BlockCodec(recipe, pre_rope_keys=pre, threads=threads)
    if recipe.mode == "calibrated" and calibration is None and not recipe.calibration.path:
        raise InvalidParameterError(
            f"{where} was coded by the calibrated recipe {recipe.name!r}: pass calibration=FILE (the "
            "calibration the cache was built from) or codec=")
    return codec_for_model(model, recipe, calibration, threads)[0]
