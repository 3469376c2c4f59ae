"""Library peers run through the harness on a tiny random-weight Llama, each through its own
library, and their bits are what the libraries store (checked against a hand computation)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo.eval import harness, peers  # noqa: E402

CTX, N_EVAL, LAYERS, KV, D = 48, 8, 3, 2, 16
ELEMS = 2 * LAYERS * KV * CTX * D  # K and V of the prefix over the model


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=KV, head_dim=D, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    g = np.random.default_rng(0)
    windows = [list(g.integers(0, 97, CTX + N_EVAL + 1)) for _ in range(2)]
    return model, windows


def _available(name):
    why = peers.unavailable(name)
    if why:
        pytest.skip(why)


# Hand computation, float32 model: per stream and layer 1 x 2 heads x 48 tokens x 16 = 1536
# elements = 24 groups of 64; codes at nbits each (hqq 3-bit packs 10 codes in 32 bits), a
# float32 scale and a float32 zero point per group; fp8: 8 bits and one float32 scale per tensor.
GROUPS = KV * CTX * D // 64
HAND_BITS = {
    "quanto-int4": ELEMS * 4 + 2 * LAYERS * GROUPS * 64,
    "quanto-int2": ELEMS * 2 + 2 * LAYERS * GROUPS * 64,
    "hqq-int4": ELEMS * 4 + 2 * LAYERS * GROUPS * 64,
    "hqq-int3": 2 * LAYERS * (64 // 10 + 1) * 32 * GROUPS + 2 * LAYERS * GROUPS * 64,
    "hqq-int2": ELEMS * 2 + 2 * LAYERS * GROUPS * 64,
    "hf-fp8": ELEMS * 8 + 2 * LAYERS * 32,
}


@pytest.mark.parametrize("name", list(peers.PEERS))
def test_peer_bits_are_what_the_library_stores(tiny, name) -> None:
    _available(name)
    model, windows = tiny
    res = harness.evaluate(model, windows, CTX, [harness.peer_method(name)])[name]
    assert res["kind"] == "peer" and res["impl"].startswith("transformers ")
    assert res["bits_per_element"] == pytest.approx(HAND_BITS[name] / ELEMS, rel=1e-12)
    assert res["tokens"] == 2 * N_EVAL
    assert res["kl"] > 0.0  # the library really quantised the prefix


def test_peer_runs_the_library_code_path(tiny) -> None:
    """Filling the library's cache through its update equals prefilling through the model with
    that cache: the same quantised states, the same continuation logits."""
    name = "quanto-int4"
    _available(name)
    model, windows = tiny
    ids = torch.tensor([windows[0]])
    peer = peers.get(name)
    with torch.no_grad():
        direct = peers.make_cache(peer, model.config)
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        model(input_ids=ids[:, :CTX], use_cache=True, **{key: direct})
        _, prefilled = harness._forward(model, ids[:, :CTX])
        filled, bits, elems = peers.fill(peer, prefilled, model.config)
        a, _ = harness._forward(model, ids[:, CTX:-1], direct)
        b, _ = harness._forward(model, ids[:, CTX:-1], filled)
    assert elems == ELEMS and bits == HAND_BITS[name]
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_stored_bytes_walks_tensor_subclasses_and_containers() -> None:
    t = torch.zeros(3, 5, dtype=torch.float16)
    assert peers.stored_bytes(t) == 30
    assert peers.stored_bytes((t, {"scale": torch.zeros(2), "shape": (3, 5), "nbits": 4})) == 38
    assert peers.stored_bytes(None) == 0


def test_missing_library_is_named_with_its_install_command(monkeypatch) -> None:
    monkeypatch.setattr(peers, "missing", lambda mods: [m for m in mods if m == "hqq"])
    msg = peers.unavailable("hqq-int4")
    assert msg == ("peer hqq-int4 skipped: hqq is not installed (pip install 'kakeyaturbo[eval]', "
                   "or pip install hqq==0.2.8.post1)")
    assert peers.unavailable("quanto-int4") is None


def test_sliding_window_model_is_skipped_with_a_reason() -> None:
    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, sliding_window=8)
    model = transformers.MistralForCausalLM(cfg).eval()
    why = peers.unsupported("quanto-int4", model)
    assert why is not None and "sliding-window" in why and "'mistral'" in why
    hybrid = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"])).eval()
    why = peers.unsupported("quanto-int4", hybrid)
    assert why is not None and "recurrent or convolution state" in why and "'lfm2'" in why
    assert peers.unsupported("quanto-int4", transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4)).eval()) is None


def test_peer_libraries_are_pinned_in_the_eval_extra_and_the_makefile() -> None:
    """The versions the skip message names are the ones `pip install 'kakeyaturbo[eval]'` and
    `make` (hence .ci/run on a fresh machine) install; ninja builds optimum-quanto's extension."""
    import re
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        pytest.skip("not run from a source checkout")
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["eval"]
    make = re.search(r"PIP_PINS :=(.*?)\n[^\t]", (root / "Makefile").read_text(), re.S).group(1)
    for pkg, version in dict(peers.PINS, ninja="1.13.2").items():
        assert f"{pkg}=={version}" in extra
        assert f"{pkg}=={version}" in make.split()
