"""Fitting: statistics -> calibrations. The whitening factor, the spectrum of one (stream, layer,
kv-head) in its whitened space (computed once, used by the allocation and the fit), the basis,
spreads and bits of a :class:`StreamFit`, and Lloyd-Max tables on the codec's own ``z``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..codec import CalibratedCodec, _checks, centroids_gaussian
from ..errors import InvalidInputError, InvalidParameterError, NumericalError
from ..recipes import CalibratedStream
from .allocation import LLOYD_MAX_MSE, allocate_bits, check_target, row_budget
from .stats import AttentionStats, Sensitivity, check_types, square

#: Ridge added to the query covariance, relative to its mean diagonal (SPEC section 7).
RIDGE = 1e-3


def lloyd_max(samples: np.ndarray, bits: int, iters: int = 100) -> np.ndarray:
    """A ``2**bits``-level Lloyd-Max table fitted to 1-D samples (1-D Lloyd iteration from the
    N(0, 1) table scaled to the samples' rms); strictly ascending float64. TypeError for
    samples that are not numeric, InvalidInputError for NaN or inf among them,
    InvalidParameterError for bits outside 1..8."""
    raw = np.asarray(samples)
    if raw.dtype.kind not in "fiu":
        raise TypeError(f"samples must be numeric, got dtype {raw.dtype}")
    bits = _checks.integer(bits, "bits", 1, 8)  # a table's widths, checked before 2 ** bits
    iters = _checks.integer(iters, "iters", 0)
    z = np.sort(np.asarray(samples, dtype=np.float64).ravel())
    if not np.all(np.isfinite(z)):
        raise InvalidInputError("samples hold NaN or inf")
    if z.size < 2 ** bits:
        raise InvalidParameterError(f"{z.size} samples cannot fit a {bits}-bit table")
    c = centroids_gaussian(bits).astype(np.float64) * max(np.sqrt(np.mean(z * z)), 1e-12)
    csum = np.concatenate([[0.0], np.cumsum(z)])
    for _ in range(iters):
        cut = np.searchsorted(z, (c[1:] + c[:-1]) / 2, side="right")
        lo = np.concatenate([[0], cut])
        hi = np.concatenate([cut, [z.size]])
        cnt = hi - lo
        new = np.where(cnt > 0, (csum[hi] - csum[lo]) / np.maximum(cnt, 1), c)
        if np.allclose(new, c, rtol=0, atol=1e-9):
            c = new
            break
        c = new
    # Keep the table strictly ascending even if a cell emptied.
    for i in range(1, len(c)):
        if c[i] <= c[i - 1]:
            c[i] = np.nextafter(np.float32(c[i - 1]), np.float32(np.inf))
    return c


def whitening_factor(second_moment: np.ndarray, ridge: float = RIDGE) -> np.ndarray:
    """Lower-triangular ``L`` with ``L L^T = S + ridge * mean(diag S) I``: a row ``x`` whitened
    as ``x L`` has ``|e L|^2 = e^T S e`` for any error ``e`` (up to the ridge).

    TypeError for a non-numeric ``S``, InvalidInputError when it is not a finite square matrix,
    symmetric with a non-negative diagonal, InvalidParameterError for a ridge that is not finite
    and ``>= 0``, NumericalError when the factorisation fails (``S`` is not positive definite
    enough for the ridge)."""
    square(second_moment, "second_moment", covariance=True)
    if _checks.real(ridge, "ridge") < 0:
        raise InvalidParameterError(f"ridge must be >= 0, got {ridge}")
    s = np.asarray(second_moment, dtype=np.float64)
    s = s / 2 + s.T / 2  # halves first: a sum near float64's limit overflowed to an all-inf factor
    with np.errstate(over="ignore"):
        level = float(np.mean(np.diag(s)))
    if not np.isfinite(level):  # the diagonal's sum past float64's range: its mean by parts
        level = float(np.sum(np.diag(s) / len(s)))
    s = s + ridge * max(level, 1e-30) * np.eye(len(s))
    try:
        factor = np.linalg.cholesky(s)  # LinAlgError where S is not positive semi-definite
    except np.linalg.LinAlgError as e:
        raise NumericalError(f"the second moment is not positive definite with ridge {ridge} "
                             f"({e})") from e
    if not np.isfinite(factor).all():  # S plus its ridge past float64's range
        raise NumericalError(f"the second moment with ridge {ridge} overflows float64")
    return factor


@dataclass
class StreamFit:
    """One stream's calibration, before it becomes a :class:`CalibratedCodec`."""

    mean: np.ndarray
    analysis: np.ndarray
    synthesis: np.ndarray
    spread: np.ndarray
    bits: np.ndarray
    variances: np.ndarray
    whitening: Optional[np.ndarray] = None

    def codec(self, **kw: Any) -> CalibratedCodec:
        return CalibratedCodec(self.mean, self.analysis, self.synthesis, self.spread, self.bits, **kw)


def spectrum(cov: np.ndarray, whitening: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Eigenvalues (descending, >= 0) and eigenvectors (columns) of ``cov`` in the whitened
    space ``x -> x L``: the variances water-filling allocates over. InvalidInputError (TypeError
    for non-numeric arrays) when ``cov`` is not a finite symmetric ``[D, D]`` matrix with a
    non-negative diagonal or ``whitening`` not a finite ``[D, D]`` one, NumericalError when the
    eigen solver fails."""
    d = len(square(cov, "cov", covariance=True))
    if whitening is not None:
        square(whitening, "whitening", d)
    c = np.asarray(cov, dtype=np.float64)
    if whitening is not None:
        w = np.asarray(whitening, dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):  # checked below
            c = w.T @ c @ w
    if not np.isfinite(c).all():  # whitened past float64's range
        raise NumericalError("the whitened covariance overflows float64")
    try:
        lam, u = np.linalg.eigh(c / 2 + c.T / 2)  # halves first: a sum near the limit overflowed to NaN
    except np.linalg.LinAlgError as e:
        raise NumericalError(f"the spectrum of cov cannot be computed ({e})") from e
    order = np.argsort(lam)[::-1]
    return np.maximum(lam[order], 0.0), u[:, order]


def _synthesis(u: np.ndarray, whitening: Optional[np.ndarray]) -> np.ndarray:
    """Synthesis rows of the components ``u`` (columns, in the whitened space): ``U^T L^-1``,
    so that a coefficient error ``e`` is the row error ``e @ synthesis``."""
    if whitening is None:
        return np.asarray(u.T)
    return np.linalg.solve(np.asarray(whitening, dtype=np.float64).T, u).T


@dataclass
class HeadSpectrum:
    """One (stream, layer, kv-head) in its whitened space ``x -> x L``: the mean that is
    subtracted, the variances (descending, >= 0) and components (columns of ``vectors``) of
    :func:`spectrum`, and the whitening factor ``L`` (or None). Computed once per head; the
    allocation and the fit both read it."""

    mean: np.ndarray
    variances: np.ndarray
    vectors: np.ndarray
    whitening: Optional[np.ndarray] = None

    def synthesis(self) -> np.ndarray:
        """Synthesis rows of every component (see :func:`_synthesis`)."""
        return _synthesis(self.vectors, self.whitening)


def fit_spectrum(sp: HeadSpectrum, bits_per_element: float, *, norm: bool = True,
                 max_bits: int = 8, bits: Optional[np.ndarray] = None,
                 min_bits: int = 0, max_components: Optional[int] = None,
                 component_cost: float = 0.0) -> StreamFit:
    """The calibration of one head from its spectrum, water-filled to the target (or given
    ``bits`` per component, in the order of the spectrum).

    Components are sorted by bits, then by variance (so that equal widths form one band even
    when an allocation is not monotone in the variances); those allocated 0 bits are dropped
    (they decode as the mean). ``analysis = U^T L^T`` and ``synthesis = U^T L^-1`` (rows), so that
    ``x = mean + sum_j <x - mean, analysis_j> synthesis_j`` at full rank.

    InvalidParameterError for a ``bits_per_element`` outside ``[0, 64]``, a
    ``max_bits`` outside ``0..8`` (TypeError where it is not an int), ``bits`` that are not one
    integer ``>= 0`` per component; InvalidInputError when the variances are all zero (or the
    target leaves no bits: InvalidParameterError).
    """
    d = len(sp.mean)
    lam, u = sp.variances, sp.vectors
    check_target(bits_per_element)
    _checks.integer(max_bits, "max_bits", 0, len(LLOYD_MAX_MSE) - 1)
    if bits is not None:
        given = np.asarray(bits)
        if given.dtype.kind not in "iu":
            raise TypeError(f"bits must be integers, got dtype {given.dtype}")
        if given.shape != (len(lam),):
            raise InvalidParameterError(
                f"bits must hold one integer per component, shape ({len(lam)},), got {list(given.shape)}")
        if given.size and given.min() < 0:
            raise InvalidParameterError(f"bits must be >= 0, got {int(given.min())}")
    w = None if sp.whitening is None else np.asarray(sp.whitening, dtype=np.float64)
    allocated = bits is None
    if bits is None:
        bits = allocate_bits(lam, row_budget(bits_per_element, d, norm), max_bits,
                             floor=min_bits, max_components=max_components,
                             component_cost=component_cost)
    bits = np.asarray(bits, dtype=np.int64)
    keep = np.flatnonzero(bits > 0)
    if keep.size == 0 and allocated and not np.any(np.asarray(lam) > 0):
        raise InvalidInputError(
            f"all {len(lam)} variances are zero (or negative, clamped to zero): there is nothing "
            "to give bits to")
    if keep.size == 0:
        raise InvalidParameterError(
            f"{bits_per_element} bits per element leave no bits for the components at D = {d}")
    keep = keep[np.argsort(-bits[keep], kind="stable")]
    ut = u[:, keep].T
    analysis = ut if w is None else ut @ w.T
    synthesis = _synthesis(ut.T, w)
    floor = max(float(lam[0]), 1e-30) * 1e-12
    return StreamFit(mean=np.asarray(sp.mean, dtype=np.float64), analysis=analysis,
                     synthesis=synthesis, spread=np.sqrt(np.maximum(lam[keep], floor)),
                     bits=bits[keep], variances=lam, whitening=sp.whitening)


def fit_stream(mean: np.ndarray, cov: np.ndarray, bits_per_element: float, *,
               whitening: Optional[np.ndarray] = None, norm: bool = True,
               max_bits: int = 8, bits: Optional[np.ndarray] = None) -> StreamFit:
    """PCA of ``cov`` in the whitened space (``x -> x L``), water-filled to the target (or
    given ``bits`` per component, in the order of :func:`spectrum`): :func:`fit_spectrum` of
    the spectrum of ``(mean, cov)``. InvalidInputError when ``mean`` is not a finite vector of
    the length of ``cov`` (see :func:`spectrum` and :func:`fit_spectrum` for the rest)."""
    m = np.asarray(mean)
    if m.dtype.kind not in "fiu":
        raise TypeError(f"mean must be numeric, got dtype {m.dtype}")
    c = np.asarray(cov)
    if m.ndim != 1 or c.ndim != 2 or c.shape != (len(m), len(m)):
        raise InvalidInputError(
            f"mean has shape {list(m.shape)} but cov {list(c.shape)}: they must be [D] and [D, D]")
    if not np.all(np.isfinite(m)):
        raise InvalidInputError("mean holds NaN or inf")
    lam, u = spectrum(cov, whitening)
    return fit_spectrum(HeadSpectrum(mean, lam, u, whitening), bits_per_element, norm=norm,
                        max_bits=max_bits, bits=bits)


def stream_inputs(stats: AttentionStats, stream: str, layer: int, head: int,
                  settings: CalibratedStream, sensitivity: Optional[Sensitivity] = None
                  ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """(mean, covariance, whitening factor) of one (stream, layer, kv-head) for the settings.
    TypeError for arguments of the wrong type, InvalidParameterError for a stream other than
    ``'k'``/``'v'`` or a layer (row of the statistics) or kv-head out of range."""
    check_types(stats, sensitivity)
    if not isinstance(settings, CalibratedStream):
        raise TypeError(f"settings must be a CalibratedStream, got {type(settings).__name__}")
    _checks.choice(stream, "stream", ("k", "v"))
    _checks.integer(layer, "layer", 0, stats.num_layers - 1)
    _checks.integer(head, "head", 0, stats.kv_heads - 1)
    if stream == "k":
        mean, cov = stats.k_mean[layer, head], stats.k_cov[layer, head]
    else:
        mean, cov = stats.v_mean[layer, head], stats.v_cov[layer, head]
    if not settings.center:
        cov = cov + np.outer(mean, mean)  # the second moment about zero
        mean = np.zeros_like(mean)
    w = None
    if settings.whiten == "query":
        w = whitening_factor(stats.q2[layer, head])
    elif settings.whiten == "output":
        w = whitening_factor(stats.o_gram[layer, head])
    elif settings.whiten == "fisher":
        if sensitivity is None:
            raise InvalidParameterError("whiten = 'fisher' needs the model's sensitivity")
        w = whitening_factor(sensitivity.of(stream)[layer, head])
    return mean, cov, w


def head_spectrum(stats: AttentionStats, stream: str, layer: int, head: int,
                  settings: CalibratedStream, sensitivity: Optional[Sensitivity] = None
                  ) -> HeadSpectrum:
    """The :class:`HeadSpectrum` of one (stream, layer, kv-head). Raises NumericalError naming
    the head when its statistics are not positive definite where they must be."""
    try:
        mean, cov, w = stream_inputs(stats, stream, layer, head, settings, sensitivity)
        lam, u = spectrum(cov, w)
    except (np.linalg.LinAlgError, NumericalError) as e:
        raise NumericalError(
            f"stream {stream!r}, layer {layer}, kv-head {head}: the statistics behind "
            f"whiten = {settings.whiten!r} cannot be factored ({e})") from e
    except InvalidInputError as e:
        raise InvalidInputError(f"stream {stream!r}, layer {layer}, kv-head {head}: {e}") from e
    return HeadSpectrum(mean, lam, u, w)


def shrink_fisher(fisher: np.ndarray, amount: float, prior: Optional[np.ndarray] = None
                  ) -> np.ndarray:
    """``(1 - amount) F + amount P`` for one head's sensitivity ``F [D, D]``: ``P`` is ``prior``
    scaled to the trace of ``F`` (None: ``tr(F) / D I``), so the head keeps its weight against
    the others while its shape moves toward the calibration-free prior."""
    f = np.asarray(fisher, dtype=np.float64)
    if amount == 0.0:
        return f
    d = f.shape[-1]
    tr = float(np.trace(f))
    if prior is None:
        p = np.eye(d) * (tr / d)
    else:
        p = np.asarray(prior, dtype=np.float64)
        p = (p + p.T) / 2 * (tr / max(float(np.trace(p)), 1e-300))
    return (1.0 - amount) * f + amount * p


def shrunk_sensitivity(sensitivity: Sensitivity, stats: AttentionStats,
                       settings: Mapping[str, CalibratedStream]) -> Sensitivity:
    """The sensitivity with each stream's ``fisher_shrink`` toward its ``fisher_prior`` applied
    per (layer, kv-head) (:func:`shrink_fisher`); the same object when no stream shrinks."""
    if not any(st.fisher_shrink > 0 for st in settings.values()):
        return sensitivity
    out = {"k": sensitivity.k.copy(), "v": sensitivity.v.copy()}
    for s, st in settings.items():
        if st.fisher_shrink <= 0:
            continue
        f = out[s]
        proxy = stats.q2 if s == "k" else stats.o_gram
        for layer in range(f.shape[0]):
            for h in range(f.shape[1]):
                prior = proxy[layer, h] if st.fisher_prior == "proxy" else None
                f[layer, h] = shrink_fisher(f[layer, h], st.fisher_shrink, prior)
    meta = dict(sensitivity.meta)
    meta["shrink"] = {s: [st.fisher_shrink, st.fisher_prior] for s, st in settings.items()}
    return Sensitivity(meta=meta, k=out["k"], v=out["v"])


def sensitivity_weights(synthesis: np.ndarray, fisher: np.ndarray) -> np.ndarray:
    """``w_j = s_j^T F s_j`` for synthesis rows ``s_j``: the loss per unit of squared error in
    component ``j`` (an error ``e`` in the coefficients is ``e @ synthesis`` in the row)."""
    s = np.asarray(synthesis, dtype=np.float64)
    if s.ndim != 2:
        raise InvalidInputError(f"synthesis must be [m, D], got shape {list(s.shape)}")
    square(fisher, "fisher", s.shape[1])
    return np.maximum(np.einsum("ja,ab,jb->j", s, np.asarray(fisher, dtype=np.float64), s), 0.0)


def weighted_variances(sp: HeadSpectrum, fisher: np.ndarray) -> np.ndarray:
    """The variances of a head's components, each times its :func:`sensitivity_weights`: what
    an error in it costs the model's loss, comparable across layers, heads and streams."""
    return sp.variances * sensitivity_weights(sp.synthesis(), fisher)


def weighted_spectrum(stats: AttentionStats, sensitivity: Sensitivity, stream: str, layer: int,
                      head: int, settings: CalibratedStream) -> np.ndarray:
    """:func:`weighted_variances` of one (stream, layer, kv-head)."""
    sp = head_spectrum(stats, stream, layer, head, settings, sensitivity)
    return weighted_variances(sp, sensitivity.of(stream)[layer, head])


def fit_codec(sp: HeadSpectrum, settings: CalibratedStream,
              centroids: Optional[Mapping[int, np.ndarray]] = None,
              bits: Optional[np.ndarray] = None) -> CalibratedCodec:
    """The calibrated codec of one head from its spectrum, for the recipe settings of its
    stream, with optional custom Lloyd-Max tables by bit width and an optional given
    allocation (bits per component in the order of the spectrum)."""
    fit = fit_spectrum(sp, settings.bits, norm=settings.norm, max_bits=settings.max_bits,
                       bits=bits, min_bits=settings.min_bits,
                       max_components=settings.max_components,
                       component_cost=settings.component_cost)
    widths = set(int(b) for b in fit.bits)
    tables = {b: t for b, t in (centroids or {}).items() if b in widths} or None
    return fit.codec(rotation_seed=settings.rotation_seed, metric=settings.metric,
                     norm=settings.norm, outlier_threshold=settings.outlier_threshold,
                     centroids=tables)


def fit_tables(codecs: Mapping[Tuple[int, int], CalibratedCodec], samples: np.ndarray,
               min_samples: int = 64) -> Dict[int, np.ndarray]:
    """Lloyd-Max tables by bit width, fitted on the codec's own scaled coordinates ``z`` of the
    calibration sample rows (``samples [L, H, S, D]``), pooled over every (layer, kv-head) of
    the stream. Widths with fewer than ``min_samples * 2**b`` values keep the N(0, 1) table."""
    pooled: Dict[int, List[np.ndarray]] = {}
    for (layer, head), c in codecs.items():
        rows = np.ascontiguousarray(samples[layer, head], dtype=np.float32)
        if len(rows) == 0:
            continue
        z = c.encode_parts(rows)["z"]
        for off, width, b in c.bands:
            pooled.setdefault(int(b), []).append(z[:, off:off + width].ravel())
    out = {}
    for b, parts in pooled.items():
        z = np.concatenate(parts)
        if z.size >= min_samples * 2 ** b:
            out[b] = lloyd_max(z, b)
    return out
