"""KakeyaCache's construction checks: every setting that cannot work is refused when the cache is
built (a typed error naming the parameter), not at some later step with another library's error."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import errors  # noqa: E402
from kakeyaturbo import calibration, recipes  # noqa: E402
from kakeyaturbo.cache import BlockCodec, IdentityCodec, KakeyaCache, compress_cache  # noqa: E402
from kakeyaturbo.cache.rope import rope_for  # noqa: E402

from .conftest import VOCAB, fast_codec, fast_recipe, filled, forward, prompt  # noqa: E402


def _llama(layers: int = 3, kv: int = 2, head_dim: int = 16):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv, head_dim=head_dim,
        max_position_embeddings=512)).eval()


@pytest.fixture(scope="module")
def llama_codec(llama):
    """A calibrated codec fitted on the shared 3-layer ``llama``."""
    return fast_codec(llama, fast_recipe("before"), rope="before")


# --- D01: a calibrated codec is checked against the model ------------------------------------


def test_codec_of_another_model_is_refused(llama, llama32, llama_codec) -> None:
    two = _llama(layers=2)
    with pytest.raises(errors.ModelMismatchError, match="layers"):
        KakeyaCache(fast_codec(two, fast_recipe("before"), rope="before"), model=llama)
    with pytest.raises(errors.ModelMismatchError, match="head_dim"):
        KakeyaCache(llama_codec, model=llama32)
    with pytest.raises(errors.ModelMismatchError):
        KakeyaCache(llama_codec, model=_llama(kv=4))
    assert KakeyaCache(llama_codec, model=llama, block_size=8).fast


def test_codec_file_of_other_weights_is_refused(llama, llama_codec, tmp_path) -> None:
    path = llama_codec.save(tmp_path / "llama.kkcodec", llama)
    codec = calibration.ModelCodec.load(path)
    KakeyaCache(codec, model=llama)
    other = copy.deepcopy(llama)
    with torch.no_grad():
        other.model.layers[0].self_attn.q_proj.weight.add_(0.5)
    with pytest.raises(errors.ModelMismatchError, match="fingerprint"):
        KakeyaCache(codec, model=other)


# --- D04: num_layers -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [True, 2.5, "3", 3.0])
def test_num_layers_of_another_type_is_a_type_error(bad, llama) -> None:
    with pytest.raises(TypeError, match="num_layers"):
        KakeyaCache(IdentityCodec(), num_layers=bad)
    with pytest.raises(TypeError, match="num_layers"):
        KakeyaCache(IdentityCodec(), model=llama, num_layers=bad)


@pytest.mark.parametrize("bad", [-1, 10**6, 2**64])
def test_num_layers_out_of_range_is_refused(bad) -> None:
    with pytest.raises(kt.InvalidParameterError, match="num_layers"):
        KakeyaCache(IdentityCodec(), num_layers=bad, boundary=[-1] if bad == -1 else ())


# --- D05 / D13: bools are bools, codecs are instances ----------------------------------------


@pytest.mark.parametrize("bad", ["no", "False", 2, 0, [0], None])
def test_keep_decoded_must_be_a_bool(bad) -> None:
    with pytest.raises(TypeError, match="keep_decoded"):
        KakeyaCache(IdentityCodec(), num_layers=1, keep_decoded=bad)
    assert KakeyaCache(IdentityCodec(), num_layers=1, keep_decoded=np.bool_(True)).keep_decoded


def test_pre_rope_keys_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="pre_rope_keys"):
        IdentityCodec(pre_rope_keys="no")

    class Custom(IdentityCodec):
        def __init__(self) -> None:
            self.pre_rope_keys = "no"

    with pytest.raises(TypeError, match="pre_rope_keys"):
        KakeyaCache(Custom(), num_layers=1)


def test_codec_class_is_refused(llama) -> None:
    with pytest.raises(TypeError, match="class IdentityCodec"):
        KakeyaCache(IdentityCodec, model=llama)
    cache, before = filled(llama)
    with pytest.raises(TypeError, match="class BlockCodec"):
        compress_cache(cache, BlockCodec)
    assert all(torch.equal(la.keys, k) for la, (k, _) in zip(cache.layers, before))


# --- D06: the Triton kernel on the CPU needs its interpreter ---------------------------------


def test_triton_kernel_on_the_cpu_without_interpreter_is_refused(llama, monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(kt.InvalidParameterError, match="TRITON_INTERPRET"):
        KakeyaCache(IdentityCodec(), model=llama, kernel="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert KakeyaCache(IdentityCodec(), model=llama, kernel="triton").kernel == "triton"


# --- D07: rope ---------------------------------------------------------------------------------


def test_rope_of_another_model_is_refused(llama, llama32) -> None:
    pre = IdentityCodec(pre_rope_keys=True)
    with pytest.raises(kt.InvalidParameterError, match="rope"):
        KakeyaCache(pre, num_layers=5, rope=rope_for(llama))
    with pytest.raises(kt.InvalidParameterError, match="rope.*head_dim 16"):
        KakeyaCache(pre, model=llama, rope=rope_for(llama32))
    short = KakeyaCache(pre, block_size=8, rope=rope_for(_llama(layers=2)))  # layers added lazily
    with pytest.raises(kt.InvalidParameterError, match="rope"):
        forward(llama, prompt(), short)
    KakeyaCache(pre, model=llama, rope=rope_for(llama))


@pytest.mark.parametrize("fn", [
    lambda p: (1, 2),
    lambda p: (torch.ones(1, 5, 16), torch.zeros(1, 5, 16)),
    lambda p: (torch.ones(1, 2, 15), torch.zeros(1, 2, 15)),
    lambda p: (torch.ones(1, 2, 16), torch.zeros(1, 2, 8)),
    lambda p: 1 / 0,
])
def test_bad_rope_callable_is_refused_at_construction(fn) -> None:
    with pytest.raises(kt.InvalidParameterError, match="rope"):
        KakeyaCache(IdentityCodec(pre_rope_keys=True), num_layers=3, rope=fn)


def test_rope_callable_wider_than_the_heads_is_refused(llama) -> None:
    rope = rope_for(llama)

    def wide(p):
        cos, sin = rope.layer(0)(p)
        return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

    with pytest.raises(kt.InvalidParameterError, match="rope rotates 32"):
        KakeyaCache(IdentityCodec(pre_rope_keys=True), model=llama, rope=wide)
    KakeyaCache(IdentityCodec(pre_rope_keys=True), model=llama, rope=lambda p: rope.layer(0)(p))


# --- D08: boundary -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[99], [-99], [0, 7], [3], [-4]])
def test_boundary_out_of_range_is_refused(bad, llama) -> None:
    with pytest.raises(kt.InvalidParameterError, match="boundary"):
        KakeyaCache(IdentityCodec(), model=llama, boundary=bad)
    with pytest.raises(kt.InvalidParameterError, match="boundary"):
        KakeyaCache(IdentityCodec(), num_layers=3, boundary=bad)
    cache, _ = filled(llama)
    with pytest.raises(kt.InvalidParameterError, match="boundary"):
        compress_cache(cache, IdentityCodec(), boundary=bad)


@pytest.mark.parametrize("bad", [5, None, {0: "x"}, True])
def test_boundary_of_another_type_is_a_type_error(bad, llama) -> None:
    with pytest.raises(TypeError, match="boundary"):
        KakeyaCache(IdentityCodec(), model=llama, boundary=bad)


def test_a_recipe_boundary_fits_any_depth(llama) -> None:
    """A recipe's boundary layers serve models of any depth: those past the model are left out."""
    rec = recipes.load("predecessor")  # boundary_layers [0, 1, 7, 14, -2, -1]
    assert KakeyaCache.from_recipe(rec, model=llama).boundary == {0, 1, 2}
    assert KakeyaCache.from_recipe(rec, num_layers=10).boundary == {0, 1, 7, 8, 9}
    assert KakeyaCache.from_pretrained(llama, rec).boundary == {0, 1, 2}


