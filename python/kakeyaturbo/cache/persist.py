"""A compressed prefix on disk: a filled :class:`~kakeyaturbo.cache.KakeyaCache` saved to ONE
file and loaded in another process to continue generation without recomputing the prefix.

The file holds what the cache holds, as it holds it: the sealed blocks' blobs byte for byte (no
re-coding), the raw sink and staging rows at their dtype, and the RoPE positions of the tokens
where they are not ``0 .. T-1`` (left-padded batches; with multimodal RoPE each token's three,
a version-2 file) and what a layer holds beyond its rows (a hybrid's recurrent and
convolution states, an indexer's keys, a compressed layer's window and compressor state, raw:
:mod:`.persist_state`, a version-3 file), and where a left-padded batch's rows keep their first
real tokens as their sinks, where those lie (``sink_at``, a version-4 file); plus what
rebuilds the cache (its settings, the recipe, the model's layers) and who it belongs to: the
model (type, fingerprint of the attention weights) and the codec (a fingerprint of everything
that decides its bytes).
Loading refuses another model or another codec with ModelMismatchError, a damaged file with
CorruptDataError naming it, a newer version with UnsupportedVersionError.

Layout (FORMAT.md, "Saved prefix files"; all integers little-endian):

| field | type | notes |
|---|---|---|
| magic | 4 bytes | ``KKYP`` |
| version | u16 | 5 with longrope's long-factor tokens (``long_rope``), else 4 with a left-padded batch's sinks (``sink_at``), else 3 with layer states, else 2 with multimodal positions, else 1 |
| flags | u16 | 0 (reserved for a lossless stage; none is applied, see docs/prefix.md) |
| header length ``h`` | u32 | |
| header | ``h`` bytes | UTF-8 JSON: settings, owners, and per layer and stream the counts of the sections below |
| sections | | per layer, per stream (``k`` then ``v``): sink rows, staging rows (raw, ``[B, H, n, D]``), blob lengths (u32 per blob, block-major, then batch row, then kv-head), the blobs; the layer's states; then positions (int32 ``[B, T]``) when stored, then multimodal ones (int32 ``[3, B, T]``) |
| crc32 | u32 | of every preceding byte |

So a file's size is the cache's held bytes (:meth:`KakeyaCache.nbytes`, without the decoded
blocks of ``keep_decoded`` and without positions that are ``0 .. T-1``) plus ``16 + h + 4 *
blobs`` bytes (:func:`overhead`).
"""

from __future__ import annotations

import json
import os
import struct
import weakref
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from .._core import __version__
from .._files import write_atomically
from ..calibration import ModelCodec
from ..calibration.bundle import fingerprint
from ..calibration.stats import require_file
from ..codec import _checks
from ..errors import CorruptDataError, InvalidParameterError, KakeyaError, ModelMismatchError, UnsupportedVersionError
from ..families import describe
from .codecs import STREAMS, StreamCodec, check_codec
from .compressed import rows_of
from .layer import KakeyaLayer
from . import persist_state
from .persist_codec import codec_from_file, codec_identity, recipe_json

__all__ = ["MAGIC", "VERSION", "save", "load", "codec_identity", "overhead", "read_header"]

MAGIC = b"KKYP"
#: The newest version this build writes and reads: 5 for files recording which tokens a
#: ``longrope`` model rotated by its long factors (``long_rope``), 4 for files whose sinks hold a
#: left-padded batch's first real tokens (``sink_at``, :mod:`.padding`), 3 for files holding layer states (a
#: hybrid's recurrent and convolution states, an indexer's keys, DeepSeek V4's compressor state:
#: :mod:`.persist_state`), 2 for files
#: holding multimodal RoPE positions (``grid``) and no states, which a build reading an older
#: version must not load; 1 otherwise.
VERSION = 5
_SINKS_VERSION = 4
_HEAD = struct.Struct("<4sHHI")  # magic, version, flags, header length
_CRC = 4
#: Raw row dtypes a file may hold.
DTYPES = persist_state.ROW_DTYPES
#: Limits checked before anything is allocated (far beyond any real cache).
_MAX_HEADER = 64 << 20
_MAX_DIM = 1 << 16
_MAX_TOKENS = 1 << 31

