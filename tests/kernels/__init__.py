"""Tests of the torch reference and the Triton kernels against the Rust codec.

A package (not a loose folder) so that its ``conftest.py`` does not take the module name
``conftest`` from ``tests/conftest.py``, whose names the top-level tests import."""
