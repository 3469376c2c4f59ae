"""Attention over the calibrated codes (``kakeyaturbo.decode_attention``) against attention over
the decoded cache in float64 (``kakeyaturbo.reference.attention``), under the limits of
``tests/kernels/tolerances.py``; the layer store's API; every bad argument a typed error."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from tests.conftest import in_forked_child
from hypothesis import strategies as st

import kakeyaturbo as kt

torch = pytest.importorskip("torch")

from kakeyaturbo.reference.attention import reference_attention  # noqa: E402
from tests.kernels.tolerances import TOLERANCES as TOL  # noqa: E402

from .attention_cases import AttentionMismatch, Spec, build, compare, magnitudes, spec_from  # noqa: E402


def check(s: Spec, **extra) -> None:
    c = build(s)
    got = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, return_lse=True, **c.call(), **extra)
    want = reference_attention(c.codes, c.q, c.tail_k, c.tail_v, **c.call())
    s_mag, v_mag = magnitudes(c)
    compare(f"{s}", got, (want[0].numpy(), want[1].numpy()), s_mag, v_mag,
            TOL["attention_out"], TOL["attention_lse"])


#: The brief's grid, cut to CI size: sealed rows from none to several blocks (partial tiles,
#: a 1-row block), GQA groups 1..8, D 64/128/256, n_q 1..4, every metric with norm on and off,
#: outliers, custom tables, softcap, windows that cut into the sealed rows, both mask kinds.
GRID = [
    Spec(seed=1, blocks=(), sink=0, tail=3, n_q=3, group=1),
    Spec(seed=2, blocks=(512,), group=8, n_q=1, metric="inner_product", threshold=2.5),
    Spec(seed=3, blocks=(300, 1, 77), dk=128, dv=128, group=4, n_q=2, norm=False, tables=True),
    Spec(seed=4, blocks=(512, 200), dk=256, dv=256, kv_heads=1, group=2, n_q=4,
         metric="linf", norm=False, threshold=1.0, softcap=20.0),
    Spec(seed=5, batch=2, blocks=(129, 63), group=5, n_q=2, window=100, mask="additive"),
    Spec(seed=6, blocks=(640,), dk=128, dv=64, group=3, n_q=3, window=700, mask="bool",
         threshold=3.0, softcap=5.0, q_scale=20.0),
    Spec(seed=7, blocks=(64, 64, 64), kv_heads=3, group=3, n_q=1, sink=4, tail=1,
         metric="inner_product", tables=True),
]


@pytest.mark.parametrize("spec", GRID, ids=lambda s: f"seed{s.seed}")
def test_matches_the_decoded_attention(spec: Spec) -> None:
    check(spec)


@given(seed=st.integers(0, 2**31 - 1))
def test_random_layers_match(seed: int) -> None:
    g = np.random.default_rng(seed)
    check(spec_from(g, seed, dims=(1, 7, 16, 33, 64, 80), max_block=300))


def test_failures_name_the_error_and_the_index() -> None:
    c = build(GRID[1])
    want = reference_attention(c.codes, c.q, c.tail_k, c.tail_v, **c.call())
    out, lse = (x.numpy().copy() for x in want)
    out[0, 3, 0, 7] += 1.0
    with pytest.raises(AttentionMismatch, match=r"out error .* first at \[0, 3, 0, 7\]"):
        compare("x", (out, lse), (want[0].numpy(), want[1].numpy()), 1.0, 1.0, 1e-6, 1e-6)


#: A layer whose sealed work is past every kernel's one-thread threshold: ``threads=None``
#: leaves the calling thread (on torch's team where torch runs two threads or more).
EVERY_CORE = Spec(seed=13, blocks=(2048, 2048, 700), kv_heads=3, group=3, n_q=1)


def test_thread_counts_give_the_same_bits() -> None:
    c = build(Spec(seed=11, blocks=(2048, 2048, 700), kv_heads=3, group=3, n_q=2))
    runs = [kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, threads=t, return_lse=True, **c.call())
            for t in (1, 2, None)]
    for out, lse in runs[1:]:
        assert np.array_equal(out, runs[0][0]) and np.array_equal(lse, runs[0][1])


@pytest.mark.skipif(sys.platform == "win32", reason="the OpenMP team is looked up on Unix only")
def test_torchs_openmp_team_runs_the_calls_that_use_every_core() -> None:
    """With torch loaded, calls on every core run on torch's OpenMP team (as many threads as
    ``torch.get_num_threads()``), with the same bits as one thread; with torch held to one
    thread, or the team turned off in the environment, on the kernel's own threads."""
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread here: no team to lend")
    assert kt.attention_team() == torch.get_num_threads()
    c = build(EVERY_CORE)
    one = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, threads=1, return_lse=True, **c.call())
    team = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, return_lse=True, **c.call())
    assert all(np.array_equal(a, b) for a, b in zip(one, team))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert kt.attention_team() == 0
        own = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, return_lse=True, **c.call())
    finally:
        torch.set_num_threads(n)
    assert all(np.array_equal(a, b) for a, b in zip(one, own))
    code = "import torch, kakeyaturbo as kt; print(kt.attention_team())"
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "KAKEYATURBO_OPENMP_TEAM": "0"})
    assert off.stdout.strip() == "0"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_attends_on_threads_of_its_own() -> None:
    """libgomp's team does not survive a fork (a parallel region in the child waits for threads
    that are not there): a child forked after the team ran keeps the kernel's own threads, with
    the same bits, and does not hang."""
    c = build(EVERY_CORE)
    want = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, **c.call())

    def child() -> bool:
        got = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, **c.call())
        return np.array_equal(got, want) and kt.attention_team() == 0

    ok = in_forked_child(child)
    assert ok is not None, "the forked child hung"
    assert ok, "the child's result or team differs"


