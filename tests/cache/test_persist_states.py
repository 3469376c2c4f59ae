"""Saved prefixes of layers that hold more than K/V rows (version-3 files, ``cache.persist_state``):
a hybrid's recurrent and convolution states (Qwen3-Next's Gated DeltaNet layers, Falcon-H1's
Mamba-2 mixer inside its attention layers, Nemotron-H's Mamba-2 and MLP-only layers) and the
indexer's keys of dynamic sparse attention (DeepSeek V3.2): the loaded cache continues as the
cache that was saved, and a file whose states do not fit the model is refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kakeyaturbo.cache import IdentityCodec, KakeyaCache, persist, persist_state  # noqa: E402
from kakeyaturbo.errors import CorruptDataError, InvalidParameterError, KakeyaError  # noqa: E402
from kakeyaturbo.families import describe  # noqa: E402

from .families import build, family_prompt  # noqa: E402
from .test_persist import _rewrite, _with_header  # noqa: E402

NAMES = ["qwen3_next", "falcon_h1", "nemotron_h", "deepseek_v32"]


def _filled(model, t: int):
    """A prompt of ``t`` tokens in a cache of the identity codec (blocks of 4) and in a
    ``DynamicCache``."""
    ids = family_prompt(t=t)
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=4, n_sink=1)
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        model(input_ids=ids, cache=ref)
    return cache, ref


@pytest.fixture(scope="module", params=NAMES)
def saved(request, tmp_path_factory):
    """``(name, model, path, reference cache)``: :func:`_filled` with 30 tokens, saved."""
    model = build(request.param)
    cache, ref = _filled(model, 30)
    path = cache.save(tmp_path_factory.mktemp("states") / f"{request.param}.kkpfx")
    return request.param, model, path, ref


def test_a_loaded_cache_continues_as_the_saved_one(saved) -> None:
    name, model, path, ref = saved
    assert struct.unpack_from("<H", path.read_bytes(), 4)[0] == 3
    header, _ = persist.read_header(path)
    held = [e["name"] for layer in header["layers"] for e in layer.get("state", [])]
    assert held and all(n.split(".")[0] in ("conv", "recurrent", "indexer_keys") for n in held)
    loaded = KakeyaCache.load(path, model)
    nxt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        got = model(input_ids=nxt, cache=loaded).logits
        want = model(input_ids=nxt, cache=ref).logits
    assert torch.equal(got, want)
    assert loaded.memory()["state"] + loaded.memory()["indexer"] > 0


def _first_state(header):
    return next(e for layer in header["layers"] for e in layer.get("state", []))


def test_states_that_do_not_fit_the_model_are_refused(saved, tmp_path) -> None:
    _, model, path, _ = saved
    bad = tmp_path / "bad.kkpfx"

    def renamed(h):
        _first_state(h)["name"] = "recurrent.7"

    def reshaped(h):
        e = _first_state(h)
        e["shape"] = e["shape"][:-1] + [e["shape"][-1] + 1]

    def retyped(h):
        e = _first_state(h)
        e["dtype"] = "float16"

    def flagged(h):
        next(layer for layer in h["layers"] if layer.get("state"))["flags"]["previous.9"] = True

    def dropped(h):
        next(layer for layer in h["layers"] if layer.get("state"))["state"].pop()

    for edit, match in ((renamed, "the model's layer holds"), (reshaped, "the model's layer holds"),
                        (retyped, "the model's layer holds"), (flagged, "flags"), (dropped, "the model's layer holds")):
        with pytest.raises(CorruptDataError, match=match):
            KakeyaCache.load(_with_header(path, bad, edit), model)
    with pytest.raises(CorruptDataError, match="version 2 holds no layer states"):
        KakeyaCache.load(_with_header(path, bad, lambda h: None, version=2), model)
    for edit in (lambda h: _first_state(h).update(name=3), lambda h: _first_state(h).update(shape=[-1]),
                 lambda h: _first_state(h).update(dtype="int8")):
        with pytest.raises(CorruptDataError, match="header is inconsistent"):
            KakeyaCache.load(_with_header(path, bad, edit), model)


def test_damage_under_a_recomputed_checksum_is_a_kakeya_error(saved, tmp_path) -> None:
    _, model, path, _ = saved
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack_from("<I", data, 8)
    body = range(12 + hlen, len(data) - 4)
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.kkpfx"
    for _ in range(25):
        d = bytearray(data)
        for at in rng.choice(body, size=3, replace=False):
            d[at] ^= int(rng.integers(1, 256))
        try:
            KakeyaCache.load(_rewrite(bad, bytes(d)), model)
        except KakeyaError:
            pass


def test_a_state_holding_nan_is_refused(tmp_path) -> None:
    model = build("qwen3_next")
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=4)
    with torch.no_grad():
        model(input_ids=family_prompt(t=12), cache=cache)
    cache.layers[0].recurrent_states[0].view(-1)[3] = float("nan")
    path = cache.save(tmp_path / "nan.kkpfx")
    with pytest.raises(CorruptDataError, match="NaN"):
        KakeyaCache.load(path, model)


def test_a_cache_checking_a_draft_is_not_saved(tmp_path) -> None:
    """A hybrid's cache with a draft's rows taken and no crop yet is refused; recording the past
    with nothing taken since is no draft: the save ends the recording, the linear layers' too."""
    model = build("qwen3_next")
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=4)
    with torch.no_grad():
        model(input_ids=family_prompt(t=12), cache=cache)
        cache.activate_past_recording(recurrent_states_to_keep=2)
        model(input_ids=family_prompt(t=2, seed=2), cache=cache)
    with pytest.raises(InvalidParameterError, match="checks a draft"):
        cache.save(tmp_path / "p.kkpfx")
    assert not (tmp_path / "p.kkpfx").exists()
    cache.crop(-1)
    cache.save(tmp_path / "p.kkpfx")
    assert not any(layer.record_past for layer in cache.layers)


#: Every family of ``families.py`` / ``families_latent.py`` whose cache layers hold states beyond
#: K/V rows (hybrids) or an indexer's keys (dynamic sparse attention).
HELD = ["axk2", "bailing_hybrid", "bamba", "deepseek_v32", "dots3_note_text", "falcon_h1", "glm_moe_dsa",
        "granitemoehybrid", "hy_v4", "inkling2_text", "inkling_text", "jamba", "kimi_linear", "lara_mini", "lfm2",
        "lfm2_moe", "lfm3", "nemotron_h", "olmo_hybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
        "qwen4_exp_text", "zaya"]


@pytest.mark.parametrize("name", HELD)
def test_every_family_with_states_continues_from_a_file(name, tmp_path) -> None:
    model = build(name)
    assert persist_state.holds_states(describe(model))
    cache, ref = _filled(model, 24)
    loaded = KakeyaCache.load(cache.save(tmp_path / f"{name}.kkpfx"), model)
    nxt = torch.tensor([[5, 6]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=nxt, cache=loaded).logits, model(input_ids=nxt, cache=ref).logits)


def test_a_state_of_a_dtype_no_file_holds_is_refused_on_saving(tmp_path) -> None:
    model = build("qwen3_next")
    cache = KakeyaCache(IdentityCodec(), model=model, block_size=4)
    with torch.no_grad():
        model(input_ids=family_prompt(t=12), cache=cache)
    cache.layers[0].recurrent_states[0] = cache.layers[0].recurrent_states[0].double()
    with pytest.raises(InvalidParameterError, match="cannot save state 'recurrent.0' of dtype torch.float64"):
        cache.save(tmp_path / "f64.kkpfx")
    assert not (tmp_path / "f64.kkpfx").exists()
