"""A torch reference of stages 2-5 and of the decode, for one block (CPU or CUDA).

It consumes a skeleton fitted by the Rust codec (the parts dict of
:func:`kakeyaturbo.encode_block_codes`: ``mean``, ``basis``, ``centers``, ``d_eff``, ``k`` and the
codec parameters) and produces a parts dict with the same names. It is written to be read:
every step follows ``rust/kakeyaturbo/src/perblock/block.rs`` and ``decode.rs`` in the same f32 arithmetic and order where
the order decides a code (the Hadamard butterfly, ``t`` rounded before the residual, the
shared-exponent fp16 rounding, ``f_b / scale`` then a multiply, thresholds ``0.5 * (c_i +
c_{i+1})``, "number of thresholds strictly below ``z``"). Sums (the projection, dot products,
norms) run in torch's order, not Rust's fixed 8-lane / faer order, so a value within a few
ulps of a decision threshold may code differently; the parity tests bound and report those.

Values in the returned dict are torch tensors on the input's device, except the
parameters copied from the skeleton (plain Python values). ``t_exp``/``norm_exp`` are 0-d
int32 tensors (no host synchronisation), ``residual_packed`` a uint8 tensor;
:func:`to_numpy_parts` turns the dict into exactly the types the extension uses.
This module needs torch (the ``eval`` extra), not the extension; the helpers it shares with
the calibrated reference are in ``_common.py``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

import torch

from ..errors import InvalidInputError
from ._common import (
    as_tensor,
    bits_to_f32,
    check_finite,
    counted,
    exponent,
    fwht,
    gain,
    outliers,
    pow2,
    scaled_f16,
    sign_pattern,
    thresholds,
)

__all__ = [
    "band_factors",
    "band_layout",
    "decode_block",
    "encode_block",
    "fwht",
    "inverse_rotate",
    "pack_codes",
    "pow2",
    "rotate",
    "scaled_f16",
    "sign_pattern",
    "thresholds",
    "to_numpy_parts",
    "unpack_codes",
]

#: The parameter and skeleton-shape entries copied unchanged from the skeleton's parts.
PARAM_KEYS = (
    "n",
    "d",
    "d_eff",
    "k",
    "wht_len",
    "bands",
    "bit_width",
    "metric",
    "rotation_seed",
    "skeleton_dtype",
    "outlier_threshold",
)


def band_layout(d_eff: int) -> List[Tuple[int, int]]:
    """``(offset, width)`` of each band: the powers of two of ``d_eff``, largest first."""
    bands, off = [], 0
    for bit in reversed(range(max(d_eff, 1).bit_length())):
        w = 1 << bit
        if d_eff & w:
            bands.append((off, w))
            off += w
    return bands


def band_factors(d_eff: int, device: Any = None) -> torch.Tensor:
    """``f_b = sqrt(d_eff / W_b)`` in f32 for every coordinate (float32 ``[d_eff]``)."""
    f = torch.empty(d_eff, dtype=torch.float32, device=device)
    for off, w in band_layout(d_eff):
        # f32 division then f32 sqrt, both correctly rounded, as in Rotation::new.
        q = torch.tensor(d_eff, dtype=torch.float32) / torch.tensor(w, dtype=torch.float32)
        f[off : off + w] = torch.sqrt(q).to(device)
    return f


def rotate(r: torch.Tensor, signs: torch.Tensor, d_eff: int) -> torch.Tensor:
    """``y = H(s * r)`` band by band; ``r`` is ``[..., d_eff]``, ``signs`` has length >= d_eff."""
    parts = [fwht(r[..., o : o + w] * signs[o : o + w]) for o, w in band_layout(d_eff)]
    return torch.cat(parts, dim=-1)


def inverse_rotate(y: torch.Tensor, signs: torch.Tensor, d_eff: int) -> torch.Tensor:
    """``r = s * H(y) / W_b`` band by band (``inverse_rotate`` of ``wht.rs``)."""
    parts = []
    for o, w in band_layout(d_eff):
        inv = torch.tensor(1.0 / w, dtype=torch.float32, device=y.device)
        parts.append(fwht(y[..., o : o + w]) * signs[o : o + w] * inv)
    return torch.cat(parts, dim=-1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs integer codes ``< 2**bits`` LSB-first (value i in stream bits [i*b, (i+1)*b))."""
    flat = codes.reshape(-1).to(torch.int32)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = ((flat[:, None] >> shifts) & 1).reshape(-1)
    pad = (-stream.numel()) % 8
    stream = torch.cat((stream, stream.new_zeros(pad))).reshape(-1, 8)
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream * weights).sum(dim=1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``count`` uint8 codes."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)[: count * bits]
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream.reshape(count, bits) * weights).sum(dim=1).to(torch.uint8)