def test_a_query_that_sees_nothing_gives_zero() -> None:
    c = build(Spec(seed=12, n_q=2))
    mask = np.zeros((1, 2, c.spec.total), np.float32)
    mask[:, 1] = -np.inf
    out, lse = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, sink_k=c.sink_k,
                                   sink_v=c.sink_v, mask=mask, return_lse=True)
    assert np.all(out[:, :, 1] == 0) and np.all(np.isneginf(lse[:, :, 1]))
    assert np.all(np.isfinite(lse[:, :, 0]))


@pytest.mark.parametrize("spec", [GRID[2], GRID[4], GRID[6]], ids=lambda s: f"seed{s.seed}")
def test_learnt_sink_logits_join_every_softmax(spec: Spec) -> None:
    """GPT-OSS's learnt sinks (one logit per query head, no value): against the reference that
    appends each head's logit to every row of scores and drops its weight after the softmax;
    they change the result, and a query that sees nothing keeps 0 with the sink's lse."""
    c = build(spec)
    sinks = np.random.default_rng(spec.seed).uniform(-1, 4, c.q.shape[1]).astype(np.float32)
    got = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, return_lse=True, **c.call(),
                              sink_logits=sinks)
    want = reference_attention(c.codes, c.q, c.tail_k, c.tail_v, **c.call(), sink_logits=sinks)
    s_mag, v_mag = magnitudes(c)
    compare(f"{spec} with sinks", got, (want[0].numpy(), want[1].numpy()), s_mag, v_mag,
            TOL["attention_out"], TOL["attention_lse"])
    plain = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, **c.call())
    assert np.abs(plain - got[0]).max() > 1e-3 * v_mag
    as_tensor = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, **c.call(),
                                    sink_logits=torch.from_numpy(sinks).double())
    assert np.array_equal(as_tensor, got[0])


def test_sink_logits_for_a_query_that_sees_nothing() -> None:
    c = build(Spec(seed=12, n_q=2))
    mask = np.zeros((1, 2, c.spec.total), np.float32)
    mask[:, 1] = -np.inf
    sinks = np.linspace(-1, 2, c.q.shape[1], dtype=np.float32)
    out, lse = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, sink_k=c.sink_k,
                                   sink_v=c.sink_v, mask=mask, return_lse=True, sink_logits=sinks)
    assert np.all(out[:, :, 1] == 0) and np.array_equal(lse[0, :, 1], sinks)


