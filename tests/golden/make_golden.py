"""Writes the golden fixtures. Run it only when a container format version is bumped: the
files of earlier versions must stay and keep decoding (tests/test_golden.py for the per-block
containers, tests/codec/test_golden_calibrated.py for the calibrated ones).

    python tests/golden/make_golden.py               # both modes
    python tests/golden/make_golden.py calibrated    # only the calibrated fixtures
"""

from __future__ import annotations

import json
import sys
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


#: name -> the scalar settings of a calibration; the arrays are made by `golden_calibration`.
CALIBRATED_CASES = {
    # Sensitivity-style whitening (analysis != synthesis), the per-row scale with the
    # least-squares gain, outliers, runs of 1, 2 and 3 equal widths, a custom 3-bit table.
    "v1_calibrated_ip_outliers_custom": dict(
        bits=[5, 4, 4, 3, 3, 3, 2, 1], rotation_seed=12345, metric="inner_product", norm=True,
        outlier_threshold=1.8, table_widths=[3],
    ),
    # No per-row scale, no outliers, the N(0, 1) tables only.
    "v1_calibrated_plain": dict(
        bits=[4, 4, 2, 2, 2, 2, 1, 1], rotation_seed=0xCAFEBABE, metric="mse", norm=False,
        outlier_threshold=None, table_widths=[],
    ),
}


def golden_calibration(x: np.ndarray, m: int) -> dict:
    """A calibration of `m` components fitted on `x` in a diagonally whitened space: analysis
    `U * l`, synthesis `U / l`, spread the square roots of the whitened eigenvalues."""
    l = np.linspace(0.5, 2.0, x.shape[1])
    mean = x.astype(np.float64).mean(0)
    xw = (x - mean) * l
    lam, vec = np.linalg.eigh(xw.T @ xw / len(x))
    order = np.argsort(lam)[::-1][:m]
    u = vec[:, order].T
    u *= np.sign(u[:, :1] + 1e-30)  # a fixed sign per component
    return dict(
        mean=mean.astype(np.float32), analysis=(u * l).astype(np.float32),
        synthesis=(u / l).astype(np.float32), spread=np.sqrt(lam[order]).astype(np.float32),
    )


def make_calibrated() -> None:
    x = golden_input()
    manifest = {}
    for name, case in CALIBRATED_CASES.items():
        arrays = golden_calibration(x, len(case["bits"]))
        arrays["bits"] = np.asarray(case["bits"], dtype=np.uint8)
        tables = {b: (kt.centroids_gaussian(b) * np.float32(1.07)).astype(np.float32)
                  for b in case["table_widths"]}
        for b, t in tables.items():
            arrays[f"centroids_{b}"] = t
        np.savez(HERE / f"{name}.npz", **arrays)
        codec = kt.CalibratedCodec(
            arrays["mean"], arrays["analysis"], arrays["synthesis"], arrays["spread"],
            arrays["bits"], rotation_seed=case["rotation_seed"], metric=case["metric"],
            norm=case["norm"], outlier_threshold=case["outlier_threshold"],
            centroids=tables or None,
        )
        data = codec.encode(x)
        (HERE / f"{name}.kkyc").write_bytes(data)
        np.save(HERE / f"{name}.decoded.npy", codec.decode(data))
        manifest[name] = dict(
            rotation_seed=case["rotation_seed"], metric=case["metric"], norm=case["norm"],
            outlier_threshold=case["outlier_threshold"], table_widths=case["table_widths"],
            fingerprint=f"{codec.fingerprint:016x}", model_bytes=codec.model_bytes,
            num_outliers=codec.inspect(data)["num_outliers"],
        )
    (HERE / "calibrated_cases.json").write_text(json.dumps(manifest, indent=1) + "\n")


def main() -> None:
    if sys.argv[1:] == ["calibrated"]:
        make_calibrated()
        return
    make_calibrated()
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
