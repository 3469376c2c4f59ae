"""KakeyaCache generating through the codes (``kakeyaturbo.cache.fast``) against the same cache
decoding its sealed blocks and attending over them (``fast=False``), on tiny random-weight
models: the same greedy tokens and logits within the tolerances below, no block ever decoded,
the blobs held once; chunked prefill and left-padded batches; sliding-window and softcapped
families; keys coded after RoPE (scores from look-up tables) and before it (keys synthesised
and rotated per tile inside the kernel); the slow path kept for per-block and identity codecs.

Tolerances (float32 models, logits of order 1): the kernel computes attention in float32 from
the codes with another summation order than decode + SDPA, ``|attention difference| <= 2e-6``
of the largest value (tests/kernels/tolerances.py); through a 3-layer model the logits differ
by at most ``LOGIT_ATOL`` times ``max(1, largest |logit|)`` (measured: at most 1.2e-7 on the
llama and qwen2 models below, 1.2e-6 on Gemma 2 with its softcap, logits up to 0.95)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kakeyaturbo import InvalidParameterError, attention_kernel, recipes  # noqa: E402
from kakeyaturbo.cache import IdentityCodec, KakeyaCache, codec_for  # noqa: E402
from kakeyaturbo.cache import fast as fast_mod  # noqa: E402
from kakeyaturbo.cache.generation import _auto_synthesis  # noqa: E402
from kakeyaturbo.cache.layer import KakeyaLayer  # noqa: E402
from kakeyaturbo.codec.attention import LayerCodes  # noqa: E402

from . import families  # noqa: E402
from .conftest import build, fast_codec, fast_recipe, forward, generate  # noqa: E402

LOGIT_ATOL = 1e-5
BF16_LOGIT_ATOL = 2e-4
VOCAB = 97

def _ids(batch: int = 1, t: int = 45, seed: int = 1):
    return torch.randint(3, VOCAB, (batch, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ropeafter():
    return fast_recipe("after")


@pytest.fixture(scope="module")
def ropebefore():
    return fast_recipe("before")


@pytest.fixture(scope="module", params=[("llama", "after"), ("qwen2", "after"), ("llama", "before"),
                                        ("qwen2", "before")], ids="-".join)
def setup(request, ropeafter, ropebefore):
    name, rope = request.param
    model = build(name)
    return f"{name}-{rope}", model, fast_codec(model, ropeafter if rope == "after" else ropebefore, rope)


@pytest.fixture
def no_decode(monkeypatch):
    """Makes decoding a sealed block an error (in the fast cache only: call ``arm()``)."""
    orig = KakeyaLayer._block
    state = {"armed": False}

    def guarded(self, name, j):
        if state["armed"]:
            raise AssertionError(f"layer {self.index} decoded sealed block {j} of {name}")
        return orig(self, name, j)

    monkeypatch.setattr(KakeyaLayer, "_block", guarded)
    return state


def _pair(model, codec, synthesis="f32", **kw):
    fast = KakeyaCache(codec, model=model, block_size=8, n_sink=1, synthesis=synthesis, **kw)
    slow = KakeyaCache(codec, model=model, block_size=8, n_sink=1, fast=False, **kw)
    return fast, slow


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("synthesis", ["bf16", "i16"])
def test_rounded_synthesis_generates_within_its_rounding(name, synthesis, ropebefore, no_decode) -> None:
    """The default synthesis of keys coded before RoPE (bfloat16 factors, float32 sums) and the
    fixed-point one (16-bit factors, exact integer sums): the same greedy tokens as
    decode-then-attend, logits within ``BF16_LOGIT_ATOL`` (the keys move by about 2**-8 of the
    terms that make them; measured up to 1.1e-5 here with bf16), and not the float32
    synthesis's logits (it ran)."""
    model = build(name)
    codec = fast_codec(model, ropebefore, "before")
    fast, slow = _pair(model, codec, synthesis=synthesis)
    assert fast.synthesis == synthesis
    # The default picks the fixed-point synthesis where the Rust kernel runs a SIMD build.
    auto = "i16" if attention_kernel() in ("avx2", "avx512") else "bf16"
    assert KakeyaCache(codec, model=model).synthesis == auto == _auto_synthesis(model, "auto")
    with pytest.raises(InvalidParameterError):
        KakeyaCache(codec, model=model, synthesis="fp16")
    ids = _ids()
    seq_s, log_s = generate(model, ids, slow, n=12)
    no_decode["armed"] = True
    seq_f, log_f = generate(model, ids, fast, n=12)
    no_decode["armed"] = False
    assert torch.equal(seq_f, seq_s), name
    err = (log_f - log_s).abs().max().item()
    assert err <= BF16_LOGIT_ATOL, (name, err)
    f32, _ = _pair(model, codec, synthesis="f32")
    _, log_32 = generate(model, ids, f32, n=12)
    assert not torch.equal(log_32, log_f)


