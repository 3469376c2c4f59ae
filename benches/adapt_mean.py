"""A lever of issue 14 measured, not shipped: per-sequence mean adaptation of the calibrated
codecs. Each (stream, layer, kv-head) of a sequence codes its rows about the mean of the
sequence's own first ``rows`` rows (the first sealed block; known when that block is sealed, so
it is causal) instead of the calibration's mean, with that mean stored once per sequence as
float16 after the blob, so its bytes are counted in the bits like every other byte. Coding
``x`` about a mean ``mu`` with a codec fitted about ``mu_cal`` is coding ``x - (mu - mu_cal)``
with that codec, which is what :class:`MeanAdapted` does around a
:class:`kakeyaturbo.calibration.ModelCodec` (used by ``benches/bench_domains.py --adapt-mean``)."""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np


class MeanAdapted:
    """The codec of a calibrated method with per-sequence means for ``streams``."""

    def __init__(self, inner: Any, stats: Any, recipe: Any, rows: int, streams: Sequence[str]) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.inner, self.rows, self.streams = inner, int(rows), tuple(streams)
        self.pre_rope_keys = inner.pre_rope_keys
        self.model_bytes = inner.model_bytes
        center = {s: st.center for s, st in recipe.calibrated_streams()}
        self.cal: Dict[Tuple[str, int, int], np.ndarray] = {}
        for s, mean in (("k", stats.k_mean), ("v", stats.v_mean)):
            for layer in range(mean.shape[0]):
                for h in range(mean.shape[1]):
                    m = mean[layer, h] if center.get(s, True) else np.zeros_like(mean[layer, h])
                    self.cal[(s, layer, h)] = np.asarray(m, dtype=np.float64)

    def encode(self, stream: str, layer: int, head: int, x: np.ndarray) -> bytes:
        if stream not in self.streams or len(x) == 0:
            return self.inner.encode(stream, layer, head, x)
        mu = x[:self.rows].astype(np.float64).mean(axis=0).astype(np.float16)
        shift = mu.astype(np.float64) - self.cal[(stream, layer, head)]
        blob = self.inner.encode(stream, layer, head, (x - shift).astype(np.float32))
        return blob + mu.tobytes()

    def decode(self, stream: str, layer: int, head: int, blob: bytes) -> np.ndarray:
        if stream not in self.streams:
            return self.inner.decode(stream, layer, head, blob)
        d = len(self.cal[(stream, layer, head)])
        if len(blob) < 2 * d:
            return self.inner.decode(stream, layer, head, blob)
        mu = np.frombuffer(blob[len(blob) - 2 * d:], dtype=np.float16).astype(np.float64)
        y = self.inner.decode(stream, layer, head, blob[:len(blob) - 2 * d])
        return (y + (mu - self.cal[(stream, layer, head)])).astype(np.float32)
