"""Loading a causal LM (a transformers checkpoint directory or a GGUF file) offline, in a chosen
dtype."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Tuple

from ..errors import InvalidParameterError

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
    (HF_HUB_OFFLINE=1)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, resolve_dtype(dtype, path))
    p = Path(path)
    if p.is_file():
        kw = {"gguf_file": p.name}
        where = str(p.parent)
    else:
        kw, where = {}, str(p)
    tok = AutoTokenizer.from_pretrained(where, **kw)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, **kw)
    model.eval()
    return model, tok
