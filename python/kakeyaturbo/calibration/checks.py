"""The checks collecting statistics makes on the first window, that the model attends as the
statistics assume: the keys attention receives are those its ``apply_rotary_pos_emb`` returned
(:func:`check_keys_rotate_last`, with :class:`RotatedKeys` recording the calls), and attention is
the softmax attention the weights describe (:func:`check_same_output`); each raises
UnsupportedModelError naming the model type and what to do instead. And the model's identity that
statistics, calibrations and saved caches record and are checked against (:func:`fingerprint`)."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Tuple

from ..errors import UnsupportedModelError


class RotatedKeys:
    """While open, what the model's own ``apply_rotary_pos_emb`` returns, call by call: the keys
    of a ``(q, k) -> (q, k)`` function, every output of one that rotates one tensor per call
    (Gemma 4: the queries, then the keys). :meth:`take` hands over what was recorded since the
    last take (called as each layer's attention runs: the rotations of that layer). Nothing is
    recorded where the modeling module has no such function."""

    def __init__(self, model: Any) -> None:
        from ..families.layout import rope_module

        self.module = rope_module(model)
        self._pending: List[Any] = []

    def take(self) -> List[Any]:
        out, self._pending = self._pending, []
        return out

    def __enter__(self) -> "RotatedKeys":
        if self.module is not None:
            orig = self.orig = self.module.apply_rotary_pos_emb

            def spy(*a: Any, **kw: Any) -> Any:
                out = orig(*a, **kw)
                if isinstance(out, tuple) and len(out) == 2:
                    self._pending.append(out[1].detach())
                elif hasattr(out, "detach"):
                    self._pending.append(out.detach())
                return out

            self.module.apply_rotary_pos_emb = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.module is not None:
            self.module.apply_rotary_pos_emb = self.orig


def _close(a: Any, b: Any, ulps: int, dtype: Any) -> bool:
    """Whether ``a`` is within ``max(1e-4, ulps * eps(dtype))`` of ``b``'s largest magnitude
    everywhere (tensors of one shape; ``dtype``'s rounding allowed)."""
    import torch

    tol = max(1e-4, ulps * float(torch.finfo(dtype).eps)) if dtype.is_floating_point else 1e-4
    b = b.double()
    return (a.double() - b).abs().max().item() <= tol * max(b.abs().max().item(), 1e-30)


def check_keys_rotate_last(model: Any, rope: Any, got: Dict[int, Tuple[Any, List[Any]]]) -> None:
    """UnsupportedModelError when a layer's keys as attention receives them are not those its
    ``apply_rotary_pos_emb`` returned: the family changes its keys after RoPE (a k norm on the
    rotated keys other than a norm the layer's rotation carries, see
    :mod:`~kakeyaturbo.families.keynorm`), so removing RoPE from what the cache holds does not
    give position-free keys to calibrate on. ``got``: per layer holding its own K/V rows, its keys as
    attention received them and what the function returned as the layer ran
    (:meth:`RotatedKeys.take`). Nothing is checked where no call was seen at all (a family whose
    attention does not look the function up in its module); UnsupportedModelError where a layer
    that :func:`~kakeyaturbo.families.describe` reads as rotating its keys called it not at all,
    or one it reads as not rotating did (a family that rotates some layers only, by a rule
    describe does not know)."""
    from ..families.layout import model_type

    if not any(outs for _, outs in got.values()):
        return
    for i in sorted(got):
        k, outs = got[i]
        if (rope.layer(i) is not None) != bool(outs):
            raise UnsupportedModelError(
                f"model type {model_type(model)!r}: layer {i} " + ("called" if outs else "did not call")
                + " its apply_rotary_pos_emb, but reads as " + ("not " if outs else "")
                + "rotating its keys; which layers apply RoPE is not known for this family, so keys "
                "are not calibrated without RoPE (code them as the cache holds them: [k] rope = "
                "'after', statistics collected with rope='after')")
        # The outputs of the layer's calls that have the keys' shape (a function rotating one
        # tensor per call may hand them over as [batch, rows, heads, D], transposed after, and
        # rotate the keys before the queries: GPT-J), one of which must be the keys.
        # A norm after RoPE that the layer's rotation carries (HunYuan's key_layernorm: its weight
        # comes off before RoPE is taken off) is applied to them as the model applies it.
        keys, norm = [], getattr(rope.layer(i), "key_norm", None)
        for r in outs:
            if r.ndim == 4 and r.shape[:-1] != k.shape[:-1] and r.transpose(1, 2).shape[:-1] == k.shape[:-1]:
                r = r.transpose(1, 2)
            if r.shape[:-1] == k.shape[:-1] and r.shape[-1] <= k.shape[-1]:
                keys.append(r if norm is None or r.shape[-1] != k.shape[-1] else norm(r))
        if not keys:  # no output of the keys' shape: nothing to compare
            continue
        # Bit-equal where nothing comes between; a cast to a narrower dtype after RoPE rounds.
        if not any(_close(k[..., :key.shape[-1]], key, 4, k.dtype) for key in keys):
            raise UnsupportedModelError(
                f"model type {model_type(model)!r}: its keys change after RoPE (layer {i}: attention "
                "receives other keys than its apply_rotary_pos_emb returns, e.g. a k norm on the "
                "rotated keys), so they have no RoPE-free form to code; code them as the cache holds "
                "them ([k] rope = 'after', statistics collected with rope='after')")


def check_same_output(model: Any, layer: int, mine: Any, theirs: Any) -> None:
    """UnsupportedModelError when the attention output computed from the probabilities the
    statistics are weighted by (:func:`attention_p2`) is not the model's own (to the rounding of
    the model's dtype): its attention is not the softmax attention those weights describe."""
    from ..families.layout import model_type

    if mine.shape != theirs.shape or not _close(mine, theirs, 8, theirs.dtype):
        raise UnsupportedModelError(
            f"model type {model_type(model)!r}: layer {layer}'s attention is not the softmax attention "
            "the attention-weighted statistics assume (its output differs from the one computed from "
            "those probabilities); collect its statistics with weighting='uniform'")


def fingerprint(model: Any) -> str:
    """A fingerprint of a loaded model's attention weights: SHA-256 (first 128 bits, hex) over
    the model type and, per attention layer in order, every parameter of the attention module
    (q/k/v/o projections, biases, q/k norms) by name and shape, its values rounded to bfloat16.

    The rounding makes it stable across the dtypes a checkpoint is loaded in (float32 or
    bfloat16 give the same fingerprint); any change of the weights changes it. It reads every
    attention weight once (0.1 s for the 135M default model)."""
    import torch

    from ..families import attention_modules, describe

    layout = describe(model)
    h = hashlib.sha256(f"{layout.model_type}\n".encode())
    mods = attention_modules(model)
    for i in sorted(mods):
        for name, p in sorted(mods[i].named_parameters(), key=lambda kv: kv[0]):
            w = p.detach().to("cpu", torch.bfloat16).contiguous()
            h.update(f"{i}.{name}:{tuple(w.shape)}\n".encode())
            h.update(w.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:32]
