"""Torch references of the codec, the mirror the Triton kernels are checked against.

Plain torch (CPU or CUDA), written to be read, one module per mode:
:mod:`~kakeyaturbo.reference.perblock` (stages 2-5 and the decode of one block against a
skeleton the Rust codec fitted), :mod:`~kakeyaturbo.reference.calibrated` (the calibrated
mode's encode and decode of one head from its calibration's canonical bytes), and
:mod:`~kakeyaturbo.reference.attention` (attention over the decoded codes in float64, what the
attention kernels are checked against). The helpers the first two
share (sign pattern, butterfly, shared-exponent fp16, thresholds, outliers, gain) are in
``_common.py``. Needs torch (the ``eval`` extra), not triton.
"""

from . import attention, calibrated, perblock

__all__ = ["attention", "calibrated", "perblock"]