@pytest.mark.parametrize("name, rope", [("llama", "before"), ("llama", "after"), ("hunyuan_v1_dense", "before"),
                                        ("gpt_neox", "before"), ("phi", "before"), ("gpt2", "before")])
def test_a_bfloat16_model_s_rows_go_to_the_kernel_as_their_bits(name, rope, monkeypatch) -> None:
    """A bfloat16 model on the CPU: the queries and raw rows go to the Rust kernel as bfloat16
    bits (widened there) and the output comes back in bfloat16 (rounded there), not converted by
    torch at every step: logits bit for bit those of converting in torch (float32 to the kernel,
    its float32 output rounded by torch); HunYuan's key weight scales the widened queries and
    divides its raw keys (float32 then)."""
    model = families.build(name).to(torch.bfloat16)
    codec = fast_codec(model, fast_recipe(rope), rope)
    seen = []
    orig = LayerCodes.kernel_attend

    def spy(self, q, sk, sv, tk, tv, *rest):
        seen.append((q.dtype, tk.dtype, rest[-1]))
        return orig(self, q, sk, sv, tk, tv, *rest)

    monkeypatch.setattr(LayerCodes, "kernel_attend", spy)
    ids = _ids()
    seq, log = generate(model, ids, KakeyaCache(codec, model=model, block_size=8, n_sink=1), n=8)
    # (HunYuan's queries times its key weight and keys divided by it are float32)
    want = np.float32 if name == "hunyuan_v1_dense" else np.uint16
    assert seen and all(q == want and t == want and out for q, t, out in seen)
    # The same through torch's conversions: float32 arrays in, float32 out, rounded by torch.
    monkeypatch.setattr(fast_mod, "_rows", fast_mod._f32)
    monkeypatch.setattr(LayerCodes, "kernel_attend", lambda self, *a: orig(self, *a[:-1], False))
    seq_t, log_t = generate(model, ids, KakeyaCache(codec, model=model, block_size=8, n_sink=1), n=8)
    assert torch.equal(seq, seq_t) and torch.equal(log, log_t), name


def test_auto_synthesis_is_fixed_point_only_for_the_simd_builds_on_the_cpu() -> None:
    """``synthesis="auto"``: ``"i16"`` for a model on the CPU (or none) where the Rust kernel runs
    its AVX2 or AVX-512 build; ``"bf16"`` on a GPU, for the Triton kernel, and with the portable
    build."""
    cpu = "i16" if attention_kernel() in ("avx2", "avx512") else "bf16"
    assert _auto_synthesis(None, "auto") == _auto_synthesis(build("llama"), "rust") == cpu
    assert _auto_synthesis(SimpleNamespace(device=torch.device("cuda")), "auto") == "bf16"
    assert _auto_synthesis(SimpleNamespace(device="cpu"), "triton") == "bf16"


def test_fast_generates_as_decode_then_attend(setup, no_decode) -> None:
    name, model, codec = setup
    ids = _ids()
    fast, slow = _pair(model, codec)
    assert fast.fast and fast.fast_reason is None and not slow.fast
    seq_s, log_s = generate(model, ids, slow, n=12)
    no_decode["armed"] = True
    seq_f, log_f = generate(model, ids, fast, n=12)
    no_decode["armed"] = False
    assert torch.equal(seq_f, seq_s), name
    err = (log_f - log_s).abs().max().item()
    assert err <= LOGIT_ATOL, (name, err)
    assert err > 0  # the kernel ran (bit-equal logits would mean the slow path did)
    for a, b in zip(fast.layers, slow.layers):
        assert a.num_sealed() == b.num_sealed() >= 5
        assert a._s["k"].blocks == b._s["k"].blocks and a._s["v"].blocks == b._s["v"].blocks
        codes = a.codes()
        # The codes share the blobs: held once, the blobs' bytes exactly.
        assert codes.nbytes == a.memory()["blobs"]
        assert codes.rows() == a.num_sealed() * 8
    mf = fast.memory()
    table = mf.pop("rope_table")
    assert mf == {k: v for k, v in slow.memory().items() if k != "rope_table"}
    # Keys coded before RoPE: the cos/sin table the kernel read, 8 bytes per position and frequency.
    assert table == (0 if name.endswith("after") else fast_mod.TABLE_ROWS * 8 * 8)
    assert fast.nbytes() == sum(mf.values())  # the model's table is not the sequence's
    # Repeated batch rows (beam search) share their sealed bytes: held, and counted, once.
    blobs = fast.layers[0].memory()["blobs"]
    fast.batch_repeat_interleave(3)
    assert fast.layers[0].codes().nbytes == fast.layers[0].memory()["blobs"] == blobs


