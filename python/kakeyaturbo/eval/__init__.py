"""Evaluation of the codec on real models: the protocol of EVAL.md (metrics, baselines).

The model-facing harness (`kakeyaturbo eval`) is built on these pieces; the pieces themselves
need only numpy.
"""
