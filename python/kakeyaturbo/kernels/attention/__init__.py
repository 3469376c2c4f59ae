"""Triton decode attention over the calibrated codes (SPEC section 12): the GPU version of
:func:`kakeyaturbo.decode_attention`, checked against it (``tests/kernels/attention/``).

``batch.py`` lays a :class:`kakeyaturbo.LayerCodes` out on the device (:func:`stack_layer`);
``split.py`` (partial softmaxes per (batch row, kv-head) and piece of positions) and
``combine.py`` (their combination, the value synthesis) are the two launches of
:func:`decode_attention_triton` (``decode.py``). Keys coded before RoPE: a rotary table staged
once by :func:`stack_rope` and each sealed row's position."""

from .batch import (LayerBatch, RopeBatch, StreamCodes, container_fields, extend_layer, key_synthesis,
                    stack_layer, stack_rope)
from .decode import decode_attention_triton

__all__ = ["LayerBatch", "RopeBatch", "StreamCodes", "container_fields", "decode_attention_triton", "extend_layer",
           "key_synthesis", "stack_layer", "stack_rope"]