def test_torch_tensors_and_boolean_masks() -> None:
    c = build(Spec(seed=13, n_q=2, mask="bool"))
    m = c.kwargs["mask"]
    additive = np.where(m, 0.0, -np.inf).astype(np.float32)
    a = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, sink_k=c.sink_k, sink_v=c.sink_v,
                            mask=m)
    b = kt.decode_attention(c.codes, torch.from_numpy(c.q), torch.from_numpy(c.tail_k),
                            torch.from_numpy(c.tail_v), sink_k=torch.from_numpy(c.sink_k),
                            sink_v=torch.from_numpy(c.sink_v), mask=torch.from_numpy(additive[:, 0]))
    assert np.array_equal(a, b)
    # The default scale is 1 / sqrt(D_k); the method is the function.
    d = c.codes.attend(c.q, c.tail_k, c.tail_v, sink_k=c.sink_k, sink_v=c.sink_v, mask=m,
                       scale=1 / np.sqrt(c.spec.dk))
    assert np.array_equal(a, d)


def test_layer_codes_hold_the_containers() -> None:
    c = build(Spec(seed=14, batch=2, blocks=(100, 30)))
    codes = c.codes
    assert codes.rows() == 130 and codes.num_blocks(1, 1) == 2 and codes.rows_at(0, 1) == 130
    total = sum(len(codes.blob(b, h, s, i)) for b, h, s, i in
                itertools.product(range(2), range(2), "kv", range(2)))
    assert codes.nbytes == total
    blob = codes.blob(1, 0, "k", 1)
    assert codes.k_codecs[0].decode(blob).shape == (30, 64)
    out = kt.decode_attention(codes, c.q, c.tail_k, c.tail_v, sink_k=c.sink_k, sink_v=c.sink_v)
    # select: reorder and repeat batch rows; the attention of each row follows it.
    codes.select([1, 1, 0])
    sel = [1, 1, 0]
    out2 = kt.decode_attention(codes, c.q[sel], c.tail_k[sel], c.tail_v[sel],
                               sink_k=c.sink_k[sel], sink_v=c.sink_v[sel])
    assert np.array_equal(out2, out[sel])
    # the repeated row shares its containers: every one is held, and counted, once
    assert codes.batch == 3 and codes.nbytes == total
    codes.select([0])
    assert codes.nbytes == sum(len(codes.blob(0, h, s, i)) for h, s, i in itertools.product(range(2), "kv", range(2)))
    codes.select([0, 0, 0])
    # append_blocks keeps nothing unless every container is accepted.
    k = [[codes.blob(b, h, "k", 0) for h in range(2)] for b in range(3)]
    v = [[codes.blob(b, h, "v", 0) for h in range(2)] for b in range(3)]
    v[2][1] = v[2][1][:-1]
    with pytest.raises(kt.CorruptDataError):
        codes.append_blocks(k, v)
    assert codes.rows() == 130
    with pytest.raises(kt.InvalidParameterError):  # kv-head 1's container at kv-head 0
        codes.append(0, 0, codes.blob(0, 1, "k", 0), codes.blob(0, 1, "v", 0))
    with pytest.raises(kt.InvalidInputError):  # K and V blocks of different row counts
        codes.append(0, 0, codes.blob(0, 0, "k", 0), codes.blob(0, 0, "v", 1))
    codes.append(0, 0, codes.blob(0, 0, "k", 1), codes.blob(0, 0, "v", 1))
    with pytest.raises(kt.InvalidInputError, match="differ across the layer"):
        codes.rows()
    codes.pop_block()
    assert codes.rows_at(0, 0) == 130 and codes.rows_at(1, 1) == 100
    codes.clear()
    assert codes.rows() == 0 and codes.nbytes == 0
    with pytest.raises(kt.InvalidInputError):
        codes.blob(0, 0, "k", 0)
    with pytest.raises(kt.InvalidParameterError):
        codes.blob(0, 0, "x", 0)
    with pytest.raises(kt.InvalidParameterError):
        codes.rows_at(-1, 0)


