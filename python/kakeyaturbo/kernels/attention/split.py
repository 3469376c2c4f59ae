"""Decode attention over the codes, first launch: one program per (batch row, kv-head) pair and
piece of the positions (flash-decoding), each leaving a partial softmax.

A piece of sealed rows moves the pair's queries (``G * n_q`` rows, padded to ``QP``) into the
K codes' domain once (``w = r H(s S' q)`` per sub-band, ``q . mean``), then per tile of ``BN``
rows: unpacks the K indices of every slot (its byte and shift, at most two bytes since widths
are <= 8), looks up the centroids, applies the outliers, scores ``g (w . c) + q . mean``,
softcap, mask, causal and window rules, the online softmax, and adds ``p g`` times the V
centroids into a code-domain sum ``[QP, MPV]`` (the synthesis waits for ``combine.py``). The
last piece of every pair runs over its raw rows (sink, then tail) exactly. Nothing is decoded
to ``D`` wide rows.

Keys coded before RoPE (``ROPE``): the score of a sealed row depends on its position, so the
queries are not moved into the code domain; instead each tile of ``BN`` rows is synthesised
from its centroids ``C [BN, MP]`` (:func:`rope_scores`): ``K = g * (C M) + mean`` with ``M``
(:attr:`~.batch.LayerBatch.key_synthesis`, ``[MP, D]``), each pair ``(a, b)`` of the rotation
turned by the cos / sin of the row's position (``K_a' = K_a cos + (-K_b) sin``, ``K_b' = K_b
cos + K_a sin``; channels past ``rot`` as they are), and dotted with the scaled queries as a
raw row is. The decoded tile stays in registers; the softcap, mask, softmax and value path are
unchanged.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._common import band_hadamard, check_device, empty, from_scaled_f16, is_interpreter, next_pow2, placeholder
from ..calibrated.decode import row_centroids
from .batch import LayerBatch, RopeBatch
from ...errors import InvalidInputError


@triton.jit
def tanh(x):
    """``sign(x) (1 - e) / (1 + e)``, ``e = exp(-2 |x|)`` (the Rust kernel's formula)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def stream_rows(codes_ptr, PB, sbits_ptr, sexp_ptr, rstart_ptr, opos_ptr, obits_ptr,
                m_ptr, rb_ptr, col_ptr, bits_ptr, byte_ptr, shift_ptr, cent_ptr,
                bh, h, rows, rmask, TC, norm, has_out, MP: tl.constexpr):
    """The centroids ``[BN, MP]`` (slot order, outliers applied, 0 in padding slots and past
    the rows) and scales ``[BN]`` (0 past the rows) of rows ``rows`` of pair ``bh``, whose
    kv-head ``h`` gives the calibration."""
    q = row_centroids(codes_ptr + bh * PB, rstart_ptr + bh * (TC + 1), opos_ptr, obits_ptr, m_ptr, rb_ptr,
                      col_ptr, bits_ptr, byte_ptr, shift_ptr, cent_ptr, h, rows, rmask, has_out, MP)
    g = tl.where(rmask, 1.0, 0.0)
    if norm != 0:
        g = from_scaled_f16(tl.load(sbits_ptr + bh * TC + rows, mask=rmask, other=0),
                            tl.load(sexp_ptr + bh * TC + rows, mask=rmask, other=0))
    return q, g


@triton.jit
def finish_scores(s, pos, rmask, rvalid, qpos, b, i, mask_ptr, NQ, T, softcap, window, has_mask):
    """Softcap, then the mask, and ``-inf`` where a query does not see a position (causal,
    window, past the rows, padding query rows)."""
    if softcap > 0:
        s = softcap * tanh(s / softcap)
    seen = rmask[None, :] & rvalid[:, None] & (pos[None, :] <= qpos[:, None])
    if window > 0:
        seen = seen & (qpos[:, None] - pos[None, :] < window)
    if has_mask != 0:
        s = s + tl.load(mask_ptr + (b * NQ + i)[:, None] * T + pos[None, :], mask=seen, other=0.0)
    return tl.where(seen, s, float("-inf"))


