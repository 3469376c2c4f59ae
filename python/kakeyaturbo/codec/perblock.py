"""The per-block mode: a layer tensor cut into blocks, each with its own PCA, k-means and codes.

Every function checks its arguments (`_checks`, the names against :data:`DEFAULTS`) and makes
one call into the Rust core (`kakeyaturbo._core`), which releases the GIL.
"""

from __future__ import annotations

import difflib
import json
import os
import stat
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from .. import _core
from ..errors import InvalidParameterError
from . import _checks

#: Every codec keyword argument and its default. The one table the names are checked against.
DEFAULTS: Dict[str, Any] = {
    "metric": "mse",
    "block_size": 512,
    "bit_width": 3,
    "variance_ratio": 0.95,
    "k": 16,
    "rotation_seed": 0xCAFEBABE,
    "kmeans_max_iter": 32,
    "pca_method": "exact",
    "rsvd_target_rank": None,
    "rsvd_oversample": 8,
    "rsvd_power_iters": 2,
    "skeleton_dtype": "fp16",
    "rank_cap": None,
    "exact_rank_cap": None,
    "centroids": None,
    "centroids_file": None,
    "outlier_threshold": None,
    "share_basis": False,
}

#: Keyword arguments that are not codec parameters.
_EXTRA = ("weights", "threads")


def params(fn: Optional[str], kwargs: Mapping[str, Any],
           allowed_extra: Tuple[str, ...] = _EXTRA) -> Dict[str, Any]:
    """Every codec parameter of a call to ``fn`` (None: not a call, e.g. a recipe table), with
    defaults filled in, aliases resolved, a ``centroids_file`` read. Unknown names raise
    ``TypeError`` with the closest valid one; values are checked by the core when it parses
    them (:func:`check_params` does it now)."""
    unknown = [k for k in kwargs if k not in DEFAULTS and k not in allowed_extra]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(DEFAULTS) + list(allowed_extra), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        if fn is None:
            raise TypeError(f"unknown parameter {name!r}{hint}")
        raise TypeError(f"{fn}() got an unexpected keyword argument {name!r}{hint}")
    p = {k: kwargs.get(k, v) for k, v in DEFAULTS.items()}
    rc, erc = p.pop("rank_cap"), p.pop("exact_rank_cap")
    if rc is not None and erc is not None and rc != erc:
        raise InvalidParameterError(
            f"rank_cap={rc} and its alias exact_rank_cap={erc} disagree"
        )
    p["rank_cap"] = rc if rc is not None else erc
    path = p.pop("centroids_file")
    if path is not None:
        if p["centroids"] is not None:
            raise InvalidParameterError("give centroids or centroids_file, not both")
        p["centroids"] = load_centroids(path)
    if p["centroids"] is not None:
        c = np.asarray(p["centroids"])
        if c.dtype.kind not in "fiu":
            raise TypeError(f"centroids must be numbers, got dtype {c.dtype}")
        if c.ndim != 1:
            raise InvalidParameterError(f"centroids must be 1-D, got shape {c.shape}")
        p["centroids"] = [float(v) for v in c.astype(np.float64)]
    return p


def check_params(kwargs: Dict[str, Any], fn: Optional[str] = "check_params") -> Dict[str, Any]:
    """Checks codec keyword arguments without coding anything, exactly as :func:`encode_layer`
    would (names here, types and ranges in the core); returns them with the defaults filled in.
    Raises TypeError or InvalidParameterError."""
    p = params(fn, _checks.mapping(kwargs, "kwargs"), allowed_extra=())
    _core.check_params(p)
    return p


#: The most centroids a table holds (:data:`_checks.MAX_CENTROIDS`).
MAX_CENTROIDS = _checks.MAX_CENTROIDS

#: The most bytes of a JSON centroid table read: 256 numbers are a few KB, so a larger file
#: (or a device such as /dev/zero) is not a table and is refused before it fills the memory.
MAX_CENTROIDS_JSON = 1 << 20


