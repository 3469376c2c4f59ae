"""Writes the golden fixtures. Run it only when the container format version is bumped: the
files of earlier versions must stay and keep decoding (tests/test_golden.py).

    python tests/golden/make_golden.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import kakeyaturbo as kt

HERE = Path(__file__).parent

#: name -> codec keyword arguments; each exercises a different corner of the format.
CASES = {
    "v1_perblock_custom_outliers": dict(
        block_size=32, bit_width=2, centroids=[-1.3, -0.35, 0.35, 1.3], outlier_threshold=1.5,
        k=4, metric="inner_product",
    ),
    "v1_shared_fp32_randomized": dict(
        block_size=48, bit_width=3, share_basis=True, skeleton_dtype="fp32",
        pca_method="randomized", rsvd_target_rank=5, variance_ratio=0.9,
    ),
    "v1_default_b4_d12": dict(bit_width=4),
}


def golden_input(seed: int = 7) -> np.ndarray:
    """A small deterministic [70, 12] tensor with a decaying spectrum and a tail block."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((70, 12)) * (0.8 ** np.arange(12))
    x[:, 3] *= 6.0
    return x.astype(np.float32)


def main() -> None:
    x = golden_input()
    np.save(HERE / "input.npy", x)
    manifest = {}
    for name, kwargs in CASES.items():
        data = kt.encode_layer(x, **kwargs)
        (HERE / f"{name}.kkyt").write_bytes(data)
        np.save(HERE / f"{name}.decoded.npy", kt.decode_layer(data))
        manifest[name] = kwargs
    (HERE / "cases.json").write_text(json.dumps(manifest, indent=1) + "\n")
    signs = {str(seed): "".join("-" if v < 0 else "+" for v in kt.wht_sign_pattern(seed, 64))
             for seed in (0, 1, 0xCAFEBABE, 2**64 - 1)}
    (HERE / "signs.json").write_text(json.dumps(signs, indent=1) + "\n")


if __name__ == "__main__":
    main()