def test_scales_beyond_float32_are_refused_on_append() -> None:
    # Tiny spreads make the coefficients of ordinary rows overflow float32: the codec codes
    # them from f64 with scales beyond the float32 range, which attention cannot use.
    d = 8
    eye = np.eye(d, dtype=np.float32)
    codec = kt.CalibratedCodec(np.zeros(d), eye, eye, np.full(d, 1e-30), np.full(d, 3))
    x = np.full((4, d), 1e9, np.float32)
    blob = codec.encode(x)
    codes = kt.LayerCodes([codec], [codec])
    with pytest.raises(kt.InvalidInputError, match="float32"):
        codes.append(0, 0, blob, blob)


def test_bad_arguments_are_typed_errors() -> None:
    c = build(Spec(seed=15, n_q=2))
    codes, q, tk, tv = c.codes, c.q, c.tail_k, c.tail_v

    def call(**kw):
        args = dict(codes=codes, q=q, tail_k=tk, tail_v=tv)
        args.update(kw)
        return kt.decode_attention(args.pop("codes"), args.pop("q"), args.pop("tail_k"),
                                   args.pop("tail_v"), **args)

    call()
    t = c.spec.total - c.spec.sink  # the call passes no sink rows
    call(mask=np.zeros((1, 2, t), np.float32))
    for kw, err in [
        (dict(q=q.astype(np.float64)), TypeError),
        (dict(q=q[0]), kt.InvalidInputError),
        (dict(q=q[:, :5]), kt.InvalidInputError),  # H_q not a multiple of H_kv
        (dict(q=q[..., :10]), kt.InvalidInputError),
        (dict(tail_k=tk[:, :, :1], tail_v=tv[:, :, :1]), kt.InvalidInputError),  # n_q > rows
        (dict(tail_v=tv[:, :, :3]), kt.InvalidInputError),
        (dict(sink_k=tk), kt.InvalidInputError),
        (dict(scale=float("nan")), kt.InvalidParameterError),
        (dict(scale="1"), TypeError),
        (dict(softcap=-1.0), kt.InvalidParameterError),
        (dict(window=0), kt.InvalidParameterError),
        (dict(window=1.5), TypeError),
        (dict(threads=0), kt.InvalidParameterError),
        (dict(mask=np.zeros((1, 2, 3), np.float32)), kt.InvalidInputError),
        (dict(mask=np.zeros((1, 2, t), np.float64)), TypeError),
        (dict(mask=np.zeros((1, 2, t + 1), np.float32)), kt.InvalidInputError),
        (dict(mask=np.full((1, 2, t), np.inf, np.float32)), kt.InvalidInputError),
        # Shapes are checked before anything is copied: huge broadcast views are refused.
        (dict(q=np.broadcast_to(np.float32(0), (1, 6, 2**31, q.shape[3]))), kt.InvalidInputError),
        (dict(mask=np.broadcast_to(True, (1, 2, 2**34))), kt.InvalidInputError),
        (dict(tail_k=np.broadcast_to(np.float32(0), (1, 2, 2**31, tk.shape[3]))), kt.InvalidInputError),
        (dict(codes="x"), TypeError),
        (dict(sink_logits=np.zeros(5, np.float32)), kt.InvalidInputError),  # not [H_q]
        (dict(sink_logits=np.array([0, 0, 0, 0, 0, np.nan], np.float32)), kt.InvalidInputError),
        (dict(sink_logits=np.zeros(6, np.int64)), TypeError),
        (dict(sink_logits="x"), TypeError),
    ]:
        with pytest.raises(err):
            call(**kw)
    with pytest.raises(kt.NumericalError, match="overflowed float32"):
        call(q=q / np.abs(q).max() * np.float32(3e38))  # finite, but the scores are not
    bad = q.copy()
    bad[0, 1, 1, 3] = np.nan
    with pytest.raises(kt.InvalidInputError, match="non-finite"):
        call(q=bad)
    with pytest.raises(TypeError):
        kt.LayerCodes(["not a codec"], [codes.v_codecs[0]])
    with pytest.raises(kt.InvalidParameterError):
        kt.LayerCodes(codes.k_codecs, codes.v_codecs[:1])
    with pytest.raises(kt.InvalidParameterError):
        kt.LayerCodes(codes.k_codecs, codes.v_codecs, batch=0)


