"""GPU-only check (``-m gpu``): a realistic layer through the compiled per-block kernels."""

from __future__ import annotations

import concurrent.futures as cf
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

import torch  # noqa: E402

import kakeyaturbo as kt  # noqa: E402
from kakeyaturbo import kernels as K  # noqa: E402

from .. import harness  # noqa: E402
from . import parity  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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
    x = harness.kv_layer(heads, tokens, dim)
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
        harness.assert_decoded(dec[i], want, harness.TOL["decode_float32"], f"block {i}")
    assert nears <= max(1, harness.TOL["near_fraction_fp16"] * nb * bs), nears