# --- D09: from_pretrained's arguments --------------------------------------------------------


def test_from_pretrained_names_its_arguments(llama, llama_codec, tmp_path) -> None:
    with pytest.raises(TypeError, match="recipe must be"):
        KakeyaCache.from_pretrained(llama, 42)
    with pytest.raises(TypeError, match="calibration must be"):
        KakeyaCache.from_pretrained(llama, "calibrated-4bit", calibration=42)
    with pytest.raises(kt.InvalidParameterError, match="is a directory"):
        KakeyaCache.from_pretrained(llama, "calibrated-4bit", calibration=tmp_path)
    with pytest.raises(TypeError, match="model"):
        KakeyaCache.from_pretrained(None, "balanced")
    # A fitted codec where a calibration is taken: checked against the recipe and the model.
    rec = llama_codec.recipe
    assert KakeyaCache.from_pretrained(llama, rec, calibration=llama_codec).codec is llama_codec
    with pytest.raises(errors.ModelMismatchError):
        KakeyaCache.from_pretrained(_llama(layers=2), rec, calibration=llama_codec)
    with pytest.raises(kt.InvalidParameterError, match="recipe"):
        KakeyaCache.from_pretrained(llama, "calibrated-4bit", calibration=llama_codec)


# --- D12: a custom codec's decoded rows ------------------------------------------------------


class NaNDecode(IdentityCodec):
    def decode(self, stream, layer, head, blob):
        y = super().decode(stream, layer, head, blob)
        y[0, 0] = np.nan
        return y


class HugeDecode(IdentityCodec):
    def decode(self, stream, layer, head, blob):
        return super().decode(stream, layer, head, blob).astype(np.float64) * 1e300


@pytest.mark.parametrize("codec", [NaNDecode(), HugeDecode()], ids=["nan", "past-float32"])
def test_non_finite_decoded_rows_are_refused(codec, llama) -> None:
    cache, before = filled(llama)
    with pytest.raises(kt.InvalidInputError, match="decode.*stream 'k', layer 0, head 0"):
        compress_cache(cache, codec)
    kc = KakeyaCache(codec, model=llama, block_size=16)
    forward(llama, prompt(t=40), kc)  # seals; the next step decodes
    with pytest.raises(kt.InvalidInputError, match="decode.*stream 'k', layer 0, head 0"):
        forward(llama, prompt(t=2, seed=5), kc)
    assert kc.get_seq_length() == 40  # rolled back