def test_fast_chunked_prefill_and_decoding_steps(setup) -> None:
    """A prompt fed in chunks (queries attending to sealed blocks of earlier chunks), then
    single tokens: every chunk's logits as the slow path's."""
    name, model, codec = setup
    ids = _ids(t=50)
    fast, slow = _pair(model, codec)
    for a, b in ((0, 20), (20, 37), (37, 38), (38, 50)):
        lf = forward(model, ids[:, a:b], fast)
        ls = forward(model, ids[:, a:b], slow)
        err = (lf - ls).abs().max().item()
        assert err <= LOGIT_ATOL, (name, a, b, err)
        if a >= 20:
            assert err > 0
    assert fast.get_seq_length() == 50 and fast.layers[0].num_sealed() == 6


def test_key_rotation_is_read_once_per_change_of_the_sealed_rows(ropebefore) -> None:
    """Keys coded before RoPE: a decode step between two seals reuses the rows and table the
    last step read; a sealed block, positions changed in place (a crop, a reorder, or set
    anew) read them again."""
    model = build("llama")
    cache = KakeyaCache(fast_codec(model, ropebefore, "before"), model=model, block_size=8, n_sink=1)
    forward(model, _ids(t=20), cache)
    layer = cache.layers[0]
    layer.codes()
    table, rows = layer.key_rotation()
    forward(model, _ids(t=1, seed=2), cache)  # 21 tokens: no new block
    assert layer.key_rotation()[1] is rows
    forward(model, _ids(t=4, seed=3), cache)  # 25: a block sealed
    layer.codes()
    more = layer.key_rotation()[1]
    assert more is not rows and more.shape == (1, 24) and more[0, -1] == 24
    cache._positions.pos = cache._positions.pos + 5
    moved = layer.key_rotation()[1]
    assert moved is not more and np.array_equal(moved, more + 5)


def test_fast_left_padded_batch(setup) -> None:
    name, model, codec = setup
    ids = _ids(batch=2, t=40)
    mask = torch.ones_like(ids)
    ids[0, :5] = 0
    mask[0, :5] = 0
    fast, slow = _pair(model, codec)
    seq_f, log_f = generate(model, ids, fast, n=8, attention_mask=mask)
    seq_s, log_s = generate(model, ids, slow, n=8, attention_mask=mask)
    assert torch.equal(seq_f, seq_s)
    assert (log_f - log_s).abs().max().item() <= LOGIT_ATOL


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_positions_past_the_table_limit_take_the_slow_path(name, ropebefore, monkeypatch) -> None:
    """Keys coded before RoPE at positions past ``TABLE_MAX``: no table that large is built;
    those steps attend as the slow path does (the same logits as the decode-then-attend cache)."""
    model = build(name)
    codec = fast_codec(model, ropebefore, "before")
    monkeypatch.setattr(fast_mod, "TABLE_MAX", 30)
    ids = _ids(t=40)
    fast, slow = _pair(model, codec)
    lf, ls = forward(model, ids[:, :20], fast), forward(model, ids[:, :20], slow)
    assert (lf - ls).abs().max().item() <= LOGIT_ATOL
    for t in range(20, 40):  # sealed rows reach positions >= 30 from the step at 33 on
        lf, ls = forward(model, ids[:, t:t + 1], fast), forward(model, ids[:, t:t + 1], slow)
        err = (lf - ls).abs().max().item()
        assert err <= LOGIT_ATOL, (t, err)
        if t >= 33:
            assert err == 0.0, t  # the slow path itself
    assert all(layer._rope_table is None or layer._rope_table.n_positions <= 256 for layer in fast.layers)