def encode_block(x: torch.Tensor, skeleton: Mapping[str, Any]) -> Dict[str, Any]:
    """Stages 2-5 of one block against a given skeleton.

    ``x``: float32 or bfloat16 ``[n, D]`` (bfloat16 is widened to f32 first, as the caller
    would before the Rust path). ``skeleton``: a parts dict (numpy values from the extension,
    or torch values from this module) of which ``mean [D]``, ``basis [d_eff, D]``,
    ``centers [k, d_eff]``, ``centroids [2**bit_width]`` and the parameters are read.
    Returns the parts dict: the skeleton entries (as tensors on ``x.device``) and the codes
    ``seg_id [n] int32``, ``t``/``norm [n] float32``, ``t_bits``/``norm_bits [n] uint16``,
    ``t_exp``/``norm_exp`` (0-d int32), ``residual_codes [n, d_eff] uint8``,
    ``residual_packed [ceil(n d_eff b / 8)] uint8``, ``outlier_pos [m] int64``,
    ``outlier_bits [m] uint16``, ``outlier_val [m] float32``.
    Raises ValueError on a shape or dtype mismatch, InvalidInputError (a ValueError) on a
    non-finite value.
    """
    if x.ndim != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise InvalidInputError(f"x must be float32 or bfloat16 [n, D], got {x.dtype} {tuple(x.shape)}")
    check_finite("x", x)
    dev = x.device
    n, d = x.shape
    de, k, bw = int(skeleton["d_eff"]), int(skeleton["k"]), int(skeleton["bit_width"])
    mean = as_tensor(skeleton["mean"], dev, torch.float32)
    basis = as_tensor(skeleton["basis"], dev, torch.float32)
    centers = as_tensor(skeleton["centers"], dev, torch.float32)
    table = as_tensor(skeleton["centroids"], dev, torch.float32)
    if mean.shape != (d,) or basis.shape != (de, d) or centers.shape != (k, de):
        raise InvalidInputError(
            f"skeleton shapes mean {tuple(mean.shape)}, basis {tuple(basis.shape)}, centers "
            f"{tuple(centers.shape)} do not fit x [n={n}, D={d}] with d_eff={de}, k={k}"
        )
    if n == 0 or table.shape != (1 << bw,):
        raise InvalidInputError(f"need n >= 1 and 2**bit_width centroids, got n={n}, {tuple(table.shape)}")
    signs = sign_pattern(int(skeleton["rotation_seed"]), de, dev)
    f = band_factors(de, dev)

    # Stage 2: c = U (x - mu), the subtraction in f32 first as in block::project.
    c = (x.to(torch.float32) - mean) @ basis.T
    # Stage 3: seg = argmax |<c, centre>| (first maximum), t rounded before the residual.
    g = c @ centers.T
    seg = torch.argmax(g.abs(), dim=1)  # torch returns the first maximal index
    t_raw = g.gather(1, seg[:, None])[:, 0]
    t_exp, t_bits, t_hat = scaled_f16(t_raw)
    r = c - t_hat[:, None] * centers[seg]
    norms = torch.sqrt((r * r).sum(dim=1))
    norm_exp, norm_bits, s_hat = scaled_f16(norms)
    # Stage 4: z = H(s r) * (f_b / s_hat), 0 for a zero residual.
    y = rotate(r, signs, de)
    safe = torch.where(s_hat > 0, s_hat, torch.ones_like(s_hat))
    inv = torch.where(s_hat[:, None] > 0, f[None, :] / safe[:, None], torch.zeros_like(y))
    z = y * inv
    # Stage 5: index = number of thresholds strictly below z; outliers |z| > T as fp16.
    thr = thresholds(table)
    codes = (z[..., None] > thr).sum(dim=-1).to(torch.uint8)
    qv = table[codes.long()]
    qv, opos, obits = outliers(z, qv, skeleton.get("outlier_threshold"))
    if skeleton["metric"] == "inner_product":
        norm_exp, norm_bits, s_store = scaled_f16(gain(z, qv, s_hat))
    else:
        s_store = s_hat
    out: Dict[str, Any] = {key: skeleton[key] for key in PARAM_KEYS}
    out["n"] = n
    out.update(
        centroids=table,
        mean=mean,
        mean_exp=skeleton.get("mean_exp", 0),
        basis=basis,
        centers=centers,
        seg_id=seg.to(torch.int32),
        t=t_hat,
        t_exp=t_exp,
        t_bits=t_bits,
        norm=s_store,
        norm_exp=norm_exp,
        norm_bits=norm_bits,
        residual_packed=pack_codes(codes, bw),
        residual_codes=codes,
        outlier_pos=opos,
        outlier_bits=obits.view(torch.uint16),
        outlier_val=bits_to_f32(obits),
    )
    return out