def load_centroids(path: "os.PathLike[str] | str") -> np.ndarray:
    """Reads a centroid table: a ``.npy`` array, or JSON (a list, or an object whose
    ``"centroids"`` entry is a list of at most :data:`MAX_CENTROIDS_JSON` bytes). A file
    that is not a regular one (a device, a FIFO: unbounded, or never ending) is refused."""
    path = os.fspath(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise InvalidParameterError(f"centroids_file {path!r} is not a regular file")
        if path.endswith(".npy"):
            # Mapped, not read: a header that claims more than the file holds is refused
            # (ValueError) before anything is allocated, and the size checked before the copy.
            table = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            with open(path, "rb") as f:
                raw = f.read(MAX_CENTROIDS_JSON + 1)  # bounded: the file may grow after the stat
            if len(raw) > MAX_CENTROIDS_JSON:
                raise InvalidParameterError(f"centroids_file {path!r} is larger than {MAX_CENTROIDS_JSON} "
                                            f"bytes: not a table of at most {MAX_CENTROIDS} centroids")
            data = json.loads(raw.decode("utf-8"))
            if isinstance(data, dict):
                data = data.get("centroids")
            table = np.asarray(data, dtype=np.float64)
    except InvalidParameterError:  # a ValueError, already naming the file
        raise
    except (OSError, ValueError, RecursionError) as e:  # JSON nested past the recursion limit
        raise InvalidParameterError(f"cannot read centroids_file {path!r}: {e}") from e
    if table.ndim != 1 or not 0 < table.size <= MAX_CENTROIDS:
        raise InvalidParameterError(f"centroids_file {path!r} does not hold a 1-D table of 1 to "
                                    f"{MAX_CENTROIDS} centroids (shape {table.shape})")
    try:
        return np.array(table, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise InvalidParameterError(f"centroids_file {path!r} does not hold numbers: {e}") from e


def roundtrip_layer(array: np.ndarray, **kwargs: Any) -> Tuple[np.ndarray, Dict[str, Any]]:
    """Encodes and decodes a layer tensor; returns ``(decoded, report)``.

    ``array``: float32 ``[N, D]``. Returns a float32 ``[N, D]`` array (every row, the tail
    included) and a report dict (see the README's API table).
    Raises TypeError (wrong dtype, unknown keyword), InvalidInputError, InvalidParameterError.
    """
    p = params("roundtrip_layer", kwargs)
    x = _checks.matrix(array)
    return _core.roundtrip_layer(
        x, p, _checks.weights(kwargs.get("weights"), x.shape[0]), _checks.threads(kwargs.get("threads"))
    )


def encode_layer(array: np.ndarray, **kwargs: Any) -> bytes:
    """Encodes a float32 ``[N, D]`` tensor into a self-describing container (bytes)."""
    p = params("encode_layer", kwargs)
    x = _checks.matrix(array)
    return _core.encode_layer(
        x, p, _checks.weights(kwargs.get("weights"), x.shape[0]), _checks.threads(kwargs.get("threads"))
    )


def decode_layer(data: Any, *, threads: Optional[int] = None) -> np.ndarray:
    """Decodes a container into float32 ``[N, D]``. Raises CorruptDataError (truncated or
    corrupted bytes) or UnsupportedVersionError (a newer format)."""
    return _core.decode_layer(_checks.buffer(data), _checks.threads(threads))


def encode_blocks(array: np.ndarray, block_rows: int, **kwargs: Any) -> "list[list[bytes]]":
    """Row set ``g`` of float32 ``array [G, T, D]`` in blocks of ``block_rows`` rows (``T`` a
    multiple, InvalidInputError otherwise), every block coded with the keyword parameters of
    :func:`encode_layer` (``threads`` included, no ``weights``): the containers ``[block][g]``,
    each the bytes :func:`encode_layer` gives that block, every encode of the call spread over
    the threads as :func:`decode_blocks` spreads its decodes."""
    p = params("encode_blocks", kwargs)
    if "weights" in kwargs:
        raise TypeError("encode_blocks() takes no weights")
    x, block_rows = _checks.row_sets(array, block_rows)
    return _core.encode_layer_blocks(x, block_rows, p, _checks.threads(kwargs.get("threads")))


def decode_blocks(blobs: Sequence[Sequence[Any]], block_rows: int, *, threads: Optional[int] = None) -> np.ndarray:
    """The containers ``blobs[block][g]`` (each of ``block_rows`` rows, all of one width)
    decoded: float32 ``[G, blocks * block_rows, D]``, the blocks of row set ``g`` in order, each
    as :func:`decode_layer` gives it, every decode of the call spread over ``threads`` threads
    (the host's OpenMP team where it has one, torch's). Raises CorruptDataError or
    UnsupportedVersionError as :func:`decode_layer`, InvalidInputError for no container, a block
    of another count of containers, a container of another row count or of another width."""
    rows = [[_checks.buffer(b) for b in row] for row in blobs]
    block_rows = _checks.rows(block_rows, "block_rows", 1)
    return _core.decode_layer_blocks(rows, block_rows, _checks.threads(threads))


def decode_blocks_into(blobs: Sequence[Sequence[Any]], block_rows: int, out: np.ndarray, at: int, *,
                       threads: Optional[int] = None) -> None:
    """:func:`decode_blocks` into rows ``at ..`` of each row set of ``out``, a C-contiguous
    writeable float32 ``[G, rows, D]`` array (the rest of it left as it is): the same values,
    without an array of their own. Refused as :func:`decode_blocks` refuses, and
    InvalidInputError for an ``out`` of another shape, dtype or layout or one the blocks do not
    fit, before anything is written."""
    rows = [[_checks.buffer(b) for b in row] for row in blobs]
    block_rows = _checks.rows(block_rows, "block_rows", 1)
    at = _checks.rows(at, "at")
    _core.decode_layer_blocks_into(rows, block_rows, _checks.out_rows(out), at, _checks.threads(threads))


def inspect_layer(data: Any) -> Dict[str, Any]:
    """Parameters, shape and byte breakdown of a container, without decoding it."""
    return _core.inspect_layer(_checks.buffer(data))


def encode_block_codes(array: np.ndarray, **kwargs: Any) -> Dict[str, Any]:
    """Encodes ``array`` (float32 ``[n, D]``) as ONE block and returns its named parts.

    Skeleton: ``mean [D]``, ``basis [d_eff, D]``, ``centers [k, d_eff]`` (the stored, rounded
    values), ``d_eff``, ``k``, ``bands``, ``wht_len``. Codes: ``seg_id [n] int32``, ``t``/``norm``
    ``[n] float32`` (stored values) with their fp16 ``*_bits`` and shared ``*_exp``,
    ``residual_packed`` (bytes), ``residual_codes [n, d_eff] uint8``, ``outlier_pos [m] int64``
    (flat ``row * d_eff + col``), ``outlier_val [m] float32``, ``outlier_bits [m] uint16``.
    ``block_size`` and ``share_basis`` do not apply to a single block and are ignored.
    """
    p = params("encode_block_codes", kwargs, allowed_extra=("weights",))
    x = _checks.matrix(array)
    return _core.encode_block_codes(x, p, _checks.weights(kwargs.get("weights"), x.shape[0]))


def decode_block_from_parts(parts: Dict[str, Any]) -> np.ndarray:
    """Decodes the parts dict of :func:`encode_block_codes` into float32 ``[n, D]``."""
    return _core.decode_block_from_parts(dict(_checks.mapping(parts, "parts")))