def test_a_tabulated_rotary_is_read_within_its_rows() -> None:
    """GPT-J's rotary module holds a table of ``max_position_embeddings`` rows: the kernel's
    table stops there where a multiple of ``TABLE_STEP`` would pass it (it raised IndexError)."""
    from kakeyaturbo.families import describe

    torch.manual_seed(0)
    model = transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=300)).eval()
    rope = describe(model).rope.layer(0)
    table = fast_mod.rope_table(rope, 280)
    assert table.n_positions == 300
    cos, _ = rope(torch.arange(300))
    np.testing.assert_array_equal(table.cos[-1], cos[0, -1, ::2].numpy())  # the last row, as the module has it


def test_other_caches_compute_as_before(setup) -> None:
    """With the attention function installed, a DynamicCache computes bit for bit as before."""
    name, model, codec = setup
    KakeyaCache(codec, model=model)
    assert model.config._attn_implementation in fast_mod.NAMES.values()
    ids = _ids()
    got = generate(model, ids, transformers.DynamicCache(config=model.config), n=4)
    model.set_attn_implementation(fast_mod.base_of(model))
    try:
        want = generate(model, ids, transformers.DynamicCache(config=model.config), n=4)
    finally:
        fast_mod.install(model)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_export_import_state_keeps_generating_fast(setup) -> None:
    name, model, codec = setup
    ids = _ids(t=30)
    a = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    forward(model, ids, a)
    b = KakeyaCache(codec, model=model, block_size=8, n_sink=1)
    for la in a.layers:
        lb = b.layers[la.index] if la.index < len(b.layers) else None
        assert lb is not None
        lb.import_state(la.export_state())
    if a._positions is not None:  # keys before RoPE: the positions are the cache's, not a layer's
        b._positions.pos = a._positions.pos.clone()
    nxt = _ids(t=3, seed=5)
    la, lb = forward(model, nxt, a), forward(model, nxt, b)
    assert torch.equal(la, lb)
    assert b.layers[0].codes().nbytes == b.layers[0].memory()["blobs"]


