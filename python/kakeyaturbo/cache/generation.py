"""The generation cache: a transformers ``Cache`` whose full blocks are sealed through a codec
and held as bytes (:class:`KakeyaCache`, one :class:`~kakeyaturbo.cache.layer.KakeyaLayer` per
attention layer, full or sliding-window)."""

from __future__ import annotations

import os
import weakref
from functools import partial
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, Cache, LinearAttentionCacheLayerMixin,
                                      LinearAttentionLayer)

from .._extras import require
from ..calibration import ModelCodec
from .._limits import MAX_LAYERS
from ..codec import _checks
from ..codec.attention import SYNTHESES, attention_kernel
from ..errors import InvalidParameterError
from ..families import describe
from ..families.layout import text_config
from ..recipes import Recipe
from . import fast as fast_mod
from .codecs import (STREAMS, BlockCodec, StreamCodec, boundary_layers, check_codec, check_streams, codes_layer,
                     wants_rope)
from .compressed import CompressedEntries, compressed_layer, rows_of
from .extra_layers import (KakeyaIndexedLayer, KakeyaStateLayer, end_linear_recording, linear_crop_refusal,
                           reset_linear, select_states)
from .layer import KakeyaLayer
from .copying import NotPickled, copy_sharing
from .rollback import crop_count
from .calls import watch_calls
from .positions import Positions, position_ids
from .pretrained import CalibrationLike, check_codec_model, codec_for_model
from .rope import check_rope, layer_ropes, rope_of_layer

#: The kernels that attend over the codes: ``auto`` (Rust on the CPU, Triton on a GPU), or one.
KERNELS = ("auto", "rust", "triton")


