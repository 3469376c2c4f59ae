"""GPU-only checks (``-m gpu``): a realistic layer through the compiled kernels, in the
per-block and the calibrated mode."""

from __future__ import annotations

import concurrent.futures as cf
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import calibrate  # noqa: E402
from kakeyaturbo import kernels as K  # noqa: E402
from kakeyaturbo.reference import calibrated as rc  # noqa: E402

from . import parity, parity_calibrated  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_kernels_are_compiled_on_the_gpu() -> None:
    assert not K.is_interpreter()


@pytest.mark.parametrize(
    "kw",
    [
        dict(metric="inner_product", bit_width=3, pca_method="randomized", rsvd_target_rank=64, k=16,
             outlier_threshold=2.0),
        dict(metric="mse", bit_width=2, k=16),
    ],
    ids=["K", "V"],
)
def test_realistic_layer_matches_rust(kw: dict) -> None:
    """8 kv heads x 8192 tokens x 128 in bf16, 128 blocks of 512 in one batched encode and one
    decode, every block checked against Rust."""
    heads, tokens, dim, bs = 8, 8192, 128, 512
    x = parity.kv_layer(heads, tokens, dim)
    flat = x.reshape(-1, dim)
    nb = flat.shape[0] // bs
    with cf.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        parts = list(pool.map(lambda i: kt.encode_block_codes(flat[i * bs:(i + 1) * bs], **kw), range(nb)))
    skel = K.stack_skeletons(parts, "cuda")
    xg = torch.from_numpy(x).to("cuda", torch.bfloat16).view(nb, bs, dim)
    with K.poison_outputs():
        codes = K.encode_blocks(xg, skel)
        dec = K.decode_blocks(codes, skel).cpu().numpy()
    nears = 0
    for i in range(nb):
        ours = K.block_parts(codes, skel, [bs] * nb, i, parts[i])
        res = parity.compare_block(flat[i * bs:(i + 1) * bs], parts[i], ours, f"block {i}")
        nears += len(res.nears)
        want = kt.decode_block_from_parts(ours)
        parity.assert_decoded(dec[i], want, parity.TOL["decode_float32"], f"block {i}")
    assert nears <= max(1, parity.TOL["near_fraction_fp16"] * nb * bs), nears


@pytest.mark.parametrize(
    "bits, kw",
    [(4.4, dict(metric="mse")), (3.4, dict(metric="inner_product", outlier_threshold=3.0))],
    ids=["K", "V"],
)
def test_calibrated_layer_matches_rust(bits: float, kw: dict) -> None:
    """8 kv heads x 8192 tokens x 128 in bf16, one calibration per head fitted on its own rows,
    one batched encode and decode, every head checked against Rust."""
    heads, tokens, dim = 8, 8192, 128
    x = parity.kv_layer(heads, tokens, dim)
    codecs = []
    for h in range(heads):
        rows = x[h].astype(np.float64)
        fit = calibrate.fit_stream(rows.mean(0), np.cov(rows.T, bias=True), bits)
        codecs.append(fit.codec(**kw))
    cals = [rc.calibration_of(c) for c in codecs]
    batch = K.stack_calibrations(cals, "cuda")
    xg = torch.from_numpy(x).to("cuda", torch.bfloat16)
    with K.poison_outputs():
        codes = K.encode_calibrated(xg, batch, intermediates=True)
        dec = K.decode_calibrated(codes, batch).cpu().numpy()
    nears = 0
    for i, c in enumerate(codecs):
        ours = K.head_parts(codes, batch, [tokens] * heads, i)
        res = parity_calibrated.compare_head(x[i], c, cals[i], c.encode_parts(x[i]), ours, f"head {i}")
        nears += len(res.nears)
        parity.assert_decoded(dec[i], c.decode_parts(ours), parity.TOL["decode_float32"], f"head {i}")
    assert nears <= max(1, parity.TOL["near_fraction_fp16"] * heads * tokens), nears