@pytest.mark.parametrize("rope", ["after", "before"])
@pytest.mark.parametrize("name", sorted(fast_mod.FAMILIES - families.ELSEWHERE))
def test_families(name, rope, ropeafter, ropebefore, no_decode) -> None:
    """Every family of ``fast.FAMILIES`` (sliding windows of 8 tokens crossed by the prompt,
    Gemma 2's softcap, MQA, q/k norms; before RoPE: Cohere's interleaved pairing, Gemma 3's
    per-layer-type frequencies, Phi-3's partial rotary, SmolLM3's layers without RoPE): the same
    tokens, logits within LOGIT_ATOL."""
    model = families.build(name)
    codec = fast_codec(model, ropeafter if rope == "after" else ropebefore, rope)
    ids = torch.randint(3, families.VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    fast = KakeyaCache(codec, model=model, block_size=4, n_sink=1, synthesis="f32")
    slow = KakeyaCache(codec, model=model, block_size=4, n_sink=1, fast=False)
    assert fast.fast, fast.fast_reason
    seq_s, log_s = generate(model, ids, slow, n=10)
    no_decode["armed"] = True
    seq_f, log_f = generate(model, ids, fast, n=10)
    no_decode["armed"] = False
    assert torch.equal(seq_f, seq_s), name
    scale = max(1.0, log_s.abs().max().item())
    # Rows computed after the first step carry the kernel's rounding (1e-7), which can move a
    # row across a quantiser's boundary when its block is sealed: from the first query that
    # reads a block whose codes differ, the logits are compared loosely (the tokens exactly).
    exact = _exact_steps(fast, slow, ids.shape[1], 4, log_s.shape[0])
    err = (log_f - log_s).abs().amax(dim=(1, 2))
    assert exact >= 3 and err[:exact].max().item() <= LOGIT_ATOL * scale, (name, exact, err)
    assert err.max().item() <= 1e-2 * scale, (name, err)
    assert any(layer.num_sealed() for layer in _kv(fast))
    for layer in _kv(fast):
        if layer.fast and layer.num_sealed():
            assert layer.codes().nbytes == layer.memory()["blobs"]


def _kv(cache):
    """The cache's K/V layers that hold rows (a hybrid's state layers are transformers' own; a
    text-only forward leaves a cross-attention layer empty)."""
    return [layer for layer in cache.layers if isinstance(layer, KakeyaLayer) and layer.is_initialized]


def _exact_steps(fast, slow, prompt: int, bs: int, steps: int) -> int:
    """Generation steps (from the first) whose queries read only sealed blocks both caches
    coded alike: a block of positions ``s .. s+bs`` is first read by the query at ``s + bs``."""
    first = min((s for a, b in zip(_kv(fast), _kv(slow)) for name in ("k", "v")
                 for s, x, y in zip(a._s[name].starts, a._s[name].blocks, b._s[name].blocks) if x != y),
                default=None)
    if first is None:
        return steps
    # Step i's query sits at position prompt - 1 + i.
    return min(steps, max(0, first + bs - (prompt - 1)))


def test_slow_path_for_other_codecs(llama) -> None:
    """Per-block recipes and the identity codec decode then attend; fast=True refuses them
    naming the reason."""
    cases = {"per-block": codec_for(recipes.load("balanced")), "identity": IdentityCodec()}
    for what, codec in cases.items():
        cache = KakeyaCache(codec, model=llama, block_size=8, n_sink=1)
        assert not cache.fast and cache.fast_reason, what
        assert not any(layer.fast for layer in cache.layers)
        with pytest.raises(ValueError, match="no attention over the codes"):
            KakeyaCache(codec, model=llama, fast=True)
    # The slow path still generates (the per-block recipe, sealed blocks decoded).
    cache = KakeyaCache(cases["per-block"], model=llama, block_size=16, n_sink=1)
    seq, _ = generate(llama, _ids(t=40), cache, n=4)
    assert seq.shape[1] == 44 and cache.layers[0].num_sealed() == 2


@pytest.mark.parametrize("name, why", [("kolibri1_1", "'kolibri1_1' is not among"),
                                       ("falcon_alibi", "'falcon' with ALiBi")])
def test_unsupported_family_falls_back(name, why, ropeafter) -> None:
    """A family not checked for the fast path (Kolibri 1.1's indexed layers pick keys from every
    cached row and attend over NVFP4-rounded copies, not the tensor the cache returned), and
    Falcon with ALiBi (a family of the fast path whose position bias rides in the attention mask,
    which the kernel reads as booleans): the slow path, naming why."""
    model = families.build(name)
    codec = fast_codec(model, ropeafter)
    cache = KakeyaCache(codec, model=model, block_size=4, n_sink=1)
    assert not cache.fast and why in cache.fast_reason
    with pytest.raises(ValueError):
        KakeyaCache(codec, model=model, fast=True)


@pytest.mark.parametrize("rope", ["after", "before"])
def test_fast_path_with_sparse_outliers(rope, no_decode) -> None:
    """A calibrated recipe that stores |z| > T sparsely (``outlier_threshold``): the sealed
    blocks hold outliers, and the fast path (which puts each outlier's value in place of its
    centroid) generates the tokens of decode-then-attend, logits within ``LOGIT_ATOL``."""
    rec = fast_recipe(rope, outlier_threshold=1.5)
    model = build("qwen2")
    codec = fast_codec(model, rec, rope)
    fast, slow = _pair(model, codec)
    ids = _ids()
    seq_s, log_s = generate(model, ids, slow, n=12)
    no_decode["armed"] = True
    seq_f, log_f = generate(model, ids, fast, n=12)
    no_decode["armed"] = False
    assert torch.equal(seq_f, seq_s)
    assert (log_f - log_s).abs().max().item() <= LOGIT_ATOL
    layer = fast.layers[1]
    c = codec.codecs[("k", 1, 0)]
    info = c.inspect(layer._s["k"].blocks[0][0][0])  # block 0, sequence 0, kv-head 0
    assert info["num_outliers"] > 0, info


def test_kernel_by_device() -> None:
    """kernel="auto": Rust on the CPU, Triton on CUDA, the slow path elsewhere; "rust": the slow
    path off the CPU; "triton": everywhere (the interpreter on the CPU)."""
    layer = KakeyaLayer(0, IdentityCodec(), block_size=4, n_sink=0, streams=("k", "v"))
    want = {"auto": ["rust", "triton", None], "rust": ["rust", None, None], "triton": ["triton"] * 3}
    for kernel, kernels in want.items():
        layer.kernel = kernel
        assert [layer._kernel_for(torch.device(d)) for d in ("cpu", "cuda", "meta")] == kernels
    with pytest.raises(InvalidParameterError, match="kernel"):
        KakeyaCache(IdentityCodec(), num_layers=2, kernel="metal")
