"""Loading a causal LM offline from a checkpoint directory (a tiny saved model, no download)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from kakeyaturbo.eval import model  # noqa: E402


def test_loads_a_checkpoint_directory_in_float32_offline(tiny_model_dir) -> None:
    m, tok = model.load(tiny_model_dir)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert not m.training
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert tok.bos_token_id == 0 and m.config.num_hidden_layers == 2
    ids = tok.encode("some words", add_special_tokens=False)
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([[tok.bos_token_id] + ids])).logits
    assert logits.shape == (1, len(ids) + 1, len(tok))