def decode_block(parts: Mapping[str, Any], device: Any = None) -> torch.Tensor:
    """Decodes a parts dict (numpy from the extension or torch from :func:`encode_block`) into
    float32 ``[n, D]`` on ``device`` (default: the device of ``parts["mean"]``, else CPU).

    Unpack, centroid lookup, outlier override, ``y * (scale / f_b)``, inverse band rotation,
    ``+ t centre_seg``, ``mu + U^T c``. Raises ValueError on inconsistent parts, as
    :func:`kakeyaturbo.decode_block_from_parts` does: InvalidInputError for a length that does
    not fit or a ``seg_id`` or outlier position out of range, InvalidParameterError for an
    exponent outside -126..=127."""
    if device is None:
        m = parts["mean"]
        device = m.device if isinstance(m, torch.Tensor) else "cpu"
    n, d, de, k = (int(parts[key]) for key in ("n", "d", "d_eff", "k"))
    bw = int(parts["bit_width"])
    mean = as_tensor(parts["mean"], device, torch.float32)
    basis = as_tensor(parts["basis"], device, torch.float32)
    centers = as_tensor(parts["centers"], device, torch.float32)
    table = as_tensor(parts["centroids"], device, torch.float32)
    if mean.shape != (d,) or basis.shape != (de, d) or centers.shape != (k, de):
        raise InvalidInputError("parts hold a skeleton of inconsistent shape")
    packed = as_tensor(parts["residual_packed"], device, torch.uint8)
    if packed.numel() != (n * de * bw + 7) // 8:
        raise InvalidInputError(f"residual_packed has {packed.numel()} bytes, expected {(n * de * bw + 7) // 8}")
    seg = counted(as_tensor(parts["seg_id"], device, torch.int64), "seg_id", n, "n")
    if seg.numel() and (int(seg.min()) < 0 or int(seg.max()) >= k):
        raise InvalidInputError(f"seg_id out of range (k = {k})")
    t_bits = counted(as_tensor(parts["t_bits"], device, torch.int32), "t_bits", n, "n")
    n_bits = counted(as_tensor(parts["norm_bits"], device, torch.int32), "norm_bits", n, "n")
    t_hat = bits_to_f32(t_bits) * pow2(torch.tensor(exponent(parts, "t_exp"), device=device))
    scale = bits_to_f32(n_bits) * pow2(torch.tensor(exponent(parts, "norm_exp"), device=device))
    codes = unpack_codes(packed, bw, n * de).reshape(n, de)
    q = table[codes.long()].reshape(-1)
    opos = as_tensor(parts["outlier_pos"], device, torch.int64).reshape(-1)
    obits = counted(as_tensor(parts["outlier_bits"], device, torch.int32), "outlier_bits", opos.numel(),
                    "len(outlier_pos)")
    if opos.numel():
        if int(opos.min()) < 0 or int(opos.max()) >= n * de:
            raise InvalidInputError(f"outlier_pos out of range ({n * de} cells)")
        q[opos] = bits_to_f32(obits)
    q = q.reshape(n, de)
    f = band_factors(de, device)
    y = q * (scale[:, None] / f[None, :])
    r = inverse_rotate(y, sign_pattern(int(parts["rotation_seed"]), de, device), de)
    c = r + t_hat[:, None] * centers[seg]
    return mean + c @ basis


def to_numpy_parts(parts: Mapping[str, Any]) -> Dict[str, Any]:
    """The parts dict with the extension's types: numpy arrays of the same dtypes, Python ints
    for ``t_exp``/``norm_exp``/``mean_exp``, bytes for ``residual_packed``; accepted by
    :func:`kakeyaturbo.decode_block_from_parts`."""
    out: Dict[str, Any] = {}
    for key, v in parts.items():
        if key == "residual_packed":
            out[key] = bytes(v.cpu().numpy().tobytes()) if isinstance(v, torch.Tensor) else bytes(v)
        elif key in ("t_exp", "norm_exp", "mean_exp"):
            out[key] = int(v)
        elif isinstance(v, torch.Tensor):
            out[key] = v.detach().cpu().numpy()
        else:
            out[key] = v
    return out
