"""Bounds the Python side of the package shares (the core's own: ``_core.MAX_DIM``, ``MAX_ROWS``)."""

#: The most layers a model may have: a cache's ``num_layers`` (every layer is built up front),
#: the layer indices statistics record (one beyond is damage, not a model) and a config's
#: ``num_hidden_layers`` (:func:`kakeyaturbo.families.describe` refuses more before any per-layer
#: work).
MAX_LAYERS = 4096