@triton.jit
def online_softmax(s, mx, den):
    """One tile of the online softmax: returns the new maximum, denominator, the weights and
    the factor the sums so far are multiplied by (rows that have seen nothing stay at
    ``-inf`` / 0)."""
    new = tl.maximum(mx, tl.max(s, 1))
    safe = tl.where(new == float("-inf"), 0.0, new)
    alpha = tl.exp(mx - safe)
    p = tl.exp(s - safe[:, None])
    return new, den * alpha + tl.sum(p, 1), p, alpha


def _rope_chunk(half: int, bdc: int, bn: int, mp: int) -> int:
    """Frequencies per chunk of :func:`rope_scores`: at most ``BDC`` and the rotary half, and
    ``BN * MP * BR <= 2**15`` so that the chunk's synthesis tiles stay in registers
    (``tests/kernels/compile_check.py``, stack per thread with tiles of 16 rows on 8 warps: 24-56
    B at ``MP`` 64, 328 B (float32 synthesis) and 464 B (bf16 on the tensor cores) at ``MP``
    128; with the tiles of 64 rows and the bound ``2**18`` of commit 3c95fab, 2.2-4.1 KB)."""
    return max(16, min(bdc, next_pow2(half), (1 << 15) // (bn * mp)))


@triton.jit
def rope_scores(kq, gk, rows, rmask, b, h, qrow, rvalid, scale, q_ptr,
                ksm_ptr, kmean_ptr, cos_ptr, sin_ptr, posn_ptr, TC, DK, NPOS, HALF, interleaved,
                QP: tl.constexpr, BN: tl.constexpr, MP: tl.constexpr, BR: tl.constexpr,
                BDC: tl.constexpr, BF16: tl.constexpr, MMA: tl.constexpr, I16: tl.constexpr):
    """Scores ``[QP, BN]`` of a tile of keys coded before RoPE: centroids ``kq [BN, MP]`` and
    scales ``gk [BN]`` of rows ``rows`` (``stream_rows``) of batch row ``b``, kv-head ``h``.

    Per chunk of ``BR`` frequencies ``i`` (pair channels ``a = i``, ``b = i + rot/2``, or
    ``2i``, ``2i + 1`` when ``interleaved``): ``K_a = g (C M_a) + mean_a`` (the same for
    ``b``), cos / sin of frequency ``i`` at each row's position (``positions[b, row]``, the
    frequency-major tables ``[rot/2, NPOS]``), ``K_a' = K_a cos + (-K_b) sin``, ``K_b' = K_b
    cos + K_a sin``, ``s += (q_a scale) . K_a' + (q_b scale) . K_b'``; then the channels
    ``rot .. D`` in chunks of ``BDC``, unrotated. Rows past the tile's count read position 0
    and cos = sin = 0 (their scores are masked later). ``BF16``: the centroids rounded to
    bfloat16 (to nearest even; below 2^-56 to 0) as the Rust kernel's default synthesis rounds
    them, ``M`` (``ksm``) already rounded by Rust (:attr:`~.batch.LayerBatch.key_synthesis_bf16`);
    the products are then exact in float32 and only the order of the float32 sums differs;
    ``MMA`` (with ``BF16``) takes those dots in bfloat16 on the tensor cores, float32 sums (the
    operands are bfloat16 values already, so the products are the same). ``I16``: the
    centroids in steps of 1/256, clamped to ±32767 steps and rounded to nearest even (adding
    and taking away 1.5 * 2**23), as the Rust kernel's fixed-point synthesis takes them, ``M``
    its weights times their steps (:attr:`~.batch.LayerBatch.key_synthesis_i16`); float32 sums
    of what Rust sums exactly in integers."""
    if BF16:  # round to nearest even on the bits (the cast's rounding is the backend's choice)
        kb = kq.to(tl.uint32, bitcast=True)
        kb = (kb + 0x7FFF + ((kb >> 16) & 1)) & 0xFFFF0000
        kq = tl.where(tl.abs(kq) < 1.3877787807814457e-17, 0.0, kb.to(tl.float32, bitcast=True))
    if I16:
        kv = tl.minimum(tl.maximum(kq * 256.0, -32767.0), 32767.0)
        kq = ((kv + 12582912.0) - 12582912.0) * 0.00390625
    kq_mma = kq.to(tl.bfloat16)  # exact when BF16 (the low bits are 0); used only with MMA
    hk = h * MP + tl.arange(0, MP)
    pos = tl.load(posn_ptr + b * TC + rows, mask=rmask, other=0).to(tl.int64)
    s = tl.zeros((QP, BN), tl.float32)
    for f0 in range(0, HALF, BR):
        f = f0 + tl.arange(0, BR)
        fm = f < HALF
        ca = tl.where(interleaved != 0, 2 * f, f)
        cb = tl.where(interleaved != 0, 2 * f + 1, f + HALF)
        ma = tl.load(ksm_ptr + hk[:, None] * DK + ca[None, :], mask=fm[None, :], other=0.0)
        mb = tl.load(ksm_ptr + hk[:, None] * DK + cb[None, :], mask=fm[None, :], other=0.0)
        if BF16 and MMA:
            ca_ = tl.dot(kq_mma, ma.to(tl.bfloat16), out_dtype=tl.float32)
            cb_ = tl.dot(kq_mma, mb.to(tl.bfloat16), out_dtype=tl.float32)
        else:
            ca_ = tl.dot(kq, ma, input_precision="ieee")
            cb_ = tl.dot(kq, mb, input_precision="ieee")
        ya = gk[:, None] * ca_ + tl.load(kmean_ptr + h * DK + ca, mask=fm, other=0.0)[None, :]
        yb = gk[:, None] * cb_ + tl.load(kmean_ptr + h * DK + cb, mask=fm, other=0.0)[None, :]
        at = f.to(tl.int64)[None, :] * NPOS + pos[:, None]
        m2 = rmask[:, None] & fm[None, :]
        c = tl.load(cos_ptr + at, mask=m2, other=0.0)
        sn = tl.load(sin_ptr + at, mask=m2, other=0.0)
        ra = ya * c + (-yb) * sn
        rb = yb * c + ya * sn
        qm = rvalid[:, None] & fm[None, :]
        qa = tl.load(q_ptr + qrow[:, None] * DK + ca[None, :], mask=qm, other=0.0) * scale
        qb = tl.load(q_ptr + qrow[:, None] * DK + cb[None, :], mask=qm, other=0.0) * scale
        s += tl.dot(qa, tl.trans(ra), input_precision="ieee")
        s += tl.dot(qb, tl.trans(rb), input_precision="ieee")
    for d0 in range(2 * HALF, DK, BDC):
        dc = d0 + tl.arange(0, BDC)
        dcm = dc < DK
        md = tl.load(ksm_ptr + hk[:, None] * DK + dc[None, :], mask=dcm[None, :], other=0.0)
        if BF16 and MMA:
            cd_ = tl.dot(kq_mma, md.to(tl.bfloat16), out_dtype=tl.float32)
        else:
            cd_ = tl.dot(kq, md, input_precision="ieee")
        y = gk[:, None] * cd_ + tl.load(kmean_ptr + h * DK + dc, mask=dcm, other=0.0)[None, :]
        qc = tl.load(q_ptr + qrow[:, None] * DK + dc[None, :], mask=rvalid[:, None] & dcm[None, :],
                     other=0.0) * scale
        s += tl.dot(qc, tl.trans(y), input_precision="ieee")
    return s


@triton.jit(do_not_specialize=["kpb", "vpb", "HKV", "G", "NQ", "TC", "SROWS", "RAW", "T", "DK", "DV",
                               "NCODE", "NS", "WACC", "scale", "softcap", "window", "has_mask",
                               "knorm", "vnorm", "kout", "vout", "NPOS", "HALF", "interleaved", "SPLIT"])
def _split_kernel(
    q_ptr, rk_ptr, rv_ptr, mask_ptr,
    kc_ptr, kpb, ksb_ptr, kse_ptr, krs_ptr, kop_ptr, kob_ptr,
    km_ptr, krb_ptr, kcol_ptr, kbits_ptr, kwidth_ptr, krnorm_ptr, ksigns_ptr, kbyte_ptr, kshift_ptr,
    kcent_ptr, ksyn_ptr, kmean_ptr, ksm_ptr, cos_ptr, sin_ptr, posn_ptr,
    vc_ptr, vpb, vsb_ptr, vse_ptr, vrs_ptr, vop_ptr, vob_ptr,
    vm_ptr, vrb_ptr, vcol_ptr, vbits_ptr, vbyte_ptr, vshift_ptr, vcent_ptr,
    pm_ptr, pl_ptr, pacc_ptr,
    HKV, G, NQ, TC, SROWS, RAW, T, DK, DV, NCODE, NS, WACC,
    scale, softcap, window, has_mask, knorm, vnorm, kout, vout, NPOS, HALF, interleaved, SPLIT,
    QP: tl.constexpr, MPK: tl.constexpr, LOG_MPK: tl.constexpr, MPV: tl.constexpr,
    BN: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, BDC: tl.constexpr,
    ROPE: tl.constexpr, BR: tl.constexpr, BF16: tl.constexpr, MMA: tl.constexpr, I16: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    r = tl.arange(0, QP)
    rvalid = r < G * NQ
    g = r // NQ
    i = r % NQ
    qrow = (b * (HKV * G) + h * G + g) * NQ + i
    dk = tl.arange(0, BDK)
    dkm = dk < DK
    qs = tl.load(q_ptr + qrow[:, None] * DK + dk[None, :], mask=rvalid[:, None] & dkm[None, :], other=0.0)
    qs = qs * scale
    qpos = T - NQ + i
    mx = tl.full((QP,), float("-inf"), tl.float32)
    den = tl.zeros((QP,), tl.float32)
    out_at = (bh * NS + sp) * QP + r
    if sp < NCODE:
        if not ROPE:
            hk = h * MPK + tl.arange(0, MPK)
            # S' q and q . mean in chunks of BDC columns (S' is MPK x D: too big for shared
            # memory at once when both are 256).
            v = tl.zeros((QP, MPK), tl.float32)
            qm = tl.zeros((QP,), tl.float32)
            for d0 in range(0, DK, BDC):
                dc = d0 + tl.arange(0, BDC)
                dcm = dc < DK
                qc = tl.load(q_ptr + qrow[:, None] * DK + dc[None, :],
                             mask=rvalid[:, None] & dcm[None, :], other=0.0) * scale
                syn = tl.load(ksyn_ptr + hk[:, None] * DK + dc[None, :], mask=dcm[None, :], other=0.0)
                v += tl.dot(qc, tl.trans(syn), input_precision="ieee")
                qm += tl.sum(qc * tl.load(kmean_ptr + h * DK + dc, mask=dcm, other=0.0)[None, :], 1)
            v = v * tl.load(ksigns_ptr + hk)[None, :]
            v = band_hadamard(v, tl.load(kwidth_ptr + hk)[None, :], QP, MPK, LOG_MPK)
            w = v * tl.load(krnorm_ptr + hk)[None, :]
        acc = tl.zeros((QP, MPV), tl.float32)
        lo = sp * SPLIT
        hi = tl.minimum(lo + SPLIT, TC)
        for t0 in range(lo, hi, BN):
            rows = t0 + tl.arange(0, BN)
            rmask = rows < hi
            kq, gk = stream_rows(kc_ptr, kpb, ksb_ptr, kse_ptr, krs_ptr, kop_ptr, kob_ptr,
                                 km_ptr, krb_ptr, kcol_ptr, kbits_ptr, kbyte_ptr, kshift_ptr, kcent_ptr,
                                 bh, h, rows, rmask, TC, knorm, kout, MPK)
            if ROPE:
                s = rope_scores(kq, gk, rows, rmask, b, h, qrow, rvalid, scale, q_ptr,
                                ksm_ptr, kmean_ptr, cos_ptr, sin_ptr, posn_ptr, TC, DK, NPOS, HALF,
                                interleaved, QP, BN, MPK, BR, BDC, BF16, MMA, I16)
            else:
                s = gk[None, :] * tl.dot(w, tl.trans(kq), input_precision="ieee") + qm[:, None]
            s = finish_scores(s, SROWS + rows, rmask, rvalid, qpos, b, i, mask_ptr, NQ, T, softcap,
                              window, has_mask)
            mx, den, p, alpha = online_softmax(s, mx, den)
            vq, gv = stream_rows(vc_ptr, vpb, vsb_ptr, vse_ptr, vrs_ptr, vop_ptr, vob_ptr,
                                 vm_ptr, vrb_ptr, vcol_ptr, vbits_ptr, vbyte_ptr, vshift_ptr, vcent_ptr,
                                 bh, h, rows, rmask, TC, vnorm, vout, MPV)
            acc = acc * alpha[:, None] + tl.dot(p * gv[None, :], vq, input_precision="ieee")
        cols = tl.arange(0, MPV)
        tl.store(pacc_ptr + out_at[:, None] * WACC + cols[None, :], acc)
    else:
        dv = tl.arange(0, BDV)
        dvm = dv < DV
        racc = tl.zeros((QP, BDV), tl.float32)  # not `acc`: Triton 3.6 types names across branches
        for t0 in range(0, RAW, BN):
            rows = t0 + tl.arange(0, BN)
            rmask = rows < RAW
            at = bh * RAW + rows
            kt = tl.load(rk_ptr + at[:, None] * DK + dk[None, :], mask=rmask[:, None] & dkm[None, :], other=0.0)
            s = tl.dot(qs, tl.trans(kt), input_precision="ieee")
            pos = tl.where(rows < SROWS, rows, rows + TC)
            s = finish_scores(s, pos, rmask, rvalid, qpos, b, i, mask_ptr, NQ, T, softcap, window,
                              has_mask)
            mx, den, p, alpha = online_softmax(s, mx, den)
            vt = tl.load(rv_ptr + at[:, None] * DV + dv[None, :], mask=rmask[:, None] & dvm[None, :], other=0.0)
            racc = racc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        tl.store(pacc_ptr + out_at[:, None] * WACC + dv[None, :], racc)
    tl.store(pm_ptr + out_at, mx)
    tl.store(pl_ptr + out_at, den)


def _settings(tc: int, bh: int, mp: int, dev: torch.device) -> Dict[str, int]:
    """Rows per tile and per piece, columns per chunk of the query transform, warps and
    pipeline stages. On a GPU: tiles of 16 rows over 8 warps (larger tiles spill registers to
    local memory: ``tests/kernels/compile_check.py`` prints each specialisation's stack) and
    pieces of at least 64 rows, as many as make about two programs per multiprocessor (the
    piece length is a run-time argument, so it compiles nothing new as the cache grows); two
    pipeline stages past 64 slots, or Triton 3.6 asks for 270 KB of shared memory at 128. The
    bf16 synthesis on the tensor cores past 64 slots only (H200, CUDA-graph times of one step
    at 8k, benches/results/gpu_bench-2026-12-04-h200-attention.md: 32/8 x 128 1.03 ms with them,
    1.90 ms without; 9/3 x 64 0.288 ms with them, 0.252 ms without)."""
    if is_interpreter():
        # No tensor-core synthesis here: the interpreter's bfloat16 dot returns garbage (Triton
        # 3.9, numpy 2.4); the GPU script fuzzes that path on the device.
        return {"BN": 64, "SPLIT": 512, "BDC": 64, "num_warps": 4, "num_stages": 3, "MMA": False}
    bn = 16
    pieces = max(1, -(-2 * _multiprocessors(dev) // max(1, bh)))
    split = max(4 * bn, -(-tc // pieces))
    return {"BN": bn, "SPLIT": -(-split // bn) * bn, "BDC": 64 if mp <= 128 else 32, "num_warps": 8,
            "num_stages": 3 if mp <= 64 else 2, "MMA": mp > 64}


@functools.lru_cache(maxsize=None)
def _multiprocessors(dev: torch.device) -> int:
    """The device's multiprocessor count (132 on an H100 / H200; 1 off CUDA)."""
    dev = torch.device(dev)
    if dev.type != "cuda":
        return 1
    return int(torch.cuda.get_device_properties(dev).multi_processor_count)


def query_rows(group: int, n_q: int) -> int:
    """``QP``: the padded query rows of a pair (``G * n_q``, at least 16 for the dots)."""
    return max(16, next_pow2(group * n_q))


def split_attention(layer: LayerBatch, q: torch.Tensor, raw_k: torch.Tensor, raw_v: torch.Tensor,
                    sink_rows: int, mask: Optional[torch.Tensor], scale: float,
                    softcap: Optional[float], window: Optional[int],
                    rope: Optional[RopeBatch] = None, positions: Optional[torch.Tensor] = None,
                    synthesis: str = "bf16") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The partial softmaxes of every pair and piece, on the layer's device.

    ``q``: float32 ``[B, H_q, n_q, D_k]`` contiguous; ``raw_k`` / ``raw_v``: float32 ``[BH,
    RAW, D_k]`` / ``[BH, RAW, D_v]`` contiguous, the sink's ``sink_rows`` rows then the tail's;
    ``mask``: float32 ``[B, n_q, T]`` contiguous or None; keys coded before RoPE: ``rope`` (on
    the device, ``rot <= D_k``) and ``positions`` int32 ``[B, T_c]`` contiguous, each in
    ``[0, n_pos)`` (trusted: checking would read the device), both or neither. Returns ``pm``, ``pl`` float32 ``[BH,
    NS, QP]`` (maxima, denominators), ``pacc`` float32 ``[BH, NS, QP, max(MPV, BDV)]``
    (code-domain sums of the ``NS - 1`` pieces of sealed rows in slot order, then the raw
    rows' sum) and ``NCODE = NS - 1``. Raises ValueError on shapes, dtypes or devices that do
    not fit."""
    dev, hkv = layer.device, layer.kv_heads
    kc, vc = layer.k, layer.v
    b, dk, dv = layer.batch, kc.cal.dim, vc.cal.dim
    if q.ndim != 4 or q.shape[0] != b or q.shape[1] % hkv or q.shape[3] != dk or q.dtype != torch.float32:
        raise InvalidInputError(f"q must be float32 [B={b}, H_q (a multiple of {hkv}), n_q, D_k={dk}], "
                                f"got {q.dtype} {tuple(q.shape)}")
    bh, nq = b * hkv, q.shape[2]
    group = q.shape[1] // hkv
    raw = raw_k.shape[1]
    for name, t, d in (("raw_k", raw_k, dk), ("raw_v", raw_v, dv)):
        if tuple(t.shape) != (bh, raw, d) or t.dtype != torch.float32 or not t.is_contiguous():
            raise InvalidInputError(f"{name} must be contiguous float32 [{bh}, {raw}, {d}], got "
                                    f"{t.dtype} {tuple(t.shape)}")
        check_device(name, t, dev)
    check_device("q", q, dev)
    tc = kc.rows
    total = sink_rows + tc + raw - sink_rows
    if not 0 <= sink_rows <= raw or raw - sink_rows < nq:
        raise InvalidInputError(f"{raw} raw rows cannot hold {sink_rows} sink rows and the {nq} query rows")
    if mask is not None:
        if tuple(mask.shape) != (b, nq, total) or mask.dtype != torch.float32 or not mask.is_contiguous():
            raise InvalidInputError(f"mask must be contiguous float32 [{b}, {nq}, {total}], got "
                                    f"{mask.dtype} {tuple(mask.shape)}")
        check_device("mask", mask, dev)
    if (rope is None) != (positions is None):
        raise InvalidInputError("pass both rope and positions, or neither")
    f32 = placeholder(torch.float32, dev)
    ksm, cos, sin, posn, half, npos = f32, f32, f32, placeholder(torch.int32, dev), 0, 1
    if rope is not None:
        if rope.rot_dim > dk:
            raise InvalidInputError(f"the rotary dimension {rope.rot_dim} exceeds D_k = {dk}")
        if tuple(positions.shape) != (b, kc.rows) or positions.dtype != torch.int32 \
                or not positions.is_contiguous():
            raise InvalidInputError(f"positions must be contiguous int32 [{b}, {kc.rows}], got "
                                    f"{positions.dtype} {tuple(positions.shape)}")
        check_device("rope", rope.cos, dev)
        check_device("positions", positions, dev)
        ksm = (layer.key_synthesis if synthesis == "f32" else
               layer.key_synthesis_i16 if synthesis == "i16" else layer.key_synthesis_bf16)
        cos, sin, posn = rope.cos, rope.sin, positions
        half, npos = rope.rot_dim // 2, rope.n_positions
    qp = query_rows(group, nq)
    mpk, mpv = kc.cal.slots, vc.cal.slots
    shapes = {"QP": qp, "MPK": mpk, "LOG_MPK": max(mpk - 1, 0).bit_length(), "MPV": mpv,
              "BDK": max(16, next_pow2(dk)), "BDV": max(16, next_pow2(dv))}
    st = _settings(tc, bh, max(mpk, mpv), dev)
    ncode = triton.cdiv(tc, st["SPLIT"])
    ns = ncode + 1
    wacc = max(mpv, shapes["BDV"])
    pm = empty((bh, ns, qp), torch.float32, dev)
    pl = empty((bh, ns, qp), torch.float32, dev)
    pacc = empty((bh, ns, qp, wacc), torch.float32, dev)
    _split_kernel[(bh, ns)](
        q.contiguous(), raw_k, raw_v, f32 if mask is None else mask,
        kc.codes, kc.codes.shape[1], kc.scale_bits, kc.scale_exp, kc.rstart, kc.outlier_pos,
        kc.outlier_bits,
        kc.cal.m, kc.cal.row_bytes, kc.cal.col, kc.cal.bits, kc.cal.width, kc.cal.rnorm, kc.cal.signs,
        kc.cal.byte, kc.cal.shift, kc.cal.centroids, kc.cal.synthesis, kc.cal.mean, ksm, cos, sin, posn,
        vc.codes, vc.codes.shape[1], vc.scale_bits, vc.scale_exp, vc.rstart, vc.outlier_pos,
        vc.outlier_bits,
        vc.cal.m, vc.cal.row_bytes, vc.cal.col, vc.cal.bits, vc.cal.byte, vc.cal.shift, vc.cal.centroids,
        pm, pl, pacc,
        hkv, group, nq, tc, sink_rows, raw, total, dk, dv, ncode, ns, wacc,
        float(scale), float(softcap or 0.0), int(window or 0), int(mask is not None),
        int(kc.cal.norm), int(vc.cal.norm), int(kc.has_outliers), int(vc.has_outliers),
        npos, half, int(rope is not None and rope.interleaved), st["SPLIT"],
        BN=st["BN"], BDC=st["BDC"], num_warps=st["num_warps"], num_stages=st["num_stages"],
        ROPE=rope is not None, BR=_rope_chunk(half, st["BDC"], st["BN"], mpk),
        BF16=rope is not None and synthesis == "bf16", MMA=st["MMA"],
        I16=rope is not None and synthesis == "i16", **shapes,
    )
    return pm, pl, pacc, ncode
