"""Files written whole or not at all: :func:`write_atomically`, the one writer of the
calibration files, the cached statistics, saved caches and evaluation results; and a file's
SHA-256 read once per process and version of the file (:func:`sha256_of`)."""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

from .errors import InvalidParameterError


def write_atomically(files: Sequence[Tuple[Path, Callable[[Path], Any]]], what: str = "file") -> None:
    """Writes each ``(path, write)``: ``write(temp)`` fills a new file beside ``path`` (a name of
    its own ending in the same suffix, created exclusively, so no other file is touched; its mode
    as the umask gives any new file), and once all are written they are renamed into place in the
    order given; on any failure or interrupt the temporary files are removed and the old files
    stay.
    InvalidParameterError naming ``what`` when a path is a directory, exists but is not a regular
    file (a device, pipe or socket: the rename would replace it, so that a save to /dev/null run
    as root replaced the device by a file), is no name the system takes (a NUL, too long), or
    its folder cannot be made or written in."""
    paths = [Path(p) for p, _ in files]
    for p in paths:
        shown = str(p)[:200]
        if "\0" in str(p):
            raise InvalidParameterError(f"cannot write {what} to {shown!r}: the name holds a NUL character")
        try:
            kind = os.stat(p).st_mode  # a link's target: the rename replaces the link, not it
        except (FileNotFoundError, NotADirectoryError):  # new, or under a file (the folder's error below)
            kind = None
        except OSError as e:  # a name too long, a folder not searchable, a link loop
            raise InvalidParameterError(f"cannot write {what} to {shown!r}: {e.strerror or e}") from None
        if kind is not None and stat.S_ISDIR(kind):
            raise InvalidParameterError(f"cannot write {what} to {shown!r}: it is a directory; name a file")
        if kind is not None and not stat.S_ISREG(kind):
            raise InvalidParameterError(f"cannot write {what} to {shown!r}: it is not a regular file "
                                        "(a device, pipe or socket), which the write would replace")
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidParameterError(f"cannot make the folder of {what} {shown!r}: {e.strerror or e}") from None
    mode = 0o666 & ~_umask()
    temps: List[Path] = []
    try:
        for p, (_, write) in zip(paths, files):
            t = p.with_name(f".{p.stem}.{secrets.token_hex(6)}.tmp{p.suffix}")  # suffix kept: writers read it
            try:
                open(t, "xb").close()
            except OSError as e:
                raise InvalidParameterError(f"cannot write {what} in {str(p.parent)!r}: {e.strerror or e}") from None
            temps.append(t)
            write(t)
            os.chmod(t, mode)  # as open() makes a file (some writers, safetensors, make it 0600)
        for p, t in zip(paths, temps):
            os.replace(t, p)
    except BaseException:
        for t in temps:
            try:
                t.unlink()
            except FileNotFoundError:
                pass
        raise


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``os.umask`` can only
    set it, which would race with other threads making files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


#: Digests this process took: (resolved path, inode, size, modification time in ns) -> SHA-256.
_SHA256: Dict[Tuple[str, int, int, int], str] = {}


def _version(p: Path, st: os.stat_result) -> Tuple[str, int, int, int]:
    return str(p.resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def sha256_of(p: Path) -> str:
    """The hex SHA-256 of the file ``p``, read once per process while its inode, size and
    modification time stay (OSError where it cannot be read)."""
    key = _version(p, p.stat())
    if key not in _SHA256:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _SHA256[key] = h.hexdigest()
    return _SHA256[key]


def know_sha256(p: Path, st: os.stat_result, digest: str) -> None:
    """Records ``digest`` as the SHA-256 of ``p`` in the version ``st`` describes (a file this
    process just wrote and hashed as it wrote it; a rename keeps the inode and the times)."""
    _SHA256[_version(p, st)] = digest
