"""Triton decode attention over the calibrated codes (SPEC section 12): the GPU version of
:func:`kakeyaturbo.decode_attention`, checked against it (``tests/kernels/attention/``).

``batch.py`` lays a :class:`kakeyaturbo.LayerCodes` out on the device (:func:`stack_layer`);
``split.py`` (partial softmaxes per (batch row, kv-head) and piece of positions) and
``combine.py`` (their combination, the value synthesis) are the two launches of
:func:`decode_attention_triton` (``decode.py``)."""

from .batch import LayerBatch, StreamCodes, container_fields, stack_layer
from .decode import decode_attention_triton

__all__ = ["LayerBatch", "StreamCodes", "container_fields", "decode_attention_triton", "stack_layer"]