def test_the_grid_covers_the_brief() -> None:
    specs = GRID
    assert {s.dk for s in specs} >= {64, 128, 256}
    assert {s.group for s in specs} >= {1, 8} and {s.n_q for s in specs} == {1, 2, 3, 4}
    assert {s.metric for s in specs} == {"mse", "inner_product", "linf"}
    assert {s.norm for s in specs} == {True, False}
    assert any(s.threshold for s in specs) and any(s.tables for s in specs)
    assert any(not s.blocks for s in specs) and max(len(s.blocks) for s in specs) >= 3
    assert any(s.softcap for s in specs) and any(s.window for s in specs)
    assert {s.mask for s in specs} >= {"additive", "bool"}
    assert dataclasses.replace(specs[0], seed=0) != specs[0]


def _table(n: int, rot: int, style: str = "half", scale: float = 1.0) -> "kt.RopeTable":
    """A base-10000 rotary table for positions ``0 .. n-1`` (cos/sin scaled as rope types do)."""
    inv = 1.0 / 10000.0 ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    ang = np.arange(n)[:, None] * inv[None]
    return kt.RopeTable((np.cos(ang) * scale).astype(np.float32), (np.sin(ang) * scale).astype(np.float32), style)


@pytest.mark.parametrize("spec, style, rot", [
    (GRID[1], "half", 64),
    (GRID[2], "interleaved", 128),
    (GRID[3], "half", 96),  # partial rotary of a 256-wide head
    (GRID[4], "interleaved", 64),  # a batch of 2 with a window and a mask
    (GRID[6], "half", 32),
])
def test_keys_before_rope_match_the_rotated_decode(spec: Spec, style: str, rot: int) -> None:
    """Sealed keys coded before RoPE: the kernel synthesises and rotates them; the reference
    decodes them and rotates them in float64. Batch row 1 starts with pad positions (1, as
    transformers gives padding) and then counts from 0."""
    c = build(spec)
    tc = c.codes.rows()
    positions = np.stack([np.arange(tc) + (spec.sink if b == 0 else 0) for b in range(spec.batch)])
    if spec.batch > 1:
        positions[1, :5] = 1
    table = _table(int(positions.max()) + 9, rot, style, scale=1.1)
    got = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, return_lse=True, rope=table,
                              positions=positions, synthesis="f32", **c.call())
    want = reference_attention(c.codes, c.q, c.tail_k, c.tail_v, rope=table, positions=positions, **c.call())
    s_mag, v_mag = magnitudes(c)
    compare(f"{spec} {style} rot {rot}", got, (want[0].numpy(), want[1].numpy()), 1.21 * s_mag, v_mag,
            TOL["attention_out"], TOL["attention_lse"])
    plain = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, **c.call())
    assert not np.allclose(plain, got[0])  # the rotation took part


@pytest.mark.parametrize("synthesis", ["bf16", "i16"])
def test_rounded_synthesis_stays_within_its_rounding(synthesis) -> None:
    """The default synthesis of keys coded before RoPE rounds ``M`` and the centroids to
    bfloat16, the fixed-point one to 16-bit integers in steps of their own (the Rust tests check
    both against a float64 reference of their definitions): here each moves the output off the
    float32 synthesis by about the rounding's share of the scores, not more, and it runs (the
    outputs differ)."""
    c = build(GRID[1])
    tc = c.codes.rows()
    positions = np.arange(tc)[None] + GRID[1].sink
    table = _table(int(positions.max()) + 9, 64, "half", scale=1.1)
    kw = dict(rope=table, positions=positions, return_lse=True, **c.call())
    got = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, synthesis=synthesis, **kw)
    f32 = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, synthesis="f32", **kw)
    if synthesis == "bf16":  # the default
        assert np.array_equal(got[0], kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, **kw)[0])
    s_mag, v_mag = magnitudes(c)
    d_out = np.abs(got[0] - f32[0]).max()
    d_lse = np.abs(got[1] - f32[1]).max()
    assert 0 < d_out <= 2.0 ** -6 * v_mag * (1 + 1.21 * s_mag), (d_out, s_mag, v_mag)
    assert d_lse <= 2.0 ** -6 * (1 + 1.21 * s_mag), d_lse
    with pytest.raises(kt.InvalidParameterError):
        kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, synthesis="fp16", **kw)


