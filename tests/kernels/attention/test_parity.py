"""The Triton decode attention against the Rust kernel. The CI subset runs by default (CPU:
Triton's interpreter, a few seconds); ``KAKEYATURBO_FULL_FUZZ=1`` runs 300 random cases, and
60 random cases of keys coded before RoPE."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

import torch  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import kernels as K  # noqa: E402
from kakeyaturbo.errors import InvalidInputError, InvalidParameterError  # noqa: E402
from kakeyaturbo.kernels.attention import stack_rope  # noqa: E402
from kakeyaturbo.reference.attention import reference_attention  # noqa: E402

from . import parity  # noqa: E402
from ..conftest import DEVICE, FULL_FUZZ  # noqa: E402

CASES = parity.make_cases(FULL_FUZZ)
ROPE_CASES = parity.make_rope_cases(FULL_FUZZ)


@pytest.mark.parametrize("spec", CASES, ids=lambda s: f"seed{s.seed}")
def test_triton_attention_matches_rust(spec: parity.Spec) -> None:
    r = parity.run(spec, DEVICE)
    assert r.out_error <= parity.TOL["attention_triton"]


@pytest.mark.parametrize("rope", ROPE_CASES, ids=lambda r: f"rope_seed{r.seed}_{r.style}")
def test_triton_attention_before_rope_matches_rust(rope: parity.RopeSpec) -> None:
    r = parity.run(rope, DEVICE)
    assert r.out_error <= parity.TOL["attention_triton_rope"]
    assert r.lse_error <= parity.TOL["attention_triton_rope"]


def test_the_subset_covers_the_brief() -> None:
    assert all(parity.covered(list(parity.SUBSET)))
    assert all(parity.covered_rope(list(parity.ROPE_SUBSET)))


def test_the_rotation_changes_the_result() -> None:
    """The pre-RoPE mode is not the plain one, nor the other pairing (the parity above could
    not tell them apart otherwise)."""
    r = parity.ROPE_SUBSET[0]
    c = parity.build(r.spec)
    table, pos = parity.rope_inputs(r)
    layer = K.stack_layer(c.codes, DEVICE)
    q = torch.from_numpy(c.q).to(DEVICE)
    outs = [K.decode_attention_triton(layer, q, c.tail_k, c.tail_v, **c.call(), **kw)[0].cpu().numpy()
            for kw in ({}, dict(rope=table, positions=pos),
                       dict(rope=kt.RopeTable(table.cos, table.sin, "interleaved"), positions=pos))]
    scale = np.abs(outs[1]).max()
    assert np.abs(outs[0] - outs[1]).max() > 1e-3 * scale
    assert np.abs(outs[2] - outs[1]).max() > 1e-3 * scale


def test_learnt_sink_logits_as_in_rust() -> None:
    """GPT-OSS's learnt sinks, one logit per query head, through the Triton kernel as through the
    Rust one (keys before RoPE); a bad one is refused alike."""
    r = parity.ROPE_SUBSET[0]
    c = parity.build(r.spec)
    table, pos = parity.rope_inputs(r)
    sinks = np.linspace(-1.0, 3.0, c.q.shape[1], dtype=np.float32)
    kw = dict(**c.call(), rope=table, positions=pos, sink_logits=sinks)
    want = kt.decode_attention(c.codes, c.q, c.tail_k, c.tail_v, return_lse=True, **kw)
    layer = K.stack_layer(c.codes, DEVICE)
    out, lse = K.decode_attention_triton(layer, torch.from_numpy(c.q).to(DEVICE), c.tail_k, c.tail_v, **kw)
    s_mag, v_mag = parity.rope_magnitudes(c, r, table, pos)
    limit = parity.TOL["attention_triton_rope"]
    parity.compare("triton vs rust, sinks", (out.cpu().numpy(), lse.cpu().numpy()), want, s_mag, v_mag,
                   limit, limit)
    with pytest.raises(ValueError, match="sink_logits"):
        K.decode_attention_triton(layer, torch.from_numpy(c.q).to(DEVICE), c.tail_k, c.tail_v,
                                  **dict(kw, sink_logits=sinks[:-1]))
    # A tensor off the CPU is checked for shape and dtype without reading it (a meta tensor here).
    for bad in (torch.zeros(len(sinks) - 1, device="meta"), torch.zeros(len(sinks), dtype=torch.int32, device="meta")):
        with pytest.raises(ValueError, match=r"sink_logits must be floating point \[H_q="):
            K.decode_attention_triton(layer, torch.from_numpy(c.q).to(DEVICE), c.tail_k, c.tail_v,
                                      **dict(kw, sink_logits=bad))


def test_rope_arguments_are_checked() -> None:
    r = parity.ROPE_SUBSET[2]
    c = parity.build(r.spec)
    table, pos = parity.rope_inputs(r)
    layer = K.stack_layer(c.codes, DEVICE)
    q = torch.from_numpy(c.q).to(DEVICE)

    def call(**kw: object) -> None:
        K.decode_attention_triton(layer, q, c.tail_k, c.tail_v, **c.call(), **kw)

    with pytest.raises(ValueError, match="both rope and positions"):
        call(rope=table)
    with pytest.raises(ValueError, match="both rope and positions"):
        call(positions=pos)
    with pytest.raises(ValueError, match="RopeTable"):
        call(rope=(table.cos, table.sin), positions=pos)
    with pytest.raises(ValueError, match="integers"):
        call(rope=table, positions=pos.astype(np.float32))
    with pytest.raises(ValueError, match=r"\[B=1, T_c=41\]"):
        call(rope=table, positions=pos[:, :-1])
    bad = pos.copy()
    bad[0, 3] = table.n_positions
    with pytest.raises(ValueError, match="must lie in"):
        call(rope=table, positions=bad)
    bad[0, 3] = -1
    with pytest.raises(ValueError, match="must lie in"):
        call(rope=table, positions=bad)
    wide = kt.RopeTable(np.ones((4, 17), np.float32), np.zeros((4, 17), np.float32))
    with pytest.raises(ValueError, match="exceeds D_k"):
        call(rope=wide, positions=np.zeros_like(pos))
    with pytest.raises(ValueError, match="synthesis"):
        call(rope=table, positions=pos, synthesis="f16")
    # A staged table gives the same bits as the table passed directly.
    a = K.decode_attention_triton(layer, q, c.tail_k, c.tail_v, **c.call(), rope=table, positions=pos)
    b = K.decode_attention_triton(layer, q, c.tail_k, c.tail_v, **c.call(),
                                  rope=stack_rope(table, DEVICE), positions=torch.from_numpy(pos))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_inputs_are_refused_as_in_rust() -> None:
    """What :func:`kakeyaturbo.decode_attention` refuses, the Triton wrapper refuses before any
    launch, with the same error type: NaN / inf queries and raw rows, NaN / +inf mask values,
    no query heads or tokens, a window that is not an int, a softcap that is not a number."""
    c = parity.build(parity.Spec(seed=7, batch=1, kv_heads=2, group=2, dk=32, dv=32, blocks=(20,), sink=1,
                                 tail=3, n_q=1))
    layer = K.stack_layer(c.codes, DEVICE)

    def both(error: type, match: str, q: np.ndarray = c.q, tk: np.ndarray = c.tail_k, **kw: object) -> None:
        args = dict(sink_k=c.sink_k, sink_v=c.sink_v, **kw)
        with pytest.raises(error, match=match):
            kt.decode_attention(c.codes, q, tk, c.tail_v, **args)
        with pytest.raises(error, match=match):
            K.decode_attention_triton(layer, torch.from_numpy(q).to(DEVICE), tk, c.tail_v, **args)

    q = c.q.copy()
    q[0, 1, 0, 3] = np.nan
    both(InvalidInputError, "q holds a non-finite value at flat index 35", q=q)
    tk = c.tail_k.copy()
    tk[0, 1, 2, 0] = np.inf
    both(InvalidInputError, "tail keys holds a non-finite value at flat index 160", tk=tk)
    total = 1 + 20 + 3
    for v, shown in ((np.nan, "NaN"), (np.inf, "inf")):
        mask = np.zeros((1, 1, total), np.float32)
        mask[0, 0, 5] = v
        both(InvalidInputError, f"mask values must be finite or -inf; flat index 5 is {shown}", mask=mask)
    mask = np.zeros((1, 1, total), np.float32)
    mask[0, 0, :4] = -np.inf  # -inf is a mask's "do not attend"
    K.decode_attention_triton(layer, torch.from_numpy(c.q).to(DEVICE), c.tail_k, c.tail_v,
                              sink_k=c.sink_k, sink_v=c.sink_v, mask=mask)
    both(InvalidInputError, "n_q must be >= 1", q=c.q[:, :, :0])
    both(InvalidInputError, r"query heads \(0\) must be a positive multiple", q=c.q[:, :0])
    for window in (1.5, True):
        both(TypeError, "window must be an int", window=window)
    for window in (2**32, 2**70):  # Triton took 2**40 and raised OverflowError at 2**70
        both(InvalidParameterError, r"window must be in 1\.\.=?4294967295", window=window)
    with pytest.raises(TypeError, match="softcap must be a number"):
        K.decode_attention_triton(layer, torch.from_numpy(c.q).to(DEVICE), c.tail_k, c.tail_v, softcap=True,
                                  sink_k=c.sink_k, sink_v=c.sink_v)
    with pytest.raises(TypeError, match="mask must be float32"):
        K.decode_attention_triton(layer, torch.from_numpy(c.q).to(DEVICE), c.tail_k, c.tail_v,
                                  sink_k=c.sink_k, sink_v=c.sink_v, mask=np.zeros((1, 1, total), np.int64))


def test_reference_attention_refuses_queries_that_do_not_fit() -> None:
    """The float64 reference raises what decode_attention raises (not a torch RuntimeError or
    an empty result) for queries that do not fit the layer."""
    c = parity.build(parity.Spec(seed=7, batch=1, kv_heads=2, group=2, dk=32, dv=32, blocks=(20,), sink=1,
                                 tail=3, n_q=1))
    for shape, match in (((1, 3, 1, 32), "multiple of the kv-heads"), ((1, 1, 1, 32), "multiple of the kv-heads"),
                         ((1, 4, 1, 16), "q must be"), ((1, 4, 5, 32), "tokens"), ((1, 4, 0, 32), "tokens")):
        q = np.zeros(shape, np.float32)
        with pytest.raises(InvalidInputError):
            kt.decode_attention(c.codes, q, c.tail_k, c.tail_v, **c.call())
        with pytest.raises(InvalidInputError, match=match):
            reference_attention(c.codes, q, c.tail_k, c.tail_v, **c.call())
