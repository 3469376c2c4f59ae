"""The house: imports between the package's modules run one way (no cycle), and a module
imports another inside a function only when that one needs a heavy optional dependency."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, Set, Tuple

PKG = Path(__file__).resolve().parent.parent / "python" / "kakeyaturbo"
#: Optional dependencies a module may import inside a function (kept off the import path of
#: the codec, which needs numpy only).
HEAVY = {"torch", "transformers", "triton", "safetensors", "matplotlib", "tqdm", "tokenizers",
         "optimum", "hqq", "gguf", "accelerate", "threadpoolctl"}


def _name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: Dict[str, Path] = {_name(p): p for p in PKG.rglob("*.py")}
# The compiled extension, described by its stub.
MODULES.update({_name(p): p for p in PKG.rglob("*.pyi") if _name(p) not in MODULES})


def _resolve(mod: str, node: ast.ImportFrom) -> Iterator[str]:
    """Internal modules a ``from ... import ...`` refers to (a submodule where the name is one)."""
    is_pkg = MODULES[mod].name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("kakeyaturbo"):
        return
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        yield sub if sub in MODULES else target


def _imports(mod: str) -> Iterator[Tuple[str, bool]]:
    """(imported top-level name or internal module, inside a function?) of one module."""
    tree = ast.parse(MODULES[mod].read_text(encoding="utf-8"))

    def walk(node: ast.AST, nested: bool) -> Iterator[Tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    yield a.name, inner
            elif isinstance(child, ast.ImportFrom):
                internal = list(_resolve(mod, child))
                if internal:
                    yield from ((t, inner) for t in internal)
                elif child.module:
                    yield child.module, inner
            yield from walk(child, inner)

    yield from walk(tree, False)


def _graph() -> Dict[str, Set[str]]:
    g: Dict[str, Set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for name, nested in _imports(m):
            if name in MODULES and not nested and name != m:
                g[m].add(name)
    return g


def _heavy(mod: str, g: Dict[str, Set[str]], seen: Set[str]) -> bool:
    """Whether importing ``mod`` imports a heavy optional dependency at module level."""
    if mod in seen:
        return False
    seen.add(mod)
    if any(n.split(".")[0] in HEAVY for n, nested in _imports(mod) if not nested):
        return True
    return any(_heavy(d, g, seen) for d in g[mod])


def test_no_import_cycles() -> None:
    g = _graph()
    state: Dict[str, int] = {}

    def visit(m: str, path: Tuple[str, ...]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            # A package's __init__ importing its own submodules, and a submodule importing a
            # sibling, are not cycles; a submodule importing its own package __init__ back is.
            assert state.get(d) != 1, " -> ".join(path + (d,))
            if d not in state:
                visit(d, path + (d,))
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, (m,))


def test_function_level_imports_are_heavy_dependencies_only() -> None:
    g = _graph()
    bad = []
    for m in MODULES:
        for name, nested in _imports(m):
            if not nested:
                continue
            if name in MODULES:
                if not _heavy(name, g, set()):
                    bad.append(f"{m} imports {name} inside a function")
            elif name.split(".")[0] not in HEAVY:
                bad.append(f"{m} imports {name} inside a function")
    assert not bad, "\n".join(bad)