@pytest.mark.parametrize("spec", [
    Spec(seed=21, blocks=(512, 3), kv_heads=1, group=16, dk=128, dv=32, n_q=1),
    Spec(seed=22, batch=2, blocks=(129, 63), group=3, dk=64, dv=16, n_q=3, window=100,
         mask="additive", softcap=8.0, metric="inner_product"),
], ids=lambda s: f"seed{s.seed}")
def test_latent_attention_scores_both_streams_and_sums_the_latent(spec: Spec) -> None:
    """Multi-head latent attention (``latent=True``): the K stream is the latent, the V stream
    the rotated key part; queries ``[q_latent, q_rotated]`` score both, the output is the
    weighted sum of the latent rows. Against the float64 reference over the decoded rows."""
    c = build(spec)
    g = np.random.default_rng(spec.seed)
    q_rot = (g.standard_normal((*c.q.shape[:3], spec.dv)) * 0.3).astype(np.float32)
    q = np.ascontiguousarray(np.concatenate([c.q, q_rot], axis=-1))
    kw = dict(c.call(), scale=0.1)
    got = kt.decode_attention(c.codes, q, c.tail_k, c.tail_v, return_lse=True, latent=True, **kw)
    want = reference_attention(c.codes, q, c.tail_k, c.tail_v, latent=True, **kw)
    assert got[0].shape == (*c.q.shape[:3], spec.dk)
    from kakeyaturbo.reference.attention import decoded_kv

    k, v = decoded_kv(c.codes, c.sink_k, c.sink_v, c.tail_k, c.tail_v)
    kv = torch.cat([k, v], dim=-1).numpy().repeat(spec.group, axis=1)
    s_mag = float((np.abs(q.astype(np.float64)) @ np.abs(kv).transpose(0, 1, 3, 2)).max()) * 0.1
    compare(f"{spec} latent", got, (want[0].numpy(), want[1].numpy()), s_mag,
            float(np.abs(k.numpy()).max()), TOL["attention_out"], TOL["attention_lse"])
    # The rotated part counts: without it the weights differ.
    q0 = q.copy()
    q0[..., spec.dk:] = 0
    other = kt.decode_attention(c.codes, q0, c.tail_k, c.tail_v, return_lse=True, latent=True, **kw)
    assert np.abs(other[1] - got[1]).max() > 1e-4
    with pytest.raises(kt.InvalidInputError, match="D_k \\+ D_v"):
        kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, latent=True, **kw)
    with pytest.raises(kt.InvalidParameterError, match="latent attention takes no rope"):
        kt.decode_attention(c.codes, q, c.tail_k, c.tail_v, latent=True, rope=_table(1000, 16),
                            positions=np.arange(c.codes.rows())[None].repeat(spec.batch, 0), **kw)


