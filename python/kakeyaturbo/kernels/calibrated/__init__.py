"""Triton kernels of the calibrated mode: the encode and decode of many heads per launch, one
calibration per head (:mod:`kakeyaturbo.reference.calibrated` is their torch mirror).

``batch.py`` holds the batched layout; the encode (``encode.py``) is up to three launches,
``rms.py``, ``quantize.py`` and ``gain.py``; the decode (``decode.py``) is one."""

from .batch import CalibrationBatch, head_parts, stack_calibrated_parts, stack_calibrations
from .decode import decode_calibrated
from .encode import encode_calibrated, outlier_capacity

__all__ = [
    "CalibrationBatch",
    "decode_calibrated",
    "encode_calibrated",
    "head_parts",
    "outlier_capacity",
    "stack_calibrated_parts",
    "stack_calibrations",
]
