"""``copy.deepcopy`` of a cache, transformers' way to reuse a prompt's cache for several
continuations: before 2026-12-06 it raised TypeError (the codec's Rust object could not be
pickled). And a cache's refusal to be pickled, which names the way to disk."""

from __future__ import annotations

import copy
import gc
import io
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import _core  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402

from .conftest import fast_codec, fast_recipe, forward, generate  # noqa: E402
from .families import VOCAB, build, family_prompt  # noqa: E402


def _tokens(t: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


def _codec(name: str, model):
    if name == "calibrated":
        return fast_codec(model, fast_recipe("before"), "before")
    return IdentityCodec(pre_rope_keys=name == "identity-before-rope")


# Full attention; full and sliding layers; a hybrid; latent attention (MLA), and MLA with an indexer
# (DeepSeek V4's compressed layers: tests/cache/test_deepseek_v4.py).
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_next", "deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize("codec", ["calibrated", "identity-before-rope", "identity"])
def test_a_deep_copy_continues_as_the_original_and_apart_from_it(family, codec) -> None:
    """The copy continues with the original's logits, and what either takes after the copy
    leaves the other as it was: the original continues as a cache that was never copied."""
    model = build(family)
    codec_ = _codec(codec, model)
    make = lambda: KakeyaCache(codec_, model=model, block_size=4, n_sink=1)  # noqa: E731
    prompt, a_next, b_next = family_prompt(), _tokens(5, 2), _tokens(5, 3)
    a, twin = make(), make()
    forward(model, prompt, a)
    forward(model, prompt, twin)
    b = copy.deepcopy(a)
    assert b.codec is a.codec and b.fast == a.fast and b.get_seq_length() == a.get_seq_length()
    assert any(getattr(layer, "num_sealed", lambda: 0)() for layer in b.layers)
    assert torch.equal(forward(model, b_next, b), forward(model, b_next, twin))
    twin = make()
    forward(model, prompt, twin)
    # The copy took five tokens; the original continues as the twin that took none.
    assert torch.equal(forward(model, a_next, a), forward(model, a_next, twin))
    if codec == "calibrated" and family == "llama":
        assert b.fast
        assert b.layers[0].codes() is not a.layers[0].codes()


def test_copies_of_a_prompts_cache_generate_as_the_prompts_cache() -> None:
    """transformers' recipe: prefill a prompt once, then ``generate`` from a deep copy of its
    cache for each continuation; each copy generates what the prompt's cache itself would, and
    keeps doing so once the original is gone (its model hooks are its own)."""
    model = build("llama")
    codec = _codec("calibrated", model)
    prompt = family_prompt()
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    forward(model, prompt, cache)
    copies = [copy.deepcopy(cache) for _ in range(2)]
    ids = torch.cat([prompt, _tokens(3, 7)], dim=1)
    want = generate(model, ids, cache, n=6)
    del cache
    gc.collect()
    for c in copies:
        got = generate(model, ids, c, n=6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_layer_codes_copy_apart_and_codecs_copy_as_themselves() -> None:
    """The Rust objects: a frozen codec's copy is the codec; a LayerCodes' copy holds the same
    blocks, and selecting its batch rows leaves the original's."""
    model = build("llama")
    cache = KakeyaCache(_codec("calibrated", model), model=model, block_size=4, n_sink=1)
    forward(model, family_prompt(), cache)
    codes = cache.layers[0].codes()
    c = copy.deepcopy(codes)
    assert type(c) is type(codes) and c.nbytes == codes.nbytes and c.rows() == codes.rows()
    c.select([0, 0])
    assert (c.batch, codes.batch) == (2, 1)
    eye = np.eye(4, dtype=np.float32)
    rust = _core.CalibratedCodec(np.zeros(4, np.float32), eye, eye, np.ones(4, np.float32),
                                 np.full(4, 3, np.uint8), 1, "mse", True)
    assert copy.deepcopy(rust) is rust and copy.copy(rust) is rust


def test_a_cache_refuses_pickle_and_names_save() -> None:
    """``pickle.dumps(cache)`` and ``torch.save(cache, f)`` are a TypeError naming ``cache.save``
    (they were an AttributeError about a local function); ``copy.copy`` is a shallow copy."""
    model = build("llama")
    cache = KakeyaCache(_codec("calibrated", model), model=model, block_size=4, n_sink=1)
    forward(model, family_prompt(), cache)
    for dump in (pickle.dumps, lambda c: torch.save(c, io.BytesIO())):
        with pytest.raises(TypeError, match=r"cache\.save\(path\)"):
            dump(cache)
    shallow = copy.copy(cache)
    assert shallow is not cache and shallow.layers is cache.layers
