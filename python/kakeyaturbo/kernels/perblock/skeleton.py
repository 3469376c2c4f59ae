"""The batched layout the kernels read: skeletons of many blocks padded to common sizes, and
the conversion of one block of a batch back to the parts dict of the extension."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np
import torch

from ...errors import InvalidInputError, InvalidParameterError
from ...reference import perblock as reference
from .._common import check_exponents, f16_nonfinite, f16_values, next_pow2, on_host, outlier_parts, stack_outliers

#: Codec parameters that must agree across the blocks of one batch.
SHARED_PARAMS = ("d", "bit_width", "metric", "rotation_seed", "outlier_threshold")

METRICS = ("mse", "inner_product", "linf")


@dataclasses.dataclass(frozen=True)
class SkeletonBatch:
    """Skeletons of ``B`` blocks on one device, padded to ``W = max(16, next_pow2(max d_eff))``
    coordinates and ``KP = max(16, next_pow2(max k))`` centres (padding is zero).

    ``mean [B, D]``, ``basis [B, W, D]``, ``centers [B, KP, W]``: float32, any batch stride (a
    shared basis may be an ``expand``-ed view); ``d_eff [B]``, ``k [B]``: int32;
    ``signs [W]``: the +-1 pattern of ``rotation_seed``; ``centroids [2**bit_width]`` and
    ``thresholds [2**bit_width - 1]``: float32. ``max_d_eff`` and ``max_k`` are host ints (they
    fix the kernels' tile sizes without reading the device).
    """

    mean: torch.Tensor
    basis: torch.Tensor
    centers: torch.Tensor
    d_eff: torch.Tensor
    k: torch.Tensor
    signs: torch.Tensor
    centroids: torch.Tensor
    thresholds: torch.Tensor
    bit_width: int
    metric: str
    rotation_seed: int
    outlier_threshold: Optional[float]
    max_d_eff: int
    max_k: int

    @property
    def num_blocks(self) -> int:
        return int(self.mean.shape[0])

    @property
    def dim(self) -> int:
        return int(self.mean.shape[1])

    @property
    def width(self) -> int:
        return int(self.basis.shape[1])

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def validate(self) -> None:
        """Raises ValueError when shapes, dtypes, devices or parameters do not fit together."""
        b, d = self.mean.shape
        w = max(16, next_pow2(self.max_d_eff))
        kp = max(16, next_pow2(self.max_k))
        want = {
            "mean": (self.mean, (b, d), torch.float32),
            "basis": (self.basis, (b, w, d), torch.float32),
            "centers": (self.centers, (b, kp, w), torch.float32),
            "d_eff": (self.d_eff, (b,), torch.int32),
            "k": (self.k, (b,), torch.int32),
            "signs": (self.signs, (w,), torch.float32),
            "centroids": (self.centroids, (1 << self.bit_width,), torch.float32),
            "thresholds": (self.thresholds, ((1 << self.bit_width) - 1,), torch.float32),
        }
        if not 1 <= self.bit_width <= 4:
            raise InvalidInputError(f"bit_width must be in 1..4, got {self.bit_width}")
        for name, (t, shape, dtype) in want.items():
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise InvalidInputError(f"{name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
            if t.device != self.mean.device:
                raise InvalidInputError(f"{name} is on {t.device}, mean on {self.mean.device}")
            if t.stride(-1) != 1:
                raise InvalidInputError(f"{name} must be contiguous in its last axis")
        if self.basis.stride(1) != d or self.centers.stride(1) != w:
            raise InvalidInputError("basis and centers rows must be contiguous within a block")
        if self.metric not in METRICS:
            raise InvalidInputError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if self.outlier_threshold is not None and not self.outlier_threshold > 0:
            raise InvalidInputError(f"outlier_threshold must be > 0, got {self.outlier_threshold}")
        if not 1 <= self.max_d_eff <= d or self.max_k < 1:
            raise InvalidInputError(f"max_d_eff={self.max_d_eff}, max_k={self.max_k} out of range for D={d}")
        # Host values are checked too (on a GPU, trusted: checking would read the device): the
        # kernels index the padded matrices with them.
        if on_host(self.d_eff) and b:
            if not (1 <= int(self.d_eff.min()) and int(self.d_eff.max()) <= self.max_d_eff
                    and 1 <= int(self.k.min()) and int(self.k.max()) <= self.max_k):
                raise InvalidParameterError(f"d_eff must be in 1..{self.max_d_eff} and k in 1..{self.max_k}, "
                                            f"got {self.d_eff.tolist()} and {self.k.tolist()}")


def stack_skeletons(parts_list: Sequence[Mapping[str, Any]], device: Any = "cpu") -> SkeletonBatch:
    """Pads and stacks the skeletons of parts dicts (from :func:`kakeyaturbo.encode_block_codes`
    or :func:`kakeyaturbo.reference.perblock.encode_block`) into a :class:`SkeletonBatch` on
    ``device``.

    Every dict must share ``d``, ``bit_width``, ``metric``, ``rotation_seed``,
    ``outlier_threshold`` and the centroid table. Raises ValueError otherwise."""
    if not parts_list:
        raise InvalidInputError("need at least one block")
    first = parts_list[0]
    table = np.asarray(first["centroids"], dtype=np.float32)
    for i, p in enumerate(parts_list):
        for key in SHARED_PARAMS:
            if p[key] != first[key]:
                raise InvalidInputError(f"block {i}: {key}={p[key]!r} differs from block 0 ({first[key]!r})")
        if not np.array_equal(np.asarray(p["centroids"], dtype=np.float32), table):
            raise InvalidInputError(f"block {i}: centroid table differs from block 0")
    d, bw = int(first["d"]), int(first["bit_width"])
    des = [int(p["d_eff"]) for p in parts_list]
    ks = [int(p["k"]) for p in parts_list]
    w, kp = max(16, next_pow2(max(des))), max(16, next_pow2(max(ks)))
    b = len(parts_list)
    mean = np.zeros((b, d), np.float32)
    basis = np.zeros((b, w, d), np.float32)
    centers = np.zeros((b, kp, w), np.float32)
    for i, p in enumerate(parts_list):
        de, k = des[i], ks[i]
        mean[i] = _np(p["mean"])
        basis[i, :de] = _np(p["basis"])
        centers[i, :k, :de] = _np(p["centers"])
    dev = torch.device(device)
    cent = torch.from_numpy(table).to(dev)
    skel = SkeletonBatch(
        mean=torch.from_numpy(mean).to(dev),
        basis=torch.from_numpy(basis).to(dev),
        centers=torch.from_numpy(centers).to(dev),
        d_eff=torch.tensor(des, dtype=torch.int32, device=dev),
        k=torch.tensor(ks, dtype=torch.int32, device=dev),
        signs=reference.sign_pattern(int(first["rotation_seed"]), w, dev),
        centroids=cent,
        thresholds=reference.thresholds(cent),
        bit_width=bw,
        metric=str(first["metric"]),
        rotation_seed=int(first["rotation_seed"]),
        outlier_threshold=None if first["outlier_threshold"] is None else float(first["outlier_threshold"]),
        max_d_eff=max(des),
        max_k=max(ks),
    )
    skel.validate()
    return skel


def _np(v: Any) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def block_parts(
    codes: Mapping[str, torch.Tensor],
    skel: SkeletonBatch,
    rows: Sequence[int],
    i: int,
    skeleton_parts: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """Block ``i`` of a batch as a parts dict of the extension's types (numpy arrays, Python
    ints, bytes), decodable by :func:`kakeyaturbo.decode_block_from_parts`.

    ``codes``: the dict of :func:`kakeyaturbo.kernels.encode_blocks`; ``rows``: the row count of
    every block (host ints). ``skeleton_parts``: the block's original parts, whose non-code
    entries (``mean_exp``, ``skeleton_dtype``) are copied; without it they are 0 and "fp32"."""
    n, de = int(rows[i]), int(skel.d_eff[i])
    k = int(skel.k[i])
    bw = skel.bit_width
    t_bits = codes["t_bits"][i, :n].cpu().numpy().view(np.uint16)
    n_bits = codes["norm_bits"][i, :n].cpu().numpy().view(np.uint16)
    t_exp, n_exp = int(codes["t_exp"][i]), int(codes["norm_exp"][i])
    packed_len = (n * de * bw + 7) // 8
    out: Dict[str, Any] = {
        "n": n,
        "d": skel.dim,
        "d_eff": de,
        "k": k,
        "wht_len": next_pow2(de),
        "bands": [w for _, w in reference.band_layout(de)],
        "bit_width": bw,
        "metric": skel.metric,
        "rotation_seed": skel.rotation_seed,
        "skeleton_dtype": "fp32",
        "outlier_threshold": skel.outlier_threshold,
        "centroids": skel.centroids.cpu().numpy(),
        "mean": skel.mean[i].cpu().numpy(),
        "mean_exp": 0,
        "basis": np.ascontiguousarray(skel.basis[i, :de].cpu().numpy()),
        "centers": np.ascontiguousarray(skel.centers[i, :k, :de].cpu().numpy()),
        "seg_id": codes["seg_id"][i, :n].cpu().numpy().astype(np.int32),
        "t": f16_values(t_bits) * np.float32(2.0**t_exp),
        "t_exp": t_exp,
        "t_bits": t_bits,
        "norm": f16_values(n_bits) * np.float32(2.0**n_exp),
        "norm_exp": n_exp,
        "norm_bits": n_bits,
        "residual_packed": codes["residual_packed"][i, :packed_len].cpu().numpy().tobytes(),
        "residual_codes": np.ascontiguousarray(codes["residual_codes"][i, :n, :de].cpu().numpy()),
        **outlier_parts(codes, i),
    }
    if skeleton_parts is not None:
        out["mean_exp"] = int(skeleton_parts.get("mean_exp", 0))
        out["skeleton_dtype"] = skeleton_parts.get("skeleton_dtype", "fp32")
    return out


def stack_codes(parts_list: Sequence[Mapping[str, Any]], skel: SkeletonBatch) -> Dict[str, torch.Tensor]:
    """The batched codes dict of :func:`kakeyaturbo.kernels.encode_blocks` built from parts
    dicts (e.g. blocks the Rust codec encoded), on the skeleton's device, for
    :func:`kakeyaturbo.kernels.decode_blocks`. ``N`` is the largest block's row count.
    Raises ValueError when the parts do not match the skeleton batch; the codes are checked as
    :func:`kakeyaturbo.decode_block_from_parts` checks them (InvalidInputError for a length,
    a ``seg_id`` or an outlier position out of range, or a non-finite fp16 value;
    InvalidParameterError for an exponent outside -126..=127). Outliers are sorted by position
    (a repeated position keeps its last value, as the Rust decoder applies them in order)."""
    b = skel.num_blocks
    if len(parts_list) != b:
        raise InvalidInputError(f"{len(parts_list)} parts for a skeleton of {b} blocks")
    ns = [int(p["n"]) for p in parts_list]
    if min(ns) < 1:
        raise InvalidInputError(f"every block needs at least one row, got n = {ns}")
    n, w, bw = max(ns), skel.width, skel.bit_width
    de_host, k_host = skel.d_eff.cpu().tolist(), skel.k.cpu().tolist()
    texp, nexp = [int(p["t_exp"]) for p in parts_list], [int(p["norm_exp"]) for p in parts_list]
    check_exponents("t_exp", texp)
    check_exponents("norm_exp", nexp)
    seg = np.zeros((b, n), np.int32)
    tb = np.zeros((b, n), np.uint16)
    nb = np.zeros((b, n), np.uint16)
    codes = np.zeros((b, n, w), np.uint8)
    packed = np.zeros((b, (n * skel.max_d_eff * bw + 7) // 8), np.uint8)
    outliers = []
    for i, p in enumerate(parts_list):
        m, de = ns[i], int(p["d_eff"])
        if de != de_host[i] or int(p["bit_width"]) != bw:
            raise InvalidInputError(f"block {i}: d_eff/bit_width differ from the skeleton batch")

        def vec(key: str, size: int, what: str, dtype: Any = None) -> np.ndarray:
            a = np.asarray(p[key]).reshape(-1)
            a = a.view(dtype) if dtype is not None else a
            if a.size != size:
                raise InvalidInputError(f'block {i}: parts["{key}"] has {a.size} values, expected {what} = {size}')
            return a

        s = vec("seg_id", m, "n").astype(np.int64)
        if s.size and (s.min() < 0 or s.max() >= k_host[i]):
            raise InvalidInputError(f"block {i}: seg_id out of range (k = {k_host[i]})")
        seg[i, :m] = s
        tb[i, :m] = _finite16(vec("t_bits", m, "n", np.uint16), f"block {i}: t_bits")
        nb[i, :m] = _finite16(vec("norm_bits", m, "n", np.uint16), f"block {i}: norm_bits")
        codes[i, :m, :de] = vec("residual_codes", m * de, "n x d_eff").reshape(m, de)
        raw = np.frombuffer(bytes(p["residual_packed"]), np.uint8)
        want = (m * de * bw + 7) // 8
        if raw.size != want:
            raise InvalidInputError(f"block {i}: residual_packed has {raw.size} bytes, expected {want} "
                                    f"({m} x {de} values of {bw} bits)")
        packed[i, : raw.size] = raw
        pos = np.asarray(p["outlier_pos"]).reshape(-1).astype(np.int64)
        bits = _finite16(vec("outlier_bits", pos.size, "len(outlier_pos)", np.uint16), f"block {i}: outlier_bits")
        if pos.size and (pos.min() < 0 or pos.max() >= m * de):
            raise InvalidInputError(f"block {i}: outlier_pos out of range ({m * de} cells)")
        order = np.argsort(pos, kind="stable")
        pos, bits = pos[order], bits[order]
        last = np.ones(pos.size, bool)
        last[:-1] = pos[1:] != pos[:-1]
        outliers.append({"outlier_pos": pos[last], "outlier_bits": bits[last]})
    dev = skel.device

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    return {
        "seg_id": t(seg),
        "t_bits": t(tb.view(np.int16)),
        "t_exp": t(np.array(texp, np.int32)),
        "norm_bits": t(nb.view(np.int16)),
        "norm_exp": t(np.array(nexp, np.int32)),
        "residual_codes": t(codes),
        "residual_packed": t(packed),
        **stack_outliers(outliers, dev),
    }


def _finite16(bits: np.ndarray, what: str) -> np.ndarray:
    """``bits`` (uint16 fp16 patterns), or InvalidInputError for an inf or NaN among them."""
    if f16_nonfinite(bits).any():
        raise InvalidInputError(f"{what} holds a non-finite fp16 value")
    return bits