PathLike = Union[str, "os.PathLike[str]"]


# --- writing ---------------------------------------------------------------------------------


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def _default_positions(pos: torch.Tensor) -> bool:
    want = torch.arange(pos.shape[1], dtype=pos.dtype)[None].expand_as(pos)
    return bool(torch.equal(pos, want))


def save(cache: Any, path: PathLike, model: Any = None) -> Path:
    """Writes ``cache`` (a filled :class:`KakeyaCache`) to ``path`` (see the module doc) and
    returns the path; the file is written beside it and renamed, so a reader never sees half a
    file. ``model``: the model that filled the cache (default: the one it was built with),
    whose type and fingerprint of the attention weights are recorded.

    Raises InvalidParameterError when the cache was built without a model and none is given,
    or its codec cannot be identified (:func:`codec_identity`)."""

    if model is None:
        ref = getattr(cache, "_model_ref", None)
        model = ref() if ref is not None else None
    if model is None:
        raise InvalidParameterError("save needs the model that filled the cache: cache.save(path, model=model)")
    p = Path(path)
    layout = describe(model)
    header: Dict[str, Any] = {
        "library": f"kakeyaturbo {__version__}",
        "model": {"type": layout.model_type, "fingerprint": fingerprint(model),
                  "layers": layout.num_layers, "windows": [s.window for s in layout.layers]},
        "codec": codec_identity(cache.codec),
        "recipe": recipe_json(getattr(cache.codec, "recipe", None)),
        "cache": {"block_size": cache.block_size, "n_sink": cache.n_sink,
                  "boundary": sorted(cache.boundary), "streams": list(cache.streams)},
    }
    if len(cache.layers) != layout.num_layers:
        raise InvalidParameterError(f"the cache has {len(cache.layers)} layers, the model {layout.num_layers}")
    if cache.draft_pending:
        raise InvalidParameterError("cannot save a cache while it checks a draft (assisted decoding): "
                                    "save it once generate has returned")
    cache.end_past_recording()  # the file does not record it: the saved cache goes on as the loaded one
    chunks: List[bytes] = []
    layers = []
    dtype = batch = None
    states = padded = False
    for layer in cache.layers:
        tensors, flags, counts = persist_state.layer_state(layer)
        held = {"state": [{"name": n, "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
                          for n, t in tensors], "flags": flags, "counts": counts} if tensors or flags else {}
        states = states or bool(held)
        rows = rows_of(layer)
        if not isinstance(rows, KakeyaLayer):  # caches no K/V rows (a state layer, transformers' DummyLayer)
            layers.append({"seen": 0, "streams": {}, **held})
            chunks += [_raw_bytes(t) for _, t in tensors]
            continue
        state = rows.export_state()
        entry: Dict[str, Any] = {"seen": int(state["seen"]), "streams": {}}
        for name, part in state["streams"].items():
            sink, staging = part["sink"], part["staging"]
            b, h, _, d = staging.shape
            dt = str(staging.dtype).replace("torch.", "")
            if dt not in DTYPES:
                raise InvalidParameterError(f"cannot save raw rows of dtype {dt}; known: {list(DTYPES)}")
            if (dtype, batch) != (None, None) and (dt, b) != (dtype, batch):
                raise InvalidParameterError(f"layers disagree on dtype or batch ({dtype}, {batch}) vs ({dt}, {b})")
            dtype, batch = dt, b
            blobs = [blob for blk in part["blocks"] for row in blk for blob in row]
            entry["streams"][name] = {
                "heads": h, "dim": d, "sink_start": int(part["sink_start"]),
                "sink": int(sink.shape[-2]), "staging_start": int(part["staging_start"]),
                "staging": int(staging.shape[-2]),
                "first_block": int(part["starts"][0]) if part["starts"] else 0,
                "blocks": len(part["blocks"]),
            }
            if part.get("sink_at") is not None:  # a left-padded batch's sinks (a version-4 file)
                entry["streams"][name]["sink_at"] = [int(x) for x in part["sink_at"]]
                padded = True
            chunks += [_raw_bytes(sink), _raw_bytes(staging),
                       np.asarray([len(x) for x in blobs], dtype="<u4").tobytes()] + blobs
        layers.append(dict(entry, **held))
        chunks += [_raw_bytes(t) for _, t in tensors]
    positions = getattr(cache, "_positions", None)
    pos = positions.pos if positions is not None else None
    grid = positions.grid if positions is not None else None
    header["positions"] = 0
    if pos is not None and (grid is not None or not _default_positions(pos)):
        header["positions"] = int(pos.shape[1])
        chunks.append(pos.to(torch.int32).contiguous().numpy().astype("<i4").tobytes())
    if grid is not None:  # multimodal RoPE: every token's three positions (a version-2 file)
        header["grid"] = int(grid.shape[2])
        chunks.append(grid.to(torch.int32).contiguous().numpy().astype("<i4").tobytes())
    if positions is not None and positions.long_runs():  # longrope's long factors (a version-5 file)
        header["long_rope"] = positions.long_runs()
    header.update(dtype=dtype or "float32", batch=batch or 0, layers=layers)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()

    def write(t: Path) -> None:
        crc = 0
        with open(t, "wb") as f:
            version = (VERSION if "long_rope" in header else _SINKS_VERSION if padded else
                       persist_state.VERSION if states else 2 if grid is not None else 1)
            for c in [_HEAD.pack(MAGIC, version, 0, len(head)), head] + chunks:
                crc = zlib.crc32(c, crc)
                f.write(c)
            f.write(struct.pack("<I", crc))

    write_atomically([(p, write)], "a prefix")
    return p


def overhead(path: PathLike) -> int:
    """Bytes of a saved file that are not the cache's held bytes: ``16 + header + 4 * blobs``."""
    header, _ = read_header(path)
    blobs = sum(s["blocks"] * header["batch"] * s["heads"]
                for layer in header["layers"] for s in layer["streams"].values())
    return _HEAD.size + header["_header_bytes"] + 4 * blobs + _CRC


# --- reading ---------------------------------------------------------------------------------


class _Reader:
    """The file's bytes after the header; every length is checked against what is left before
    it is read."""

    def __init__(self, data: memoryview, at: int, end: int, where: str) -> None:
        self.data, self.at, self.end, self.where = data, at, end, where

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.end - self.at:
            raise CorruptDataError(f"{self.where} is truncated or inconsistent: {what} needs {n} bytes, "
                                   f"{self.end - self.at} are left")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out


def _read_file(path: PathLike) -> Tuple[Dict[str, Any], memoryview, int, str]:
    p = Path(path)
    where = f"prefix file {str(p)!r}"
    require_file(p, where)
    try:
        data = memoryview(p.read_bytes())
    except OSError as e:  # a read error (EIO), the file gone since
        raise CorruptDataError(f"{where} cannot be read: {e.strerror or e}") from None
    if len(data) < _HEAD.size + _CRC:
        raise CorruptDataError(f"{where} is truncated ({len(data)} bytes)")
    magic, version, flags, hlen = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CorruptDataError(f"{where} is not a kakeyaturbo prefix file (magic {bytes(magic)!r})")
    if version > VERSION:
        raise UnsupportedVersionError(f"{where} is version {version}; this build reads up to {VERSION}")
    if version == 0:
        raise CorruptDataError(f"{where}: version 0 does not exist")
    if flags != 0:
        raise CorruptDataError(f"{where}: unknown flags {flags:#x}")
    (want,) = struct.unpack_from("<I", data, len(data) - _CRC)
    if zlib.crc32(data[:len(data) - _CRC]) != want:
        raise CorruptDataError(f"{where} is damaged: its checksum does not match")
    if hlen > min(_MAX_HEADER, len(data) - _HEAD.size - _CRC):
        raise CorruptDataError(f"{where}: header length {hlen} beyond the file")
    try:
        header = json.loads(bytes(data[_HEAD.size:_HEAD.size + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # nested past the recursion limit
        raise CorruptDataError(f"{where}: its header is not JSON ({e})") from None
    try:
        _check_header(header)
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise CorruptDataError(f"{where}: its header is inconsistent ({e})") from None
    if version < 2 and header.get("grid", 0):
        raise CorruptDataError(f"{where}: version {version} holds no multimodal positions, its header says it does")
    if version < 3 and any(k in layer for layer in header["layers"] for k in ("state", "flags", "counts")):
        raise CorruptDataError(f"{where}: version {version} holds no layer states, its header says it does")
    if version < 4 and any("sink_at" in s for layer in header["layers"] for s in layer["streams"].values()):
        raise CorruptDataError(f"{where}: version {version} holds no padded sinks, its header says it does")
    if version < 5 and "long_rope" in header:
        raise CorruptDataError(f"{where}: version {version} records no longrope factors, its header says it does")
    header["_header_bytes"] = hlen
    return header, data, _HEAD.size + hlen, where


def _int(v: Any, what: str, lo: int = 0, hi: int = _MAX_TOKENS) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{what} = {v!r}, expected an integer in {lo}..{hi}")
    return v


def _check_header(h: Dict[str, Any]) -> None:
    """Types and ranges of every field, and the layer states' own consistency (where the sink,
    blocks and staging lie), so that nothing later can index out of range."""
    if not isinstance(h, dict):
        raise TypeError("the header is not an object")
    for key, typ in (("model", dict), ("codec", dict), ("cache", dict), ("layers", list), ("dtype", str)):
        if not isinstance(h[key], typ):
            raise TypeError(f"{key} is not a {typ.__name__}")
    if h["dtype"] not in DTYPES:
        raise ValueError(f"dtype {h['dtype']!r} unknown")
    batch = _int(h["batch"], "batch", 0, _MAX_DIM)
    _int(h["positions"], "positions")
    if h.get("grid", 0) and _int(h["grid"], "grid") != h["positions"]:
        raise ValueError(f"multimodal positions of {h['grid']} tokens, positions of {h['positions']}")
    if "long_rope" in h:
        runs, end = h["long_rope"], -1
        if not isinstance(runs, list) or not runs or len(runs) > _MAX_DIM:
            raise ValueError(f"long_rope {runs!r:.80}: not a list of runs")
        for run in runs:
            if not isinstance(run, list) or len(run) != 2:
                raise ValueError(f"long_rope run {run!r:.80}: not [start, end]")
            a, b = _int(run[0], "long_rope start"), _int(run[1], "long_rope end")
            if not end < a < b:
                raise ValueError(f"long_rope runs {runs!r:.80} do not follow one another")
            end = b
    c = h["cache"]
    bs = _int(c["block_size"], "block_size", 1)
    n_sink = _int(c["n_sink"], "n_sink")
    nl = _int(h["model"]["layers"], "model layers", 0, _MAX_DIM)
    if len(h["layers"]) != nl or not isinstance(h["model"]["windows"], list) or len(h["model"]["windows"]) != nl:
        raise ValueError(f"{len(h['layers'])} layers and {nl} in the model")
    for w in h["model"]["windows"]:
        if w is not None:
            _int(w, "window", 1)
    if not isinstance(c["streams"], list) or any(s not in STREAMS for s in c["streams"]):
        raise ValueError(f"streams {c['streams']!r}")
    if not isinstance(c["boundary"], list):
        raise TypeError("boundary is not a list")
    for i in c["boundary"]:
        _int(i, "boundary layer", 0, max(nl - 1, 0))
    for key in ("kind", "fingerprint"):
        if not isinstance(h["codec"][key], str):
            raise TypeError(f"codec {key} is not a string")
    for i, layer in enumerate(h["layers"]):
        persist_state.check_header(layer, i, _MAX_DIM, _MAX_TOKENS)
        seen = _int(layer["seen"], f"layer {i} seen")
        streams = layer["streams"]
        if not isinstance(streams, dict) or (streams and set(streams) != set(STREAMS)):
            raise ValueError(f"layer {i} streams {sorted(streams) if isinstance(streams, dict) else streams!r}")
        if not streams and seen:
            raise ValueError(f"layer {i} saw {seen} tokens and holds nothing")
        sealed = streams and i not in c["boundary"]
        for name, s in streams.items():
            at = f"layer {i} {name}"
            _int(s["heads"], f"{at} heads", 1, _MAX_DIM)
            _int(s["dim"], f"{at} dim", 1, _MAX_DIM)
            ss, sn = _int(s["sink_start"], f"{at} sink_start"), _int(s["sink"], f"{at} sink")
            ts, tn = _int(s["staging_start"], f"{at} staging_start"), _int(s["staging"], f"{at} staging")
            fb, nb = _int(s["first_block"], f"{at} first_block"), _int(s["blocks"], f"{at} blocks")
            if ss + sn > n_sink or ts + tn != seen:
                raise ValueError(f"{at}: sink {ss}+{sn} (n_sink {n_sink}) or staging {ts}+{tn} (seen {seen})")
            if nb and (not sealed or name not in c["streams"] or fb + nb * bs != ts or (sn and ss + sn > fb)):
                raise ValueError(f"{at}: {nb} blocks from {fb} of {bs} do not end where staging starts ({ts})")
            if not nb and sn and ss + sn > ts:
                raise ValueError(f"{at}: sink {ss}+{sn} overlaps staging from {ts}")
            if "sink_at" in s:
                sa = s["sink_at"]
                if not isinstance(sa, list) or len(sa) != batch or ss or sn != n_sink or not any(sa):
                    raise ValueError(f"{at}: sink_at {sa!r} for {batch} rows and a sink of {ss}+{sn}")
                for x in sa:
                    _int(x, f"{at} sink_at", 0, seen - sn)
            if nb * batch * s["heads"] > _MAX_TOKENS:
                raise ValueError(f"{at}: too many blobs")


def read_header(path: PathLike) -> Tuple[Dict[str, Any], str]:
    """The header of a saved prefix (checked) and the file's name for messages; raises as
    :func:`load`."""
    header, _, _, where = _read_file(path)
    return header, where


def _tensor(r: _Reader, dtype: torch.dtype, shape: Tuple[int, ...], what: str,
            device: Any) -> torch.Tensor:
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = r.take(n, what)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).to(device)


def _finite(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` (raw rows read back), refused when it holds NaN or an infinity: the codecs refuse
    such rows when they seal them, so a file with one is damaged, and the model would
    otherwise generate from it silently (NaN logits)."""
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise CorruptDataError(f"{where}: its raw rows hold NaN or infinite values")
    return t


def load(path: PathLike, model: Any, codec: Optional[StreamCodec] = None, *,
         calibration: Any = None, threads: Optional[int] = None, keep_decoded: bool = False,
         verify: bool = True) -> Any:
    """A :class:`KakeyaCache` holding the prefix saved at ``path``, for ``model`` to continue
    generating from: ``model.generate(ids, cache=cache)`` with ``ids`` the saved prefix's tokens
    followed by new ones (only the new ones are computed).

    The codec is ``codec`` when given; else rebuilt from the recipe the file records: a per-block
    recipe needs nothing, a calibrated one ``calibration`` (the file ``kakeyaturbo calibrate
    --out`` wrote, or a :class:`~kakeyaturbo.calibration.Calibration`; default: the recipe's
    ``[calibration] path``). ``verify``: decode every blob once now, so that a damaged one is
    refused here (naming the file) and not in the middle of a generation.

    Raises InvalidParameterError when the file does not exist or no codec can be built,
    ModelMismatchError when the file was saved from another model (type, layers,
    sliding windows, fingerprint of the attention weights, dtype) or with another codec (their
    fingerprints differ), CorruptDataError naming the file when it is truncated, damaged or
    inconsistent, UnsupportedVersionError when a newer version wrote it."""
    from .generation import KakeyaCache
    from .pretrained import codec_for_model

    verify = _checks.boolean(verify, "verify")
    if codec is not None:
        check_codec(codec)  # else refused as a codec it "cannot save"
    header, data, at, where = _read_file(path)
    layout = describe(model)
    saved = header["model"]
    if saved.get("type") != layout.model_type:
        raise ModelMismatchError(f"{where} was saved from a {saved.get('type')!r} model, not {layout.model_type!r}")
    windows = [s.window for s in layout.layers]
    if saved["layers"] != layout.num_layers or saved["windows"] != windows:
        raise ModelMismatchError(f"{where} was saved from a model of {saved['layers']} layers (sliding windows "
                                 f"{saved['windows']}); this one has {layout.num_layers} ({windows})")
    fp = fingerprint(model)
    if saved.get("fingerprint") != fp:
        raise ModelMismatchError(f"{where} was saved from another model: fingerprint of the attention weights "
                                 f"{saved.get('fingerprint')} in the file, {fp} for this model")
    _check_layout(header, layout, where)
    p = next(iter(model.parameters()), None)
    mdt = "float32" if p is None else str(p.dtype).replace("torch.", "")
    if header["batch"] and mdt != header["dtype"]:
        raise ModelMismatchError(f"{where} holds {header['dtype']} rows; the model runs in {mdt} "
                                 f"(load it with dtype={header['dtype']})")
    if codec is None:
        codec = codec_from_file(header, where, model, calibration, threads, codec_for_model)
    got = codec_identity(codec)
    want = header["codec"]
    if (got["kind"], got["fingerprint"]) != (want["kind"], want["fingerprint"]):
        hint = ""
        if isinstance(codec, ModelCodec) and codec.path is None and want["kind"] == "calibrated":
            # Fitted here from statistics: the same calibration fits to other bits on another
            # CPU's BLAS kernels (README, "A compressed prefix on disk").
            hint = ("; codecs fitted from a calibration can differ between machines: load the "
                    "prefix with the codec file it was coded with (ModelCodec.save, kakeyaturbo "
                    "calibrate --codec)")
        raise ModelMismatchError(
            f"{where} was coded by another codec: {want['kind']} {want['fingerprint']} in the file, "
            f"{got['kind']} {got['fingerprint']} given ({codec!r}){hint}")
    c = header["cache"]
    cache = KakeyaCache(codec, model=model, block_size=c["block_size"], n_sink=c["n_sink"],
                        boundary=c["boundary"], streams=c["streams"], keep_decoded=keep_decoded)
    if sorted(cache.boundary) != c["boundary"]:
        raise CorruptDataError(f"{where}: boundary layers {c['boundary']} do not fit the model")
    device = p.device if p is not None else "cpu"
    dtype = DTYPES[header["dtype"]]
    b = header["batch"]
    r = _Reader(data, at, len(data) - _CRC, where)
    states = []
    # What the model's own layers hold beyond K/V rows once they hold a token, checked before a
    # byte of it is read.
    held = max((_tokens(layer) for layer in header["layers"]), default=0)
    want = persist_state.expected(model, layout) if held and persist_state.holds_states(layout) else {}
    for i, layer in enumerate(header["layers"]):
        streams: Dict[str, Any] = {}
        for name in STREAMS:
            if name not in layer["streams"]:
                continue
            s = layer["streams"][name]
            h, d, nb = s["heads"], s["dim"], s["blocks"]
            at_ = f"layer {i} {name}"
            sink = _finite(_tensor(r, dtype, (b, h, s["sink"], d), f"{at_} sink rows", device), where)
            staging = _finite(_tensor(r, dtype, (b, h, s["staging"], d), f"{at_} staging rows", device), where)
            lens = np.frombuffer(r.take(4 * nb * b * h, f"{at_} blob lengths"), dtype="<u4")
            flat = [bytes(r.take(int(n), f"{at_} blob")) for n in lens]
            per = b * h
            blocks = [[flat[j * per + bb * h:j * per + (bb + 1) * h] for bb in range(b)] for j in range(nb)]
            streams[name] = {"sink": sink, "sink_start": s["sink_start"], "sink_at": s.get("sink_at"),
                             "staging": staging,
                             "staging_start": s["staging_start"], "blocks": blocks,
                             "starts": [s["first_block"] + j * c["block_size"] for j in range(nb)]}
        entries, flags, counts = layer.get("state", []), layer.get("flags", {}), layer.get("counts", {})
        persist_state.check_states(entries, flags, counts, want.get(i, {}), b, layer["seen"], layout.layers[i], where)
        extra = {e["name"]: _tensor(r, persist_state.DTYPES[e["dtype"]], tuple(e["shape"]), f"layer {i} {e['name']}",
                                    device) for e in entries}
        for t_ in extra.values():
            if t_.is_floating_point():
                _finite(t_, where)
        states.append({"seen": layer["seen"], "streams": streams, "extra": (extra, flags, counts),
                       "tokens": _tokens(layer)})
    t = header["positions"]
    pos = None
    if t:
        pos = _tensor(r, torch.int32, (b, t), "positions", "cpu")
        if pos.numel() and int(pos.min()) < 0:
            raise CorruptDataError(f"{where}: a negative position ({int(pos.min())}) among the RoPE "
                                   "positions it records")
    grid = _tensor(r, torch.int32, (3, b, t), "multimodal positions", "cpu") if header.get("grid", 0) else None
    if grid is not None and (not torch.equal(grid[0], pos) or int(grid.min()) < 0):
        raise CorruptDataError(f"{where}: its multimodal positions are negative or do not begin with the "
                               "positions it records")
    if r.at != r.end:
        raise CorruptDataError(f"{where}: {r.end - r.at} bytes after the last section")
    seen = max((s["tokens"] for s in states), default=0)
    if cache._positions is not None and seen:
        if grid is not None:
            cache._positions.load(grid)
        elif pos is not None:
            cache._positions.pos = pos
        else:
            cache._positions.pos = torch.arange(seen, dtype=torch.int32)[None].expand(b, seen).clone()
        if cache._positions.pos.shape[1] != seen:
            raise CorruptDataError(f"{where}: positions of {t} tokens for a cache of {seen}")
    runs = header.get("long_rope")
    if runs is not None:
        if cache._positions is None or cache._positions.long_after is None or runs[-1][1] > seen:
            raise CorruptDataError(f"{where}: it records tokens rotated by longrope's long factors "
                                   f"({runs[-1][1]} tokens), for a cache of {seen} of a model without them")
        cache._positions.set_long_runs(runs)
    try:
        for i, (layer, state) in enumerate(zip(cache.layers, states)):
            rows = rows_of(layer)
            if not isinstance(rows, KakeyaLayer):
                if state["seen"] or state["streams"]:
                    raise CorruptDataError(f"{where}: layer {i} caches nothing, the file holds rows for it")
                persist_state.restore(layer, *state["extra"], seen)
                continue
            rows.import_state(state)
            persist_state.restore(layer, *state["extra"], seen)
            if verify and not keep_decoded:
                for name in rows.streams if state["streams"] else ():
                    for j in range(len(state["streams"][name]["blocks"])):
                        rows._block(name, j)
    except KakeyaError as e:
        raise CorruptDataError(f"{where}: a sealed block does not decode ({e})") from None
    if model is not None:
        cache._model_ref = weakref.ref(model)
    # The first call must continue the prefix (kakeyaturbo.cache.calls.watch_calls).
    cache._resume = (seen, None if pos is None else pos.max(dim=1).values) if seen else None
    return cache


def _tokens(layer: Dict[str, Any]) -> int:
    """The tokens a layer of the header saw: its rows', a compressed layer's from its counts."""
    return max(layer["seen"], layer.get("counts", {}).get("cumulative_length", 0))


def _check_layout(header: Dict[str, Any], layout: Any, where: str) -> None:
    """CorruptDataError naming the file where a layer's rows, as the header records them, are
    not what the model's layer caches (rows for a layer that caches none; kv-heads, key width
    ``head_dim``, value width ``v_dim``): the file was saved from this model (same fingerprint),
    so its header is damaged."""
    for spec, layer in zip(layout.layers, header["layers"]):
        if layer["streams"] and not (spec.has_kv or spec.is_cross):
            raise CorruptDataError(f"{where} is inconsistent: layer {spec.index} caches nothing in this "
                                   "model, the file holds rows for it")
        for name, s in layer["streams"].items():
            want = (spec.kv_heads, spec.head_dim if name == "k" else (spec.v_dim or spec.head_dim))
            if (s["heads"], s["dim"]) != want:
                raise CorruptDataError(
                    f"{where} is inconsistent: layer {spec.index} {name} rows of (kv-heads, width) = "
                    f"{(s['heads'], s['dim'])} in its header, the model's layer caches {want}")