class KakeyaCache(Cache, NotPickled):
    """A transformers ``Cache`` whose full blocks are held as codec bytes.

    ``model.generate(ids, cache=KakeyaCache(codec, model=model))`` (``past_key_values=`` before
    transformers 5.24). Per layer: the first ``n_sink`` tokens stay raw; then every full block
    of ``block_size`` tokens of each stream in ``streams`` is sealed through ``codec`` (one blob
    per batch row and kv-head) and held only as bytes; the last partial block stays raw
    (staging); ``boundary`` layers (negative indices count from the last layer) are never
    sealed, nor are layers a calibrated codec was not fitted for (``codec.layers``: Gemma 4's
    sliding layers of another head size than its full ones, see
    :meth:`~kakeyaturbo.families.ModelLayout.calibration_group`). With a calibrated codec (keys
    coded before or after RoPE), attention is computed from the codes (``fast``, below);
    otherwise it reads sealed blocks by decoding them at every step
    (``keep_decoded=True`` keeps the decoded tensors instead, trading memory back for speed;
    they count in :meth:`nbytes`). Raw rows keep the dtype the model hands over.

    ``model`` gives the layers (:func:`kakeyaturbo.families.describe`: their number, for negative
    boundary indices; which are sliding-window layers, handled as transformers'
    ``DynamicSlidingWindowLayer`` handles them, keeping only what the window still needs; which
    hold a hybrid model's recurrent or convolution state instead of K/V rows, kept as
    transformers' ``DynamicCache`` keeps them, uncompressed) and
    the RoPE of each layer when ``codec.pre_rope_keys``. Without a model every layer is full
    attention: pass ``num_layers`` and ``rope`` (a :class:`~kakeyaturbo.cache.rope.ModelRope`,
    or a ``positions -> (cos, sin)`` callable for every layer). RoPE positions are the
    ``position_ids`` of the forward call (so left-padded batches are right), else the token
    index.

    ``fast`` (None: when possible; True: required; False: never): attention over the codes
    (:mod:`kakeyaturbo.cache.fast`): with a calibrated codec (keys coded before RoPE, as the
    shipped recipes do, are synthesised and rotated per tile inside the kernel; keys coded after
    RoPE are scored by table look-ups), on a CPU model of a family in ``fast.FAMILIES`` running
    ``sdpa`` or ``eager`` attention, every layer that seals both K and V computes its attention with
    :func:`kakeyaturbo.decode_attention` over its sealed blocks, sink and staging rows; the
    decoded cache never exists. The cache then points the model at a registered attention
    function that stands in for the model's own (and computes exactly as it for any other
    cache). :attr:`fast_reason` says why a cache is not fast. ``threads``: of the kernel
    (None: all cores, a layer of little sealed work on the calling thread; see
    :func:`kakeyaturbo.decode_attention`). ``synthesis``: how the kernel synthesises keys coded
    before RoPE, ``"bf16"`` (twice the speed of ``"f32"`` on Zen 3 to 5, not on the
    Intel CPU measured), ``"i16"`` (16-bit fixed point, as close to the decoded keys; faster
    than ``"bf16"`` on the CPU), ``"f32"`` (the decoded keys to float32 rounding) or ``"auto"``
    (the default: ``"i16"`` where the Rust kernel runs its AVX2 or AVX-512 build,
    :func:`kakeyaturbo.attention_kernel`, for a model on the CPU; ``"bf16"`` elsewhere);
    :attr:`synthesis` holds the one chosen. See
    :func:`kakeyaturbo.decode_attention`. ``kernel``: which kernel attends over
    the codes, ``"auto"`` (the Rust one for a model on the CPU, the Triton one,
    :func:`~kakeyaturbo.kernels.attention.decode_attention_triton`, for one on a CUDA GPU
    where triton is installed; else the slow path), ``"rust"`` (off the CPU: the slow path) or
    ``"triton"`` (on the CPU it runs Triton's interpreter, which ``TRITON_INTERPRET=1`` must
    select before ``kakeyaturbo.kernels`` is imported: for tests). The Triton kernel reads the
    sealed codes staged on the device once, then extended by each newly sealed block
    (:meth:`KakeyaLayer.device_codes`).

    Raises InvalidParameterError (a ValueError) on a bad setting or a codec that needs RoPE
    without ``model`` or ``rope``; UnsupportedModelError (one) naming the model type and the
    reason for a model whose cache is not K/V rows, or whose keys' RoPE cannot be removed when
    the codec needs them without it.
    """

    def __init__(self, codec: StreamCodec, *, model: Any = None, num_layers: Optional[int] = None,
                 block_size: int = 512, n_sink: int = 0, boundary: Sequence[int] = (),
                 streams: Sequence[str] = STREAMS, rope: Any = None,
                 keep_decoded: bool = False, fast: Optional[bool] = None,
                 threads: Optional[int] = None, synthesis: str = "auto", kernel: str = "auto") -> None:
        block_size = _checks.integer(block_size, "block_size", 1)
        n_sink = _checks.integer(n_sink, "n_sink", 0)
        if num_layers is not None:
            num_layers = _checks.integer(num_layers, "num_layers", 0, MAX_LAYERS)
        keep_decoded = _checks.boolean(keep_decoded, "keep_decoded")
        check_codec(codec)
        windows: Tuple[Optional[int], ...] = ()
        layout = None
        #: The model's layers as :func:`describe` read them (empty without a model): which cache
        #: layer each gets (:meth:`_new_layer`).
        self._specs: Tuple[Any, ...] = ()
        #: The decoder's config, which the model's own layers of compressed attention are built from.
        self._config: Any = None
        if model is not None:
            layout = describe(model)
            check_codec_model(codec, model)  # ModelMismatchError for another model's codec
            if num_layers is not None and num_layers != layout.num_layers:
                raise InvalidParameterError(f"num_layers={num_layers} but the model has {layout.num_layers} layers")
            num_layers = layout.num_layers
            windows = tuple(s.window for s in layout.layers)
            self._specs = layout.layers
            self._config = text_config(model)
        #: Multi-head latent attention (:attr:`ModelLayout.latent`): each layer's rows are a latent
        #: and a rotated key part (attention over their codes: ``fast._attend_latent``).
        self._latent = bool(layout is not None and layout.latent)
        self.codec = codec
        self.block_size = block_size
        self.n_sink = n_sink
        self.streams = check_streams(streams)
        self.boundary = boundary_layers(boundary, num_layers)
        self.keep_decoded = keep_decoded
        self.windows = windows
        self._positions: Optional[Positions] = None
        if wants_rope(codec, self.streams):
            if rope is not None:
                check_rope(rope, num_layers, [s.head_dim if s.has_kv and not self._latent else None
                                              for s in self._specs])
            else:
                if layout is None:
                    raise InvalidParameterError(f"{codec!r} codes keys without RoPE: pass model= or rope=")
                rope = layout.require_rope()
            self._positions = Positions()
            # longrope: which factors rotated each token is recorded (Positions.long)
            self._positions.long_after = min((r.long_after for r in layer_ropes(rope) if r.long_after), default=None)
            # dynamic rope types: refused past their limit (Positions.static_until)
            self._positions.static_until = min((r.static_until for r in layer_ropes(rope) if r.static_until),
                                               default=None)
        self.rope = rope
        self.threads = _checks.threads(threads)
        self.kernel = _checks.choice(kernel, "kernel", KERNELS)
        self.synthesis = _checks.choice(synthesis, "synthesis", SYNTHESES + ("auto",))
        if self.synthesis == "auto":
            self.synthesis = _auto_synthesis(model, self.kernel)
        if self.kernel == "triton":
            require("kernel='triton'", ("torch", "triton"), "pip install triton")
            from ..kernels import is_interpreter  # triton, there (above)
            if (model is not None and not self._latent and getattr(model, "device", None) == torch.device("cpu")
                    and not is_interpreter()):
                raise InvalidParameterError(
                    "kernel='triton' for a model on the CPU needs Triton's interpreter (TRITON_INTERPRET=1 set "
                    "before kakeyaturbo.kernels is imported): use kernel='auto' or 'rust' on the CPU")
        #: Why attention does not run over the codes (None when it does).
        self.fast_reason: Optional[str] = _fast_reason(codec, model, self.streams, self.keep_decoded,
                                                       rope, num_layers or 0)
        fast = None if fast is None else _checks.boolean(fast, "fast")  # numpy's bools too, as keep_decoded
        if fast is False:
            self.fast_reason = "fast=False"
        elif self.fast_reason is None:
            self.fast_reason = fast_mod.install(model)
        if fast is True and self.fast_reason is not None:
            raise InvalidParameterError(f"no attention over the codes: {self.fast_reason}")
        self._fast_check = _impl_check(model) if self.fast_reason is None else None
        # The model, weakly: save() records its fingerprint (kakeyaturbo.cache.persist).
        self._model_ref = weakref.ref(model) if model is not None else None
        #: A forward call's snapshot of the layers (rolled back to when the call raises), and why
        #: a refused call left the cache unusable (a hybrid's recurrent states advanced).
        self._undo: Any = None
        self._broken: Optional[str] = None
        #: The position_ids of the forward call under way (calls.watch_calls), for a layer's first
        #: call where the attention hands it none (a padded row's sink: cache.padding).
        self._forward_ids: Optional[torch.Tensor] = None
        #: The tokens held when transformers last turned past recording on, until the next call
        #: (:meth:`activate_past_recording`); None when none were.
        self._assist_from: Optional[int] = None
        if model is not None:
            watch_calls(model, self)
        layers = [self._new_layer(i) for i in range(num_layers or 0)]
        super().__init__(layers=layers)

    @classmethod
    def from_recipe(cls, recipe: Recipe, *, model: Any = None, pre_rope_keys: bool = False,
                    threads: Optional[int] = None, **kwargs: Any) -> "KakeyaCache":
        """A cache with :class:`BlockCodec` of ``recipe`` and the recipe's ``n_sink``,
        ``boundary_layers`` and ``streams``; other keyword arguments as in the constructor."""
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a Recipe (recipes.load(name) gives one), got {type(recipe).__name__}")
        kwargs.setdefault("n_sink", recipe.n_sink)
        kwargs.setdefault("boundary", _recipe_boundary(recipe, model, kwargs.get("num_layers")))
        kwargs.setdefault("streams", recipe.streams)
        return cls(BlockCodec(recipe, pre_rope_keys=pre_rope_keys, threads=threads), model=model, **kwargs)

    @classmethod
    def from_pretrained(cls, model: Any, recipe: Any = "calibrated-4bit", *,
                        calibration: CalibrationLike = None, threads: Optional[int] = None,
                        **kwargs: Any) -> "KakeyaCache":
        """The cache of ``recipe`` (a Recipe, a shipped name or a file) for a loaded ``model``:
        ``KakeyaCache.from_pretrained(model, "calibrated-4bit", calibration="model.kkcal")``.
        A calibrated recipe's codec is fitted from ``calibration`` (the file ``kakeyaturbo
        calibrate --out`` wrote for this model, or a :class:`~kakeyaturbo.calibration.Calibration`;
        default: the recipe's ``[calibration] path``), refused with ModelMismatchError when it was
        made for another model. The recipe's ``n_sink``, ``boundary_layers`` and ``streams`` apply;
        other keyword arguments as in the constructor."""
        codec, rec = codec_for_model(model, recipe, calibration, threads)
        kwargs.setdefault("n_sink", rec.n_sink)
        kwargs.setdefault("boundary", _recipe_boundary(rec, model, kwargs.get("num_layers")))
        kwargs.setdefault("streams", rec.streams)
        return cls(codec, model=model, **kwargs)

    @property
    def fast(self) -> bool:
        """Whether attention runs over the codes (see the constructor). It does at a step where
        the model runs the attention function the cache registered: after
        ``model.set_attn_implementation`` to another, the steps read decoded blocks (the slow
        path) until it is set back. The kernels compute no gradients."""
        return self.fast_reason is None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "KakeyaCache":
        """``copy.deepcopy(cache)`` (transformers copies a prompt's cache to continue it several
        ways): an independent cache of the same tokens, watching the model's calls as this one
        does. Shared: the codec and sealed blobs (never changed), the model's RoPE, config, specs."""
        new = copy_sharing(self, memo, (self.codec, self.rope, self._config, self._specs, *layer_ropes(self.rope)))
        new._undo = None
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            watch_calls(model, new)
        return new

    def __iter__(self) -> Any:
        """Per layer, as ``DynamicCache`` iterates: ``(keys, values, sliding window or None)``,
        the keys and values as attention would read them (sealed blocks decoded)."""
        for layer in self.layers:
            window = getattr(layer, "window", None)
            yield layer.keys, layer.values, None if window is None else torch.tensor(window)

    # --- the prefix on disk (kakeyaturbo.cache.persist) ---------------------------------------

    def save(self, path: "os.PathLike[str] | str", model: Any = None) -> "os.PathLike[str]":
        """Writes what the cache holds to ONE file (sealed blobs as they are, raw rows, positions,
        settings, the model's and the codec's fingerprints) and returns its path; see
        :func:`kakeyaturbo.cache.persist.save`. ``model``: default, the one the cache was built with."""
        from .persist import save

        return save(self, path, model)

    @classmethod
    def load(cls, path: "os.PathLike[str] | str", model: Any, codec: Optional[StreamCodec] = None, *,
             calibration: CalibrationLike = None, **kwargs: Any) -> "KakeyaCache":
        """The cache saved at ``path``, for ``model`` to continue from without recomputing the
        prefix: ``KakeyaCache.load(path, model, calibration="model.kkcal")``. The codec is
        ``codec`` or rebuilt from the recipe in the file (a calibrated one from ``calibration``),
        refused when its fingerprint differs from the file's; see
        :func:`kakeyaturbo.cache.persist.load` for the rest and what it raises."""
        from .persist import load

        return load(path, model, codec, calibration=calibration, **kwargs)

    def _new_layer(self, i: int) -> Any:
        spec = self._specs[i] if i < len(self._specs) else None
        raw = i in self.boundary or not codes_layer(self.codec, i)
        if spec is not None and spec.kind == "compressed":  # DeepSeek V4: the compressor's entries coded
            return compressed_layer(DYNAMIC_LAYER_TYPE_MAPPING[spec.cache_type], self._config, i, self.codec,
                                    split=spec.head_dim, block_size=self.block_size, n_sink=self.n_sink,
                                    streams=() if raw else self.streams, keep_decoded=self.keep_decoded)
        if spec is not None and spec.is_cross:
            # An image's rows for cross-attention (mllama): no RoPE, no positions, no sink (they
            # are no tokens); coded where the codec codes the layer (per-block recipes; calibration
            # text gives a calibrated codec none of their statistics: raw), never attended over
            # the codes. The model reads them back through `keys` / `values` at every step.
            return KakeyaLayer(i, self.codec, block_size=self.block_size, n_sink=0,
                               streams=() if raw else self.streams, keep_decoded=self.keep_decoded)
        if spec is not None and not spec.has_kv:
            # A hybrid's recurrent / convolution state, or no cache (MLP-only, KV sharing):
            # transformers' own layer.
            kw = {"number_of_states": spec.states} if spec.states else {}
            return DYNAMIC_LAYER_TYPE_MAPPING[spec.cache_type](**kw)
        cls: Any = KakeyaLayer
        if spec is not None and spec.states:  # K/V rows and a recurrent state in one layer (Falcon-H1)
            cls = partial(KakeyaStateLayer, number_of_states=spec.states)
        elif spec is not None and spec.cache_type == "indexed_attention":  # and an indexer's keys
            cls = KakeyaIndexedLayer
        layer = cls(i, self.codec, block_size=self.block_size, n_sink=self.n_sink,
                    streams=() if raw else self.streams, rope=rope_of_layer(self.rope, i),
                    positions=self._positions, keep_decoded=self.keep_decoded,
                    window=self.windows[i] if i < len(self.windows) else None)
        layer.readers = 1 + sum(s.reads == i for s in self._specs)  # its own attention, KV sharing's
        layer.latent = self._latent
        if self.fast and set(STREAMS) <= set(layer.streams):
            layer.fast = True
            layer.fast_check = self._fast_check
            layer.threads = self.threads
            layer.synthesis = self.synthesis
            layer.kernel = self.kernel
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:
            self.layers.append(self._new_layer(len(self.layers)))
        layer, ids = self.layers[layer_idx], self._forward_ids
        if (ids is not None and isinstance(layer, KakeyaLayer) and not layer.seen
                and ids.shape[-1] == key_states.shape[-2] and position_ids(kwargs, ids.shape[-1]) is None):
            kwargs = dict(kwargs, position_ids=ids)
        return layer.update(key_states, value_states, *args, **kwargs)

    # The position store is shared by the layers, so the batch and length operations that
    # transformers applies layer by layer apply to it once here.

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Recording the past in every layer (transformers, before assisted, prompt-lookup and MTP
        decoding). transformers 5.25's first call of those then feeds the whole sequence again,
        also the tokens a cache already holds: the next call is refused if it starts within them
        (:func:`~kakeyaturbo.cache.calls.watch_calls`)."""
        super().activate_past_recording(**kwargs)
        self._assist_from = self.get_seq_length() or None

    def reset(self) -> None:
        """Empties the cache for reuse (any batch); a hybrid's linear layers become fresh ones."""
        for layer in self.layers:  # (Cache.reset: each layer's reset)
            if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, KakeyaLayer):
                reset_linear(layer)  # transformers' reset keeps the states' batch and past recording
            else:
                layer.reset()  # a KakeyaStateLayer's resets its states as reset_linear does
        self._broken = None
        self._assist_from = None
        if self._positions is not None:
            self._positions.reset()

    def _snapshot(self) -> Any:
        """What :meth:`_roll_back` puts back (taken before each forward call of the model)."""
        layers = [layer.snapshot() if isinstance(layer, _OWN) else None for layer in self.layers]
        return len(self.layers), layers, None if self._positions is None else self._positions.snapshot()

    def _roll_back(self, snap: Any) -> None:
        """The cache as it was before a forward call that raised (a layer refused its rows):
        the K/V layers as :meth:`_snapshot` saw them, layers the call made reset. A hybrid's
        recurrent or convolution states change in place and cannot be put back: the cache then
        refuses further calls until :meth:`reset`."""
        n, snaps, pos = snap
        states = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, _OWN):
                layer.restore(snaps[i] if i < n else None)
            elif i >= n:
                layer.reset()
            held = isinstance(layer, LinearAttentionLayer) and any(
                [*layer.is_conv_states_initialized.values(), *layer.is_recurrent_states_initialized.values()])
            if i < n and held:
                states.append(i)
        if states:
            self._broken = (f"a refused forward call may have advanced the recurrent or convolution states of "
                            f"layers {states}, which change in place: reset() the cache before the next call")
        if self._positions is not None:
            self._positions.restore(pos)

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` tokens of every layer, or of none: a layer that
        cannot (a sliding one that dropped rows, see :meth:`KakeyaLayer.crop`; a hybrid's
        recurrent or convolution states outside past recording or past what they recorded)
        refuses before any changes (RuntimeError)."""
        r = crop_count(tokens_to_remove)
        for i, layer in enumerate(self.layers):
            refusal = layer.crop_refusal(r) if isinstance(layer, _OWN) else (
                linear_crop_refusal(layer, r, i) if isinstance(layer, LinearAttentionCacheLayerMixin) else None)
            if refusal is not None:
                raise RuntimeError(refusal)
        super().crop(tokens_to_remove)
        if self._positions is not None:
            self._positions.crop(self.get_seq_length())

    @property
    def draft_pending(self) -> bool:
        """Whether a layer took rows while recording the past that no crop answered yet (inside
        a draft's check: :meth:`KakeyaLayer.end_past_recording`)."""
        return any(isinstance(r, KakeyaLayer) and r.draft_pending for r in map(rows_of, self.layers))

    def end_past_recording(self) -> None:
        """Ends past recording in every layer: the K/V layers' (what is due is sealed or dropped
        now) and transformers' own linear layers', which never end it by themselves and from
        transformers 5.25 keep a copy of their recurrent states per call while recording. Called
        before a call that follows one no crop answered (no draft checked any more), and by save."""
        for layer in self.layers:
            rows = rows_of(layer)
            if isinstance(rows, KakeyaLayer):
                rows.end_past_recording()  # a KakeyaStateLayer's: its states' too
            elif isinstance(layer, LinearAttentionCacheLayerMixin):
                end_linear_recording(layer)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self._positions is not None:
            self._positions.select(beam_idx)

    # The layers first: they check the rows asked for before anything changes.
    def batch_repeat_interleave(self, repeats: int) -> None:
        repeats = _checks.integer(repeats, "repeats", 1)
        self._batch_op("batch_repeat_interleave", repeats)
        if self._positions is not None and self._positions.pos is not None:
            self._positions.select(torch.arange(self._positions.pos.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_op("batch_select_indices", indices)
        if self._positions is not None and self._positions.pos is not None:
            self._positions.select(torch.arange(self._positions.pos.shape[0])[torch.as_tensor(indices).to("cpu")])

    def _batch_op(self, op: str, arg: Any) -> None:
        """``op`` on every layer; transformers' linear layers have none: their states here."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin) and not hasattr(layer, op):
                select_states(layer, op, arg, i)
            else:
                getattr(layer, op)(arg)

    # --- accounting ---------------------------------------------------------------------------

    def memory(self) -> Dict[str, int]:
        """Bytes held, by kind: ``blobs`` (sealed blocks), ``sink``, ``staging``, ``decoded``
        (only with keep_decoded), ``state`` (a hybrid model's recurrent and convolution states,
        held as transformers holds them and counted alike in :meth:`nbytes_uncompressed`; a
        compressed-attention layer's window, compressor buffers and overlap state, DeepSeek
        V4's: :mod:`~kakeyaturbo.cache.compressed`), ``indexer`` (the indexer keys of a
        dynamic-sparse-attention layer, DeepSeek V3.2's, or the indexer entries of V4's CSA
        layers, raw),
        ``positions`` (int32 per token and batch row, only when the codec codes keys without
        RoPE; four more per token once an image's multimodal RoPE positions are held:
        :class:`~kakeyaturbo.cache.positions.Positions`) and ``rope_table`` (the cos/sin table
        attention over keys coded before RoPE reads: 8 bytes per position and rotary frequency,
        shared by the layers and by every cache of the model: reported here in full, left out
        of :meth:`nbytes`)."""
        out = {"blobs": 0, "sink": 0, "staging": 0, "decoded": 0, "state": 0, "indexer": 0}
        for layer in self.layers:
            for key, n in _layer_memory(layer).items():
                out[key] += n
        out["positions"] = self._positions.nbytes() if self._positions is not None else 0
        # Keys coded before RoPE on the fast path: the cos/sin tables the kernel read (one per
        # rotary module, shared by every layer; counted once).
        tables = {id(t): t for t in (getattr(layer, "_rope_table", None) for layer in self.layers) if t is not None}
        out["rope_table"] = sum(t.nbytes for t in tables.values())
        return out

    def nbytes(self) -> int:
        """Bytes this cache holds for its sequences: compressed blobs + raw sink and staging rows
        at their dtype (+ decoded blocks with keep_decoded, + positions for pre-RoPE codecs).
        The rope table of :meth:`memory` is not counted: it belongs to the model (one per rotary
        module, shared by every cache and sequence, like transformers' own rotary buffers)."""
        return sum(v for k, v in self.memory().items() if k != "rope_table")

    def nbytes_uncompressed(self) -> int:
        """Bytes a ``DynamicCache`` would hold for the same tokens at the same dtype."""
        return sum((layer.nbytes_uncompressed() if isinstance(layer, _OWN) else 0) + _state_bytes(layer)
                   for layer in self.layers)


#: The cache layers of kakeyaturbo's own (the others are transformers': state layers, no cache).
_OWN = (KakeyaLayer, CompressedEntries)


def _recipe_boundary(recipe: Recipe, model: Any, num_layers: Any) -> Sequence[int]:
    """A recipe's boundary layers, those in range of the model's (or ``num_layers``) layers where
    the count is known: a recipe serves models of any depth (:meth:`Recipe.boundary`)."""
    n = describe(model).num_layers if model is not None else num_layers
    return recipe.boundary(n) if isinstance(n, int) and not isinstance(n, bool) else recipe.boundary_layers


def _state_bytes(layer: Any) -> int:
    """Bytes of the conv and recurrent states a hybrid model's state layer holds (transformers'
    ``LinearAttentionLayer``; 0 for a layer without cache)."""
    out = 0
    for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
        for t in (states or {}).values():
            if isinstance(t, torch.Tensor):
                out += t.numel() * t.element_size()
    return out


def _layer_memory(layer: Any) -> Dict[str, int]:
    out = dict(layer.memory() if isinstance(layer, _OWN) else {})
    out["state"] = out.get("state", 0) + _state_bytes(layer)
    return out


def _auto_synthesis(model: Any, kernel: str) -> str:
    """``synthesis="auto"``: the fixed-point synthesis where the Rust kernel runs its AVX2 or
    AVX-512 build for a model on the CPU (1.2 to 1.4x the bfloat16 one's speed on Zen 3's AVX2,
    1.3 to 1.5x on an Intel AVX-512 CPU with VNNI: docs/decode-attention.md); bfloat16
    elsewhere (the portable build; the Triton kernel's tensor cores)."""
    device = getattr(model, "device", None)
    on_cpu = device is None or torch.device(device).type == "cpu"
    simd = attention_kernel() in ("avx2", "avx512")
    return "i16" if on_cpu and kernel != "triton" and simd else "bf16"


def _fast_reason(codec: StreamCodec, model: Any, streams: Sequence[str], keep_decoded: bool,
                 rope: Any = None, num_layers: int = 0) -> Optional[str]:
    """Why a cache of these settings cannot attend over the codes, or None (the model's family
    and attention implementation are checked by :func:`fast.install`)."""
    if not isinstance(codec, ModelCodec):
        return f"{codec!r} is not a calibrated codec: sealed blocks are decoded, then attended"
    if codec.pre_rope_keys:
        for i in range(num_layers):
            why = fast_mod.dynamic_rope(rope_of_layer(rope, i))
            if why is not None:
                return why
    if not set(STREAMS) <= set(streams):
        return "K and V must both be coded"
    if keep_decoded:
        return "keep_decoded=True attends over the decoded blocks"
    if model is None:
        return "needs model= (the attention function is installed on it)"
    return None


def _impl_check(model: Any) -> Any:
    """A check that ``model`` still runs the registered attention function (a weak reference:
    the cache does not keep the model alive)."""
    ref = weakref.ref(model.config)
    names = frozenset(fast_mod.NAMES.values())

    def check() -> bool:
        cfg = ref()
        return cfg is not None and getattr(cfg, "_attn_implementation", None) in names

    return check
