"""``KakeyaCache(kernel="triton")``: generation through the Triton decode attention (on the CPU:
Triton's interpreter, selected by ``tests/kernels/conftest.py``) against the same cache through
the Rust kernel, on tiny random-weight models: the same greedy tokens, logits within
``LOGIT_ATOL`` of the largest (the kernels sum in other orders: measured below 1e-6 here), no
sealed block decoded, the device copy of the codes staged again only when the sealed blocks
change. Families: Llama (keys before and after RoPE), GPT-OSS (learnt sinks, sliding layers),
Gemma 2 (softcap, MQA, head_dim 256, sliding layers), Qwen3-Next (a hybrid: Gated DeltaNet layers
around its attention layer), Gemma 4 (KV sharing: layers attending over another's codes), Qwen2-VL
with an image (its tokens' rotations appended to the rope table), Phi-3 with longrope across its
switch (the short factors' rows appended to the long table), HunYuan (keys normalised after RoPE
with a learnt weight: the queries scaled by it, the raw keys divided), NanoChat (RoPE turning the
other way: the rope table's sin negated)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("transformers")

import torch  # noqa: E402

from kakeyaturbo import InvalidParameterError, calibration  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache  # noqa: E402
from kakeyaturbo.cache.layer import KakeyaLayer  # noqa: E402
from kakeyaturbo.calibration import ModelCodec  # noqa: E402
from kakeyaturbo.kernels import attention as kattn  # noqa: E402

from tests.cache import families  # noqa: E402
from tests.cache import test_longrope as longrope  # noqa: E402
from tests.cache.conftest import fast_codec, fast_recipe, generate  # noqa: E402
from tests.cache.test_fast import _exact_steps  # noqa: E402
from tests.cache.test_multimodal import _build as build_multimodal  # noqa: E402
from tests.cache.test_multimodal import _generate as generate_with  # noqa: E402
from tests.cache.test_multimodal import _inputs as multimodal_inputs  # noqa: E402

LOGIT_ATOL = 1e-5

def _codec(model, rope: str) -> ModelCodec:
    g = np.random.default_rng(0)
    wins = [list(g.integers(3, families.VOCAB, 40)) for _ in range(3)]
    stats = calibration.collect(model, wins, n_sink=1, samples=32, weighting="uniform", rope=rope)
    return ModelCodec(stats, fast_recipe(rope))


@pytest.mark.parametrize("name, rope", [("llama", "before"), ("llama", "after"), ("gpt_oss", "before"),
                                        ("gemma2", "before"), ("qwen3_next", "before"), ("gemma4_text", "before"),
                                        ("hunyuan_v1_dense", "before"), ("nanochat", "before"),
                                        ("gpt_neox", "before")])
def test_triton_kernel_generates_as_the_rust_one(name, rope, monkeypatch) -> None:
    model = families.build(name)
    codec = _codec(model, rope)
    ids = torch.randint(3, families.VOCAB, (1, 26), generator=torch.Generator().manual_seed(1))
    rust = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32", kernel="rust")
    seq_r, log_r = generate(model, ids, rust, n=8)
    staged, extended = [], []
    orig_stack, orig_extend = kattn.stack_layer, kattn.extend_layer

    def counting(codes, device="cpu"):
        staged.append(codes.rows())
        return orig_stack(codes, device)

    def counting_extend(old, codes, first):
        extended.append(first)
        return orig_extend(old, codes, first)

    def no_decode(self, name_, j):
        raise AssertionError(f"layer {self.index} decoded sealed block {j} of {name_}")

    monkeypatch.setattr(kattn, "stack_layer", counting)
    monkeypatch.setattr(kattn, "extend_layer", counting_extend)
    monkeypatch.setattr(KakeyaLayer, "_block", no_decode)
    tri = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32", kernel="triton")
    assert tri.fast, tri.fast_reason
    seq_t, log_t = generate(model, ids, tri, n=8)
    monkeypatch.undo()
    assert torch.equal(seq_t, seq_r), name
    scale = max(1.0, log_r.abs().max().item())
    # The kernels' rounding (1e-7) in rows computed after the first step can move a row across a
    # quantiser's boundary when its block is sealed (Gemma 2 with torch on one thread): from the
    # first query that reads a block the caches coded differently, logits compared loosely.
    exact = _exact_steps(tri, rust, ids.shape[1], 4, log_r.shape[0])
    err = (log_t - log_r).abs().amax(dim=(1, 2))
    assert exact >= 1 and err[:exact].max().item() <= LOGIT_ATOL * scale, (name, exact, err)
    assert err.max().item() <= 1e-2 * scale, (name, err)
    # Full-attention layers are staged once, then only their new blocks appended; a sliding
    # layer is staged anew when a block leaves its window.
    fast_layers = [layer for layer in tri.layers if isinstance(layer, KakeyaLayer) and layer.fast and layer.num_sealed()]
    full = [layer for layer in fast_layers if layer.window is None]
    assert fast_layers and extended and len(staged) >= len(fast_layers)
    if len(full) == len(fast_layers):
        assert len(staged) == len(fast_layers)
    for layer in fast_layers:
        batch, _ = layer.device_codes(None if not layer.pre_rope else layer.key_rotation()[1])
        assert batch.k.rows == layer.codes().rows()


def test_kernel_choice_is_checked() -> None:
    model = families.build("llama")
    with pytest.raises(InvalidParameterError, match="kernel"):
        KakeyaCache(IdentityCodec(), model=model, kernel="cuda")


def test_extending_a_stacking_gives_the_stacking_of_all() -> None:
    """extend_layer(stack_layer(first k blocks), all blocks, k) holds the same tensors as
    stack_layer(all blocks): two batch rows, three kv-heads of their own bit layouts, outliers,
    blocks of uneven lengths."""
    import kakeyaturbo as kt
    from tests.codec.attention_cases import Spec, build

    c = build(Spec(seed=5, batch=2, kv_heads=3, blocks=(129, 1, 63, 200), threshold=1.0))
    full = c.codes
    for k in (1, 2, 3):
        part = kt.LayerCodes(full.k_codecs, full.v_codecs, batch=full.batch)
        for i in range(k):
            part.append_blocks([[full.blob(b, h, "k", i) for h in range(3)] for b in range(2)],
                               [[full.blob(b, h, "v", i) for h in range(3)] for b in range(2)])
        got = kattn.extend_layer(kattn.stack_layer(part), full, k)
        want = kattn.stack_layer(full)
        for name in ("k", "v"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.rows == b.rows == full.rows()
            for f in ("codes", "scale_bits", "scale_exp", "outlier_ptr", "outlier_pos", "outlier_bits", "rstart"):
                assert torch.equal(getattr(a, f), getattr(b, f)), (k, name, f)
        assert want.k.has_outliers and want.v.has_outliers


def test_triton_kernel_with_an_image_s_rotations() -> None:
    """Qwen2-VL with an image, keys coded before RoPE: the image tokens' rotations appended to the
    rope table (``Positions.rotation``) reach the Triton kernel as they reach the Rust one."""
    model = build_multimodal("qwen2_vl")
    codec = fast_codec(model, fast_recipe("before"), "before")
    inputs = multimodal_inputs("qwen2_vl", True)
    rust = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32", kernel="rust")
    seq_r, log_r = generate_with(model, inputs, rust)
    tri = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32", kernel="triton")
    seq_t, log_t = generate_with(model, inputs, tri)
    assert tri._positions.triples and tri.layers[0]._rope_table.n_positions > 256  # rows appended
    assert torch.equal(seq_t, seq_r)
    assert (log_t - log_r).abs().max().item() <= LOGIT_ATOL * max(1.0, log_r.abs().max().item())


def test_triton_kernel_reads_a_left_padded_batch_s_sinks_as_the_rust_one() -> None:
    """A left-padded row's sink holds its first real token (``cache.padding``): the Triton kernel
    reads it there, through the mask the cache moves, as the Rust kernel does."""
    model = families.build("llama")
    codec = _codec(model, "before")
    ids = torch.randint(3, families.VOCAB, (2, 26), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    runs = []
    for kernel in ("rust", "triton"):
        cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32", kernel=kernel)
        runs.append(generate(model, ids, cache, n=6, attention_mask=mask))
        assert cache.fast and cache.layers[0].sink_rows() == [0, 5]
    (seq_r, log_r), (seq_t, log_t) = runs
    assert torch.equal(seq_t, seq_r)
    assert (log_t - log_r).abs().max().item() <= LOGIT_ATOL * max(1.0, log_r.abs().max().item())


def test_triton_kernel_reads_longrope_s_two_sets_of_factors() -> None:
    """A longrope model fed calls across the switch (tests/cache/test_longrope.py): the short
    factors' rows appended to the long table reach the Triton kernel as they reach the Rust one."""
    model = longrope.build()
    g = np.random.default_rng(0)
    codec = ModelCodec(calibration.collect(model, [list(g.integers(3, families.VOCAB, 14)) for _ in range(3)],
                                           samples=4), fast_recipe("before"))
    rust = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32", kernel="rust")
    tri = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32", kernel="triton")
    log_r, log_t = longrope._feed(model, rust, longrope.CROSSING), longrope._feed(model, tri, longrope.CROSSING)
    assert tri._positions.long is not None and tri.layers[0]._rope_table.n_positions > 256  # rows appended
    assert (log_t - log_r).abs().max().item() <= LOGIT_ATOL * max(1.0, log_r.abs().max().item())
