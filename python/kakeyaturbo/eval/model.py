"""Loading a causal LM (a transformers checkpoint directory or a GGUF file) offline, in a chosen
dtype."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Tuple

from ..errors import (CorruptDataError, InvalidParameterError, KakeyaError, ModelMismatchError,
                      UnsupportedModelError)

#: What ``--dtype`` takes. ``auto``: the dtype the checkpoint stores where the CPU computes in it
#: (bfloat16 or float32; float16 checkpoints load as float32, GGUF files are de-quantised to
#: float32). The default, ``float32``, is what every published figure was measured in.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def stored_dtype(path: "str | os.PathLike[str]") -> str:
    """The dtype a checkpoint directory's ``config.json`` records (``dtype``, or
    ``torch_dtype`` in older files), ``"float32"`` when it records none or for a GGUF file."""
    p = Path(path)
    cfg = p / "config.json"
    if p.is_file() or not cfg.is_file():
        return "float32"
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "float32"
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else {}
    for d in (doc, text):
        for key in ("dtype", "torch_dtype"):
            if isinstance(d.get(key), str):
                return str(d[key])
    return "float32"


def resolve_dtype(dtype: str, path: "str | os.PathLike[str]") -> str:
    """The concrete dtype name ``dtype`` means for the checkpoint at ``path``."""
    if dtype not in DTYPES:
        raise InvalidParameterError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    stored = stored_dtype(path)
    return stored if stored in ("bfloat16", "float32") else "float32"


def load(path: "str | os.PathLike[str]", dtype: str = "float32") -> Tuple[Any, Any]:
    """(model, tokenizer) on the CPU, from a model directory (safetensors) or a GGUF file, in
    ``dtype`` (:data:`DTYPES`; see :func:`resolve_dtype`). Never reaches a hub
    (HF_HUB_OFFLINE=1).

    A GGUF file's model and tokenizer come from the file alone, never from files beside it.
    Raises :class:`~kakeyaturbo.errors.CorruptDataError` for a GGUF file that cannot be read or a
    checkpoint that lacks weights its config describes,
    :class:`~kakeyaturbo.errors.UnsupportedModelError` for a model type transformers does not know
    or cannot load as a causal LM, and :class:`~kakeyaturbo.errors.ModelMismatchError` for a
    tokenizer with more tokens than the model's vocabulary."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch_dtype = getattr(torch, resolve_dtype(dtype, path))
    p = Path(path)
    if p.is_file():
        what = f"GGUF file '{p}'"
        model, tok = _load_gguf(p, what, torch_dtype)
    else:
        what = f"checkpoint '{p}'"
        model, tok = _load_checkpoint(p, what, torch_dtype)
    _check_vocabulary(model, tok, what)
    model.eval()
    return model, tok


def _load_checkpoint(p: Path, what: str, torch_dtype: Any) -> Tuple[Any, Any]:
    from transformers import (CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig,
                              AutoModelForCausalLM, AutoTokenizer)

    try:
        config = AutoConfig.from_pretrained(str(p))
    except (ValueError, KeyError):
        kind = _model_type(p)
        if isinstance(kind, str) and kind not in CONFIG_MAPPING:
            raise UnsupportedModelError(
                f"{what} has model type {kind[:60]!r}, which transformers does not know") from None
        raise
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModelError(
            f"{what} holds a {config.model_type!r} model, which is not a causal LM "
            f"transformers can load") from None
    tok = AutoTokenizer.from_pretrained(str(p))
    model = _weights(AutoModelForCausalLM, str(p), what, "its config.json", config=config,
                     dtype=torch_dtype)
    return model, tok


def _load_gguf(p: Path, what: str, torch_dtype: Any) -> Tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _alone(p) as link:
        where, name = str(link.parent), link.name
        try:
            tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
            model = _weights(AutoModelForCausalLM, where, what, "its metadata", gguf_file=name,
                             dtype=torch_dtype)
        except KakeyaError:
            raise
        except (struct.error, ValueError, OSError, EOFError, IndexError, KeyError,
                NotImplementedError) as e:
            raise _gguf_error(e, p, link) from e
    # Nothing is to point at the private folder, which is gone.
    tok.name_or_path = str(p)
    model.config._name_or_path = str(p)
    return model, tok


