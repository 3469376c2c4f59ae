"""GPU-only check (``-m gpu``): a realistic layer through the compiled calibrated kernels."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kakeyaturbo import calibrate  # noqa: E402
from kakeyaturbo import kernels as K  # noqa: E402
from kakeyaturbo.reference import calibrated as rc  # noqa: E402

from .. import harness  # noqa: E402
from . import parity  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "bits, kw",
    [(4.4, dict(metric="mse")), (3.4, dict(metric="inner_product", outlier_threshold=3.0))],
    ids=["K", "V"],
)
def test_calibrated_layer_matches_rust(bits: float, kw: dict) -> None:
    """8 kv heads x 8192 tokens x 128 in bf16, one calibration per head fitted on its own rows,
    one batched encode and decode, every head checked against Rust."""
    heads, tokens, dim = 8, 8192, 128
    x = harness.kv_layer(heads, tokens, dim)
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
        res = parity.compare_head(x[i], c, cals[i], c.encode_parts(x[i]), ours, f"head {i}")
        nears += len(res.nears)
        harness.assert_decoded(dec[i], c.decode_parts(ours), harness.TOL["decode_float32"], f"head {i}")
    assert nears <= max(1, harness.TOL["near_fraction_fp16"] * heads * tokens), nears
