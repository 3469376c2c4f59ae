"""Tests of the per-block mode's torch reference and Triton kernels: its parity cases and
checker (``parity.py``), the fuzz against the Rust codec, the pieces one by one."""