def test_rope_tables_and_positions_are_checked() -> None:
    c = build(Spec(seed=16, blocks=(100,)))
    codes, q, tk, tv = c.codes, c.q, c.tail_k, c.tail_v
    table = _table(200, 64)
    pos = np.arange(100)[None]
    kt.decode_attention(codes, q, tk, tv, rope=table, positions=pos)
    for kw, err in [
        (dict(rope=table), kt.InvalidInputError),  # positions missing
        (dict(positions=pos), kt.InvalidInputError),  # table missing
        (dict(rope="table", positions=pos), TypeError),
        (dict(rope=table, positions=pos.astype(np.float32)), TypeError),
        (dict(rope=table, positions=pos[:, :50]), kt.InvalidInputError),  # not every sealed row
        (dict(rope=table, positions=pos[0]), kt.InvalidInputError),
        (dict(rope=table, positions=pos + 150), kt.InvalidInputError),  # past the table
        (dict(rope=table, positions=pos - 1), kt.InvalidInputError),  # negative
        (dict(rope=_table(200, 80), positions=pos), kt.InvalidParameterError),  # rot > D_k
    ]:
        with pytest.raises(err):
            kt.decode_attention(codes, q, tk, tv, **kw)
    # The kernel's own call, as the cache makes it: a rope tuple of another length or kind is a
    # TypeError (PyO3's ValueError before).
    d = q.shape[3]
    empty = np.zeros((1, codes.kv_heads, 0, d), np.float32)
    args = table.kernel_args(pos.astype(np.int32).view(np.uint32), "bf16")
    for rot in (args[:3], args + (1,), "rope"):
        with pytest.raises(TypeError, match="rope must be"):
            codes.kernel_attend(q[:, :, -1:], empty, empty, tk[:, :, -1:], tv[:, :, -1:], None,
                                d ** -0.5, None, None, 1, rot, False)
    # Queries and raw rows as float32 or as bfloat16 bits (uint16, widened exactly); another
    # dtype is a TypeError whichever the kernel tries first.
    q1, tk1, tv1 = (np.ascontiguousarray(x[:, :, -1:]) for x in (q, tk, tv))
    bits = [(x.view(np.uint32) >> 16).astype(np.uint16) for x in (q1, tk1, tv1)]
    wide = [(b.astype(np.uint32) << 16).view(np.float32) for b in bits]
    got = codes.kernel_attend(bits[0], empty, empty, bits[1], bits[2], None, d ** -0.5, None, None, 1, args, False)
    want = codes.kernel_attend(wide[0], empty, empty, wide[1], wide[2], None, d ** -0.5, None, None, 1, args, False)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    for bad in (q1.astype(np.float64), q1.astype(np.float16), q1.view(np.int32), q1.tolist()):
        with pytest.raises(TypeError):
            codes.kernel_attend(bad, empty, empty, tk1, tv1, None, d ** -0.5, None, None, 1, args, False)
    cos, sin = table.cos, table.sin
    for args, err in [
        ((cos, sin[:, :3]), kt.InvalidInputError),
        ((cos.astype(np.float64), sin), TypeError),
        ((cos, sin, "diagonal"), kt.InvalidParameterError),
        ((np.full_like(cos, np.nan), sin), kt.InvalidInputError),
        ((cos[:0], sin[:0]), kt.InvalidInputError),
    ]:
        with pytest.raises(err):
            kt.RopeTable(*args)
    full_c = np.concatenate([cos, cos], axis=1)
    full_s = np.concatenate([sin, sin], axis=1)
    same = kt.RopeTable.from_full(full_c, full_s, "half")
    assert np.array_equal(same.cos, cos) and same.rot_dim == 64 and same.n_positions == 200
    with pytest.raises(kt.InvalidInputError, match="repeat each frequency"):
        kt.RopeTable.from_full(full_c, full_s, "interleaved")
    assert same.nbytes == 2 * 200 * 32 * 4