@contextmanager
def _alone(p: Path) -> Iterator[Path]:
    """The GGUF file ``p`` as the only file of a private temporary folder (a symbolic link to it,
    or a copy where links cannot be made), removed afterwards: transformers reads a
    ``tokenizer.json``, ``tokenizer_config.json`` or ``config.json`` beside a GGUF file before the
    file itself, so another model's files there would replace the file's own tokenizer."""
    folder = Path(tempfile.mkdtemp(prefix="kakeyaturbo-gguf-"))
    try:
        link = folder / p.name
        try:
            link.symlink_to(p.resolve())
        except (OSError, NotImplementedError):
            shutil.copyfile(p, link)
        yield link
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _weights(auto: Any, where: str, what: str, describes: str, **kw: Any) -> Any:
    """The model ``auto.from_pretrained(where, **kw)`` builds, refused where the checkpoint lacks
    weights the model needs (transformers would initialise those at random) or holds weights of
    other shapes. A tied weight (``lm_head.weight`` under ``tie_word_embeddings``) is not
    missing."""
    try:
        model, info = auto.from_pretrained(where, output_loading_info=True, **kw)
    except RuntimeError as e:
        if isinstance(e, NotImplementedError) or "ignore_mismatched_sizes" not in str(e):
            raise
        raise CorruptDataError(
            f"{what} holds weights whose shapes differ from those {describes} describes") from e
    missing = set(info.get("missing_keys") or ())
    if missing:
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        loaded = {t.data_ptr() for k, t in tensors.items() if k not in missing}
        gaps = sorted(k for k in missing if k not in tensors or tensors[k].data_ptr() not in loaded)
        if gaps:
            more = ", ..." if len(gaps) > 3 else ""
            stray = sorted(info.get("unexpected_keys") or ())
            other = (f"; it holds {len(stray)} weights the model does not use, such as {stray[0]!r}"
                     if stray else "")
            raise CorruptDataError(
                f"{what} does not hold the weights {describes} describes: {len(gaps)} missing "
                f"({', '.join(gaps[:3])}{more}){other}")
    if info.get("mismatched_keys"):
        raise CorruptDataError(
            f"{what} holds weights whose shapes differ from those {describes} describes")
    return model


def _check_vocabulary(model: Any, tok: Any, what: str) -> None:
    """Refuses a tokenizer whose vocabulary, or BOS/EOS id, lies beyond the model's embedding:
    one made for another model. (Special tokens transformers adds of its own, such as GPT-2's
    ``<|endoftext|>`` to a byte-level GGUF vocabulary that lacks it, are not counted.)"""
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        return
    size = getattr(tok, "vocab_size", None)
    size = size if isinstance(size, int) else len(tok)
    if size > vocab:
        raise ModelMismatchError(
            f"the tokenizer of {what} has {size} tokens, more than the model's vocabulary of "
            f"{vocab}: it was made for another model")
    for role, i in (("BOS", tok.bos_token_id), ("EOS", tok.eos_token_id)):
        if isinstance(i, int) and i >= vocab:
            raise ModelMismatchError(
                f"the tokenizer of {what} has {role} id {i}, beyond the model's vocabulary of "
                f"{vocab}: it was made for another model")


def _model_type(p: Path) -> Any:
    """``model_type`` of a checkpoint directory's ``config.json`` (None where unreadable)."""
    try:
        doc = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc.get("model_type") if isinstance(doc, dict) else None


#: What transformers says of a GGUF file it reads but cannot load as a causal LM.
_UNSUPPORTED = ("not supported", "Unrecognized configuration class", "does not recognize this "
                "architecture", "Cannot rebuild a config", "Cannot build a tokenizer",
                "Unknown gguf model_type")


def _gguf_error(e: BaseException, p: Path, link: Path) -> KakeyaError:
    """The typed error for ``e``, raised while transformers read the GGUF file ``p`` (at
    ``link``); the message names ``p``, never the private folder."""
    text = _named(e, p, link)
    if isinstance(e, (ValueError, NotImplementedError)) and any(s in text for s in _UNSUPPORTED):
        arch = re.search(r"models\.(\w+)\.configuration_", text)
        if arch:
            return UnsupportedModelError(
                f"GGUF file '{p}' holds a {arch.group(1)!r} model, which is not a causal LM "
                f"transformers can load")
        return UnsupportedModelError(f"GGUF file '{p}' holds a model transformers cannot load: "
                                     f"{_short(text)}")
    if isinstance(e, OSError) and "JSON" in text and e.__context__ is not None:
        e = e.__context__  # transformers words any failure parsing a config as "not valid JSON"
        text = _named(e, p, link)
    return CorruptDataError(f"GGUF file '{p}' cannot be read: {_reason(e, text, p)}")


def _named(e: BaseException, p: Path, link: Path) -> str:
    """``e``'s message on one line, naming ``p`` where it names ``link`` or its folder."""
    text = str(e).replace(str(link), str(p)).replace(str(link.parent), str(p.parent))
    return " ".join(text.split())


def _reason(e: BaseException, text: str, p: Path) -> str:
    """What is wrong with a GGUF file, from the error reading it raised (``text``: its message)."""
    if isinstance(e, (struct.error, EOFError)):
        return "its header runs past the end of the file (truncated or damaged)"
    if "empty file" in text:
        return "the file is empty"
    if isinstance(e, UnicodeDecodeError):
        return "its header holds text that is not UTF-8 (damaged)"
    if "cannot reshape" in text or "larger dtype" in text:
        return "its tensor data runs past the end of the file (truncated or damaged)"
    if isinstance(e, (IndexError, KeyError)):
        return f"its header or tensor table is damaged ({type(e).__name__}: {_short(text, 80)})"
    if text.startswith(str(p)):
        text = "it" + text[len(str(p)):]
    return _short(text)


def _short(text: str, limit: int = 160) -> str:
    """``text`` cut to ``limit`` characters, without a final full stop (it ends a sentence)."""
    return text.rstrip(".") if len(text) <= limit else text[:limit - 3].rstrip() + "..."
