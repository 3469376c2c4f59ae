"""Attention over the calibrated codes (SPEC section 12, ``rust/kakeyaturbo/src/attention/``).

A layer's sealed K and V blocks are held as their containers (:class:`LayerCodes`, parsed and
checked once when appended); :func:`decode_attention` computes one attention step of a chunk
of query tokens from the codes: each sealed key's score is ``q . mean + g sum_j w_j c_j`` with
``w`` the query moved into the code domain once, the value sum runs in the code domain and is
synthesised once per query, raw rows (the sink and the tail) are exact, and one softmax covers
every position. No key or value is decoded.

The queries must be in the domain the keys were coded in (keys coded after RoPE need queries
after RoPE, raw rows after RoPE); the kernel does not know which, unless told: keys coded
before RoPE are passed with their rotation (a :class:`RopeTable` and each sealed row's position),
and then each tile of sealed keys is synthesised from its codes, rotated to its positions and
dotted with the (rotated) queries inside the kernel; the decoded keys never leave it.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _core
from ..errors import InvalidInputError, InvalidParameterError
from . import _checks
from .calibrated import SYNTHESES, CalibratedCodec

STREAMS = ("k", "v")

#: The pairings of channels a :class:`RopeTable` knows (as ``kakeyaturbo.families.rope``).
ROPE_STYLES = ("half", "interleaved")


class RopeTable:
    """The cos and sin of positions ``0 .. n-1`` of one rotary embedding, per frequency:
    float32 ``[n, rot/2]`` each (:attr:`cos`, :attr:`sin`), already scaled as the model's
    rotary module scales them, and the pairing ``style`` (``"half"``: channel ``i`` with
    ``i + rot/2``; ``"interleaved"``: ``2i`` with ``2i + 1``). Channels past ``rot`` are not
    rotated. Held frequency-major (the kernel reads a run of positions of one frequency as
    one contiguous run); :attr:`cos` and :attr:`sin` are views.

    :meth:`from_full` takes transformers' ``[n, rot]`` tables (each frequency twice).
    Raises TypeError / InvalidInputError for arrays that do not fit."""

    def __init__(self, cos: Any, sin: Any, style: str = "half") -> None:
        c, s = _array(cos, "cos", 2, (None, None)), _array(sin, "sin", 2, (None, None))
        if c.shape != s.shape or c.shape[0] < 1 or not 1 <= c.shape[1] <= _checks.MAX_DIM // 2:
            raise InvalidInputError(f"cos and sin must both be [n >= 1, rot/2 in 1..{_checks.MAX_DIM // 2}], "
                                    f"got {c.shape} and {s.shape}")
        with _checks.held("cos and sin"):
            self._cos_t, self._sin_t = np.ascontiguousarray(c.T), np.ascontiguousarray(s.T)
        if not (np.isfinite(self._cos_t).all() and np.isfinite(self._sin_t).all()):
            raise InvalidInputError("cos and sin must be finite")
        self.style = _checks.choice(style, "style", ROPE_STYLES)

    @property
    def cos(self) -> np.ndarray:
        """``[n, rot/2]`` (a view of the frequency-major table)."""
        return self._cos_t.T

    @property
    def sin(self) -> np.ndarray:
        return self._sin_t.T

    @classmethod
    def from_full(cls, cos: Any, sin: Any, style: str = "half") -> "RopeTable":
        """From ``[n, rot]`` tables as transformers' rotary modules give them (``cat(f, f)``
        for ``"half"``, each value twice for ``"interleaved"``); InvalidInputError when the two
        copies of a frequency differ."""
        c, s = _array(cos, "cos", 2, (None, None)), _array(sin, "sin", 2, (None, None))
        _checks.choice(style, "style", ROPE_STYLES)
        if c.shape != s.shape or c.shape[1] % 2 or c.shape[1] > _checks.MAX_DIM:
            raise InvalidInputError(f"cos and sin must both be [n, rot] with rot even, at most {_checks.MAX_DIM}, "
                                    f"got {c.shape} and {s.shape}")
        h = c.shape[1] // 2
        parts = ((c[:, :h], c[:, h:]), (s[:, :h], s[:, h:])) if style == "half" else \
            ((c[:, 0::2], c[:, 1::2]), (s[:, 0::2], s[:, 1::2]))
        with _checks.held("cos and sin"):
            if any(not np.array_equal(a, b) for a, b in parts):
                raise InvalidInputError(f"the tables do not repeat each frequency as the {style!r} pairing does")
        return cls(parts[0][0], parts[1][0], style)

    @property
    def n_positions(self) -> int:
        return int(self._cos_t.shape[1])

    @property
    def rot_dim(self) -> int:
        return 2 * int(self._cos_t.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self._cos_t.nbytes + self._sin_t.nbytes)

    def __repr__(self) -> str:
        return f"RopeTable(n_positions={self.n_positions}, rot_dim={self.rot_dim}, style={self.style!r})"

    def kernel_args(self, positions: np.ndarray, synthesis: str) -> Tuple[Any, ...]:
        """The rotation as the kernel takes it (:meth:`LayerCodes.kernel_attend`): ``positions``
        uint32 ``[B, T_c]`` C-contiguous."""
        return self._cos_t, self._sin_t, positions, self.style, synthesis


class LayerCodes:
    """The sealed K and V codes of one attention layer, per (batch row, kv-head).

    ``k_codecs[h]``, ``v_codecs[h]``: the :class:`~kakeyaturbo.CalibratedCodec` of kv-head
    ``h``'s keys and values (every K calibration of one ``D_k``, every V calibration of one
    ``D_v``); ``batch``: batch rows (batch x kv-heads at most 2**20). A block is the K container and the V container
    (:meth:`CalibratedCodec.encode` bytes) of the same rows; blocks of one (batch row, kv-head)
    follow each other in position order. Memory is the containers' bytes (:attr:`nbytes`) plus
    a few offsets per block. Raises InvalidParameterError for calibrations that do not fit
    together, TypeError for arguments of the wrong type.
    """

    def __init__(self, k_codecs: Sequence[CalibratedCodec], v_codecs: Sequence[CalibratedCodec],
                 batch: int = 1) -> None:
        ks, vs = tuple(k_codecs), tuple(v_codecs)
        for name, cs in (("k_codecs", ks), ("v_codecs", vs)):
            for c in cs:
                if not isinstance(c, CalibratedCodec):
                    raise TypeError(f"{name} must hold CalibratedCodec objects, got {type(c).__name__}")
        self.k_codecs, self.v_codecs = ks, vs
        self._c = _core.LayerCodes([c._c for c in ks], [c._c for c in vs],
                                   _checks.integer(batch, "batch", 1))

    @property
    def batch(self) -> int:
        return self._c.batch

    @property
    def kv_heads(self) -> int:
        return self._c.kv_heads

    @property
    def k_dim(self) -> int:
        return self._c.k_dim

    @property
    def v_dim(self) -> int:
        return self._c.v_dim

    @property
    def nbytes(self) -> int:
        """Bytes held: every container's bytes (a block shared by repeated batch rows after
        :meth:`select` counts once per row)."""
        return self._c.nbytes

    def rows(self) -> int:
        """Sealed rows, the same in every (batch row, kv-head); InvalidInputError otherwise."""
        return self._c.rows()

    def rows_at(self, b: int, h: int) -> int:
        """Sealed rows of (batch row ``b``, kv-head ``h``)."""
        return self._c.rows_at(_checks.integer(b, "b", 0), _checks.integer(h, "h", 0))

    def num_blocks(self, b: int, h: int) -> int:
        return self._c.num_blocks(_checks.integer(b, "b", 0), _checks.integer(h, "h", 0))

    def append(self, b: int, h: int, k: Any, v: Any) -> None:
        """Appends one block (K and V containers of the same rows) to (batch row ``b``,
        kv-head ``h``); ``bytes`` are shared with their Python objects, not copied. Raises CorruptDataError for damaged bytes, InvalidParameterError for
        another calibration's, InvalidInputError when the two hold different row counts or a
        scale lies beyond the float32 range; nothing is kept then."""
        self._c.append(_checks.integer(b, "b", 0), _checks.integer(h, "h", 0),
                       _checks.buffer(k), _checks.buffer(v))

    def append_blocks(self, k: Sequence[Sequence[Any]], v: Sequence[Sequence[Any]]) -> None:
        """Appends one block to every (batch row, kv-head): ``k[b][h]``, ``v[b][h]``
        containers. Nothing is kept unless every one is accepted."""
        kk = [[_checks.buffer(x) for x in row] for row in k]
        vv = [[_checks.buffer(x) for x in row] for row in v]
        self._c.append_blocks(kk, vv)

    def blob(self, b: int, h: int, stream: str, i: int) -> bytes:
        """The container bytes of block ``i`` of stream ``"k"`` or ``"v"`` of (b, h)."""
        return self._c.blob(_checks.integer(b, "b", 0), _checks.integer(h, "h", 0),
                            _checks.choice(stream, "stream", STREAMS), _checks.integer(i, "i", 0))

    def pop_block(self) -> None:
        """Removes the last block of every (batch row, kv-head)."""
        self._c.pop_block()

    def pop_front_block(self) -> None:
        """Removes the first block of every (batch row, kv-head) (a sliding-window layer
        dropping what left its window)."""
        self._c.pop_front_block()

    def select(self, index: Sequence[int]) -> None:
        """Keeps the batch rows ``index`` in that order (repeats share their blocks), as beam
        search reorders a cache."""
        self._c.select([_checks.integer(i, "a batch row", 0) for i in index])

    def clear(self) -> None:
        self._c.clear()

    def __copy__(self) -> "LayerCodes":
        """Another LayerCodes of the same calibrations and blocks (their bytes shared: they never
        change); appending to, popping from or selecting rows of one leaves the other as it was.
        ``copy.deepcopy`` gives the same."""
        new = self.__class__.__new__(self.__class__)
        new.__dict__.update(self.__dict__)
        new._c = copy.copy(self._c)
        return new

    def __deepcopy__(self, memo: Any) -> "LayerCodes":
        return self.__copy__()

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        """Pickled as its calibrations, its batch rows and every block's K and V containers, so
        that sealed codes reach another process (a ``spawn`` pool's worker); unpickling appends
        the blocks again, with the checks :meth:`append` makes."""
        blocks = [[[(self._c.blob(b, h, "k", i), self._c.blob(b, h, "v", i))
                    for i in range(self._c.num_blocks(b, h))]
                   for h in range(self.kv_heads)] for b in range(self.batch)]
        return _unpickle, (self.k_codecs, self.v_codecs, self.batch, blocks)

    def attend(self, q: Any, tail_k: Any, tail_v: Any, **kwargs: Any
               ) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
        """:func:`decode_attention` over these codes."""
        return decode_attention(self, q, tail_k, tail_v, **kwargs)

    def kernel_attend(self, q: np.ndarray, sink_k: np.ndarray, sink_v: np.ndarray, tail_k: np.ndarray,
                      tail_v: np.ndarray, mask: Optional[np.ndarray], scale: float, softcap: Optional[float],
                      window: Optional[int], threads: Optional[int], rot: Any, latent: bool,
                      out_bf16: bool = False) -> Tuple[np.ndarray, np.ndarray]:
        """The kernel call of :func:`decode_attention` (output and log-sum-exp), without the
        checks it makes first: C-contiguous arrays, float32 or (``q`` and the raw rows)
        bfloat16 as its bits (``uint16``: a bfloat16 model's rows without a conversion; widened
        exactly), ``mask`` additive ``[B, n_q, T]`` or None, ``rot`` from
        :meth:`RopeTable.kernel_args` or None; ``out_bf16``: the output rounded to bfloat16
        (nearest even, as torch rounds) as its bits. The kernel checks every size, value and
        setting again (the same typed errors, with plainer messages): for a caller that builds
        these arrays at every decode step (the generation cache)."""
        return self._c.attend(q, sink_k, sink_v, tail_k, tail_v, mask, scale, softcap, window, threads, rot,
                              latent, out_bf16)

    def __repr__(self) -> str:
        return repr(self._c)


def _unpickle(k_codecs: Any, v_codecs: Any, batch: Any, blocks: Any) -> LayerCodes:
    """:meth:`LayerCodes.__reduce__`'s inverse: InvalidInputError where ``blocks`` is not
    ``[batch][kv_heads]`` lists of (K, V) container pairs, and the errors of :meth:`LayerCodes.append`
    for damaged containers."""
    codes = LayerCodes(k_codecs, v_codecs, batch)
    shape = f"[batch={codes.batch}][kv_heads={codes.kv_heads}] lists of (K, V) container pairs"
    if not isinstance(blocks, list) or len(blocks) != codes.batch or any(
            not isinstance(row, list) or len(row) != codes.kv_heads
            or any(not isinstance(pairs, list) or any(not isinstance(p, tuple) or len(p) != 2 for p in pairs)
                   for pairs in row) for row in blocks):
        raise InvalidInputError(f"pickled LayerCodes: the blocks must be {shape}")
    for b, row in enumerate(blocks):
        for h, pairs in enumerate(row):
            for k, v in pairs:
                codes.append(b, h, k, v)
    return codes


def _array(v: Any, name: str, ndim: int, shape: Tuple[Optional[int], ...], layout: str = "") -> np.ndarray:
    """A float32 array of ``ndim`` dimensions (numpy, or a CPU torch tensor) whose sizes equal
    ``shape``'s where it gives one (``layout`` names them in messages), as it is (not yet
    copied: see :func:`_contiguous`)."""
    if not isinstance(v, np.ndarray):
        try:
            v = np.asarray(v)
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"{name} must be a float32 numpy array or CPU tensor ({e})") from None
    if v.dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {v.dtype}")
    if v.ndim != ndim:
        raise InvalidInputError(f"{name} must be {ndim}-D, got shape {v.shape}")
    if any(w is not None and n != w for n, w in zip(v.shape, shape)):
        want = ", ".join("?" if w is None else str(w) for w in shape)
        raise InvalidInputError(f"{name} must be {layout}{' = ' if layout else ''}[{want}], got shape {v.shape}")
    return v


def _contiguous(*arrays: np.ndarray) -> Tuple[np.ndarray, ...]:
    """The checked inputs as C-contiguous arrays (copied where they are not): only after every
    shape is known to fit, so that a broadcast view of a huge shape is refused, not copied."""
    return tuple(np.ascontiguousarray(a) for a in arrays)


def additive_mask(mask: Any, batch: int, n_q: int, total: Optional[int]) -> Optional[np.ndarray]:
    """The additive mask ``[B, n_q, T]`` float32 from an additive or boolean (True: attend) mask
    of shape ``[B, n_q, T]`` or ``[B, 1, n_q, T]`` (``T`` = ``total`` where known)."""
    if mask is None:
        return None
    m = mask if isinstance(mask, np.ndarray) else np.asarray(mask)
    if m.ndim == 4:
        if m.shape[1] != 1:
            raise InvalidInputError(f"a 4-D mask must be [B, 1, n_q, T], got {m.shape}")
        m = m[:, 0]
    if m.ndim != 3 or m.shape[:2] != (batch, n_q) or total not in (None, m.shape[2]):
        raise InvalidInputError(f"mask must be [B={batch}, n_q={n_q}, T={total}] (or [B, 1, n_q, T]), "
                                f"got {m.shape}")
    if m.dtype == np.bool_:
        return np.where(m, np.float32(0), np.float32(-np.inf)).astype(np.float32)
    if m.dtype != np.float32:
        raise TypeError(f"mask must be float32 (additive) or bool, got {m.dtype}")
    return np.ascontiguousarray(m)


def sink_logits_array(sink_logits: Any, q_heads: int) -> np.ndarray:
    """``sink_logits`` as float32 ``[H_q]`` (numpy, a CPU torch tensor, a sequence), checked:
    TypeError for a non-float dtype, InvalidInputError for another shape or a non-finite value."""
    a = sink_logits
    if not isinstance(a, np.ndarray):
        try:
            a = np.asarray(a.detach().cpu() if hasattr(a, "detach") else a)
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"sink_logits must be a float array or tensor ({e})") from None
    if a.dtype.kind != "f":
        raise TypeError(f"sink_logits must be floating point, got {a.dtype}")
    if a.shape != (q_heads,):
        raise InvalidInputError(f"sink_logits must be [H_q={q_heads}], got shape {a.shape}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise InvalidInputError("sink_logits must be finite")
    return a


def with_sink_logits(out: Any, lse: Any, sink_logits: Any) -> Tuple[Any, Any]:
    """Attention ``(out [B, H_q, n_q, D_v], lse [B, H_q, n_q])`` with one more softmax entry per
    query head, ``sink_logits [H_q]``, that holds no value (GPT-OSS's learnt sinks): every weight
    shrinks by ``exp(lse - lse')``, ``lse' = logaddexp(lse, sink)``, the same as taking the
    softmax over the scores and the sink and dropping the sink's weight. numpy arrays or torch
    tensors (all of one kind); a query that saw nothing stays 0 with ``lse' = sink``."""
    xp = np if isinstance(out, np.ndarray) else __import__("torch")
    s = sink_logits[None, :, None]
    new = xp.logaddexp(lse, s)
    return out * xp.exp(lse - new)[..., None], new


def attention_kernel() -> str:
    """The instruction set :func:`decode_attention` runs on this CPU: ``"avx512"`` (AVX-512 F,
    BW, VL, VBMI; its BF16 dot product where the CPU has it), ``"avx2"`` (AVX2, FMA, F16C and
    BMI2) or ``"portable"``. Every one computes the same bits; they differ in speed only."""
    return str(_core.attention_kernel())


def attention_team() -> int:
    """The threads of the OpenMP team (torch's CPU threads) that :func:`decode_attention` runs
    on when a call uses every core (``threads=None``, except the small calls that run on the
    calling thread, or ``threads`` at least the core count): ``torch.get_num_threads()`` where
    torch is loaded and runs 2 or more; 0 where the kernel starts threads of its own instead
    (no OpenMP runtime loaded, torch held to one thread, Windows, the child of a ``fork``,
    where libgomp's team does not survive, or ``KAKEYATURBO_OPENMP_TEAM=0`` in the
    environment when kakeyaturbo is imported). The same
    bits either way; between torch operations the team's threads are awake, where threads of
    the kernel's own would wait for cores they hold."""
    return int(_core.attention_team())


def decode_attention(codes: LayerCodes, q: Any, tail_k: Any, tail_v: Any, *,
                     sink_k: Any = None, sink_v: Any = None, scale: Optional[float] = None,
                     softcap: Optional[float] = None, window: Optional[int] = None,
                     mask: Any = None, threads: Optional[int] = None, return_lse: bool = False,
                     rope: Optional[RopeTable] = None, positions: Any = None,
                     synthesis: str = "bf16", sink_logits: Any = None, latent: bool = False
                     ) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]:
    """One attention step of a layer over its sealed codes and raw rows.

    Positions: ``sink`` rows ``0 .. S``, the sealed rows ``S .. S + T_c`` (every (batch row,
    kv-head) of ``codes`` holds ``T_c``), ``tail`` rows ``S + T_c .. T``; the last ``n_q`` tail
    rows are the query tokens' own, query ``i`` at position ``T - n_q + i``.

    - ``q``: float32 ``[B, H_q, n_q, D_k]``; query head ``h`` reads kv-head
      ``h // (H_q // H_kv)``. In the domain the keys were coded in.
    - ``tail_k`` / ``tail_v``: float32 ``[B, H_kv, R, D_k]`` / ``[B, H_kv, R, D_v]``,
      ``R >= n_q`` (staging rows, then the current chunk).
    - ``sink_k`` / ``sink_v``: float32 ``[B, H_kv, S, D_k]`` / ``[B, H_kv, S, D_v]`` or None.
    - ``scale``: scores are ``scale * q . k`` (default ``1 / sqrt(D_k)``, ``1 / sqrt(D_k + D_v)``
      with ``latent``); ``softcap``: then
      ``softcap * tanh(s / softcap)`` (Gemma 2); ``window``: a query sees the last ``window``
      positions (its own included); causal always.
    - ``mask``: additive float32 (finite or ``-inf``) or boolean (True: attend) ``[B, n_q, T]``
      or ``[B, 1, n_q, T]``, added after the softcap.
    - ``threads``: None (all cores, except that a call of little sealed work, batch x kv-heads x
      sealed rows x ``D_k`` x ceil(query rows per kv-head / 16) <= 2**19 on the AVX-512 kernel,
      a quarter of that on the others, half again where torch's team runs the call, runs on the
      calling thread: a second thread costs more than it saves there) or a count; a call on
      every core runs on torch's OpenMP threads where torch is loaded (:func:`attention_team`).
      The result is the same for every count.
    - ``rope`` and ``positions``: the keys were coded before RoPE. ``positions`` (integers
      ``[B, T_c]``) gives each sealed row's position, a row of ``rope``; each sealed key is
      synthesised and rotated inside the kernel. ``q`` and the raw rows are after RoPE, as the
      model hands them over. ``synthesis``: how those keys are synthesised from their
      centroids: ``"bf16"`` (the default: the synthesis matrix and the centroids rounded to
      bfloat16, float32 sums, AVX-512 BF16's dot product where the CPU has it; the keys then
      differ from the decoded ones by that rounding, about 2**-8 of the terms that make them),
      ``"f32"`` (the decoded keys to float32 rounding; half the speed on AMD CPUs) or ``"i16"`` (16-bit
      fixed point: centroids in steps of 2**-8, saturating at ±128, each channel's weights in
      steps of their own with magnitudes summing to at most 65535, sums exact in 32-bit
      integers; as close to the decoded keys as ``"bf16"``, and faster than it with AVX2
      (``vpmaddwd``) or AVX-512 VNNI (``vpdpwssd``): docs/decode-attention.md).
    - ``sink_logits``: float ``[H_q]`` or None: learnt attention sinks (GPT-OSS), one logit per
      query head that joins every softmax of that head and holds no value
      (:func:`with_sink_logits`; not to be confused with the raw sink rows above).
    - ``latent``: multi-head latent attention in its absorbed form (DeepSeek V2/V3's MLA): the
      K stream holds each position's latent row (``D_k`` wide), the V stream its rotated key
      part (``D_v`` wide); ``q`` is ``[B, H_q, n_q, D_k + D_v]`` (each head's query moved into
      the latent space, then its rotated part), a score is ``scale * q . [k, v]``, and the value
      sum runs over the K stream: the output is ``[B, H_q, n_q, D_k]``, in the latent space
      (the model's value projection follows). No ``rope``: the latent carries no RoPE, and the
      rotated part is cached after it.

    Returns float32 ``[B, H_q, n_q, D_v]`` (``D_k`` with ``latent``) (0 for a query that sees no position), and with
    ``return_lse`` also float32 ``[B, H_q, n_q]``: the natural log of each query's softmax
    denominator (``-inf`` where it sees nothing). Arrays may be numpy or CPU torch tensors.
    Raises TypeError for a wrong type, InvalidInputError for shapes that do not fit or
    non-finite values, InvalidParameterError for a bad scale, softcap, window or synthesis."""
    if not isinstance(codes, LayerCodes):
        raise TypeError(f"codes must be a LayerCodes, got {type(codes).__name__}")
    b, hkv, dk, dv = codes.batch, codes.kv_heads, codes.k_dim, codes.v_dim
    lat = _checks.boolean(latent, "latent")
    # Every size checked before any copy (the kernel checks them all again).
    qa = _array(q, "q", 4, (b, None, None, dk + dv if lat else dk),
                "[B, H_q, n_q, D_k + D_v]" if lat else "[B, H_q, n_q, D_k]")
    tk = _array(tail_k, "tail_k", 4, (b, hkv, None, dk), "[B, H_kv, R, D_k]")
    tv = _array(tail_v, "tail_v", 4, (b, hkv, tk.shape[2], dv), "[B, H_kv, R, D_v]")
    if (sink_k is None) != (sink_v is None):
        raise InvalidInputError("pass both sink_k and sink_v, or neither")
    if sink_k is None:
        sk = np.zeros((b, hkv, 0, dk), np.float32)
        sv = np.zeros((b, hkv, 0, dv), np.float32)
    else:
        sk = _array(sink_k, "sink_k", 4, (b, hkv, None, dk), "[B, H_kv, S, D_k]")
        sv = _array(sink_v, "sink_v", 4, (b, hkv, sk.shape[2], dv), "[B, H_kv, S, D_v]")
    n_q = qa.shape[2]
    if qa.shape[1] % hkv or not n_q <= tk.shape[2]:
        raise InvalidInputError(f"q {qa.shape}: its heads must be a multiple of the {hkv} kv-heads and "
                                f"its tokens at most the tail's {tk.shape[2]} rows")
    total: Optional[int] = None
    if mask is not None:  # the mask's T (only then: a call per decode step and layer otherwise)
        try:
            total = sk.shape[2] + codes.rows() + tk.shape[2]
        except InvalidInputError:  # uneven sealed rows: the kernel says so
            pass
    qa, tk, tv, sk, sv = _contiguous(qa, tk, tv, sk, sv)
    # 1 / sqrt of the query's width (a latent query scores both streams).
    scale_ = 1.0 / math.sqrt(dk + dv if lat else dk) if scale is None else _checks.real(scale, "scale")
    cap = None if softcap is None else _checks.real(softcap, "softcap", positive=True)
    win = None if window is None else _checks.integer(window, "window", 1)
    rot = None
    synthesis = _checks.choice(synthesis, "synthesis", SYNTHESES)
    if (rope is None) != (positions is None):
        raise InvalidInputError("pass both rope and positions, or neither")
    if rope is not None:
        if not isinstance(rope, RopeTable):
            raise TypeError(f"rope must be a RopeTable, got {type(rope).__name__}")
        pos = np.asarray(positions)
        if pos.dtype.kind not in "iu":
            raise TypeError(f"positions must be integers, got {pos.dtype}")
        if pos.ndim != 2 or pos.shape[0] != b:
            raise InvalidInputError(f"positions must be [B={b}, T_c], got shape {pos.shape}")
        if pos.size and (pos.min() < 0 or pos.max() >= rope.n_positions):
            raise InvalidInputError(f"positions must lie in [0, {rope.n_positions}) (the table's rows), "
                                    f"got {pos.min()} .. {pos.max()}")
        rot = rope.kernel_args(np.ascontiguousarray(pos, dtype=np.uint32), synthesis)
    if lat and rot is not None:
        raise InvalidParameterError("latent attention takes no rope: its latent rows carry no RoPE")
    sinks = None if sink_logits is None else sink_logits_array(sink_logits, qa.shape[1])
    out, lse = codes.kernel_attend(qa, sk, sv, tk, tv, additive_mask(mask, b, n_q, total), scale_, cap, win,
                                   _checks.threads(threads), rot, lat)
    if sinks is not None:
        out, lse = with_sink_logits(out, lse, sinks)
    return (out, lse) if _checks.boolean(return_lse, "return_lse") else out