def test_key_synthesis_is_what_decodes_and_its_bf16_rounding() -> None:
    """``CalibratedCodec.key_synthesis("bf16")`` (the factors the default kernel multiplies) is
    each entry of ``"f32"`` rounded to bfloat16 (nearest even, below 2^-56 to 0; that ``mean + g c
    M`` decodes a row is checked by the Rust tests); another mode is refused."""
    c = build(GRID[1])
    codec = c.codes.k_codecs[0]
    m32, m16 = codec.key_synthesis("f32"), codec.key_synthesis()
    assert m32.shape == m16.shape == (codec.m, codec.d) and m32.dtype == m16.dtype == np.float32
    b = m32.view(np.uint32).astype(np.uint64)
    want = (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    want = np.where(np.abs(m32) < 2.0 ** -56, np.float32(0), want)
    assert np.array_equal(m16.view(np.uint32), want.view(np.uint32))
    with pytest.raises(kt.InvalidParameterError, match="synthesis"):
        codec.key_synthesis("f16")


def test_key_synthesis_i16_is_integer_steps_that_keep_sums_exact() -> None:
    """``key_synthesis("i16")``: each channel's column is integers times one step, within half
    a step of ``"f32"``, the integers at most 32767 and their magnitudes summing to at most 65535
    (so that with centroids of at most 32767 steps every 32-bit sum is exact), the largest
    reaching one of those limits (the step is the smallest that keeps both)."""
    c = build(GRID[1])
    codec = c.codes.k_codecs[0]
    m32, m16 = codec.key_synthesis("f32").astype(np.float64), codec.key_synthesis("i16").astype(np.float64)
    for i in range(codec.d):
        col = m16[:, i]
        # The definition's step: the smallest with every integer at most 32767 and their
        # magnitudes summing to at most 65535 - m (room for the rounding's m / 2).
        step = max(np.abs(m32[:, i]).sum() / (65535 - codec.m), np.abs(m32[:, i]).max() / 32767)
        w = col / step
        assert np.all(np.abs(w - np.round(w)) <= 1e-6 * np.abs(w) + 1e-6), i
        assert np.abs(np.round(w)).max() <= 32767 and np.abs(np.round(w)).sum() <= 65535
        assert np.isclose(np.abs(np.round(w)).max(), 32767) or np.abs(np.round(w)).sum() >= 65535 - 1.5 * codec.m
        assert np.abs(col - m32[:, i]).max() <= 0.5 * step * (1 + 1e-5)


def test_the_kernel_named_is_the_one_the_cpu_runs() -> None:
    """`attention_kernel` names the fastest instruction set the CPU's flags allow (Linux)."""
    name = kt.attention_kernel()
    assert name in ("avx512", "avx2", "portable")
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not flags:
        pytest.skip("no CPU flags listed (not x86)")
    if {"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "fma", "f16c"} <= flags:
        assert name == "avx512"
    elif {"avx2", "fma", "f16c", "bmi2"} <= flags:
        assert name == "avx2"
    else:
        assert name == "portable"


def test_layer_codes_pickle_and_copy_as_independent_stores() -> None:
    c = build(Spec(seed=14, batch=2, blocks=(100, 30)))
    codes = c.codes
    codes.select([1, 0, 1])  # rows sharing their containers
    q, tk, tv, sk, sv = (x[[1, 0, 1]] for x in (c.q, c.tail_k, c.tail_v, c.sink_k, c.sink_v))
    out = kt.decode_attention(codes, q, tk, tv, sink_k=sk, sink_v=sv)
    for other in (pickle.loads(pickle.dumps(codes)), copy.copy(codes), copy.deepcopy(codes)):
        assert type(other) is kt.LayerCodes and other.batch == 3 and other.rows() == 130
        assert all(other.blob(b, h, s, i) == codes.blob(b, h, s, i)
                   for b, h, s, i in itertools.product(range(3), range(2), "kv", range(2)))
        assert np.array_equal(kt.decode_attention(other, q, tk, tv, sink_k=sk, sink_v=sv), out)
        other.pop_block()  # independent of the original
        assert other.rows() == 100 and codes.rows() == 130
    # A damaged pickle is a typed error, not a crash or a partial store.
    fn, (kc, vc, batch, blocks) = codes.__reduce__()
    k, v = blocks[2][1][1]
    with pytest.raises(kt.CorruptDataError):
        fn(kc, vc, batch, [*blocks[:2], [blocks[2][0], [blocks[2][1][0], (k[:-3], v)]]])
    for bad in ([], blocks[:2], [*blocks[:2], [blocks[2][0]]], [*blocks[:2], [blocks[2][0], [(k,)]]],
                [*blocks[:2], [blocks[2][0], "kv"]]):
        with pytest.raises(kt.InvalidInputError, match="pickled LayerCodes"):
            fn(kc, vc, batch, bad)
