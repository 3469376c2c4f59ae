"""Loading a causal LM (a directory or a GGUF file) offline, and the prefix cache it fills."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Tuple


def load(path: "str | os.PathLike[str]") -> Tuple[Any, Any]:
    """(model, tokenizer) in float32 on the CPU, from a model directory or a GGUF file.
    Never reaches a hub (HF_HUB_OFFLINE=1)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if p.is_file():
        kw = {"gguf_file": p.name}
        where = str(p.parent)
    else:
        kw, where = {}, str(p)
    tok = AutoTokenizer.from_pretrained(where, **kw)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
    model.eval()
    return model, tok

