"""Tiny random-weight Llama and Qwen2 models (no download) and helpers shared by the cache tests."""

from __future__ import annotations

import inspect
import struct
import zlib

import numpy as np
import pytest
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.errors import KakeyaError  # noqa: E402

VOCAB, LAYERS, KV_HEADS = 97, 3, 2


def build(kind: str, head_dim: int = 16):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=4 * head_dim, intermediate_size=128,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=512)
    if kind == "qwen2":  # q/k/v projections with bias
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=head_dim, **common)).eval()


@pytest.fixture(scope="module")
def llama():
    return build("llama")


@pytest.fixture(scope="module")
def llama_calibration(llama, tmp_path_factory):
    """A calibration file of ``llama`` on random tokens, with the statistics and sensitivity it
    holds: ``(path, stats, sensitivity)``."""
    from kakeyaturbo import calibration

    g = np.random.default_rng(0)
    wins = [list(g.integers(0, VOCAB, 48)) for _ in range(3)]
    stats = calibration.collect(llama, wins, n_sink=1, samples=8)
    sens = calibration.collect_sensitivity(llama, wins, n_sink=1, score=16)
    cal = calibration.Calibration.for_model(llama, stats, sens, {"text": "random tokens"})
    return cal.save(tmp_path_factory.mktemp("cal") / "llama.kkcal"), stats, sens


@pytest.fixture(scope="module")
def qwen2():
    return build("qwen2")


@pytest.fixture(scope="module")
def llama32():
    return build("llama", head_dim=32)


def cache_kw(model) -> str:
    """transformers 5.24 renamed `past_key_values=` to `cache=`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate(model, ids, cache, n: int = 24, **kw):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0,
                         **{cache_kw(model): cache}, **kw)
    return out.sequences, torch.stack(out.logits)


def saved_and_loaded_go_on_alike(model, codec, cache, more, path, n: int):
    """Saves ``cache`` to ``path`` (a save ends past recording: checked), loads it, and checks that
    the two generate ``n`` tokens after ``more`` alike, bit for bit. Returns the loaded cache."""
    cache.save(path)
    assert not any(getattr(layer, "record_past", False) for layer in cache.layers)
    loaded = KakeyaCache.load(path, model, codec)
    runs = [generate(model, more, c, n=n) for c in (cache, loaded)]
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)
    return loaded


def forward(model, ids, cache):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{cache_kw(model): cache}).logits


def prompt(batch: int = 1, t: int = 21, seed: int = 1):
    return torch.randint(0, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


class Spy(IdentityCodec):
    """An exact codec that records what it is handed."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen = []

    def encode(self, stream, layer, head, x):
        self.seen.append((stream, layer, head, x.copy()))
        return super().encode(stream, layer, head, x)


class Zero(IdentityCodec):
    """Decodes every row to zero (to make the effect of coding visible)."""

    def decode(self, stream, layer, head, blob):
        return np.zeros_like(super().decode(stream, layer, head, blob))


def filled(model, batch: int = 1, t: int = 40):
    cache = transformers.DynamicCache(config=model.config)
    forward(model, prompt(batch=batch, t=t), cache)
    return cache, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def fast_recipe(rope: str = "after", **extra) -> "recipes.Recipe":
    """The calibrated recipe of the fast-path tests, without sensitivity: K at 4 bits
    (query-whitened, coded before or after RoPE), V at 3 (output-whitened, not centred), one raw
    sink row; ``extra`` settings go to both streams."""
    return recipes.Recipe(name=f"test-rope{rope}", mode="calibrated", n_sink=1,
                          k=dict(rope=rope, bits=4, whiten="query", **extra),
                          v=dict(bits=3, whiten="output", center=False, **extra))


def fast_codec(model, rec, rope: str = "after") -> "calibration.ModelCodec":
    """``rec`` calibrated on ``model`` (uniform statistics of three random windows of 40 tokens,
    keys collected ``rope`` RoPE): the codec of the fast-path tests."""
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, VOCAB, 40)) for _ in range(3)]
    stats = calibration.collect(model, wins, n_sink=1, samples=32, weighting="uniform", rope=rope)
    return calibration.ModelCodec(stats, rec)


def damaged_loads_or_refuses(raw: bytes, data, where, values, path, load) -> None:
    """Up to four bytes of a saved file ``raw`` at offsets drawn from ``where`` set to values drawn
    from ``values`` (hypothesis strategies, ``data`` the test's ``st.data()``), the checksum
    recomputed, written to ``path``: ``load(path)`` loads it or raises a KakeyaError; nothing else
    escapes."""
    raw = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(where)] = data.draw(values)
    struct.pack_into("<I", raw, len(raw) - 4, zlib.crc32(bytes(raw[:-4])))
    path.write_bytes(bytes(raw))
    try:
        load(path)
    except KakeyaError:
        pass
