"""The test suite, a package: its subpackages (kernels, cache, codec, ...) are imported as
``tests.kernels`` and so on, never as top-level names that would shadow installed packages
(transformers imports the ``kernels`` distribution)."""
