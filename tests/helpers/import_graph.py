"""Import graphs read from the source (the AST), not by importing: every import statement counts, at module
level, inside functions (where a cycle or an upward import hides until a call takes it) and under
TYPE_CHECKING. Used by tests/project/test_layers.py and tests/project/test_import_graph.py."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """``medload.storage.store`` for ``root/medload/storage/store.py`` (a package's ``__init__``: the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path, package: str = "medload") -> set[str]:
    """Every dotted name under ``package`` that the module at ``path`` imports, anywhere in its source:
    ``from a.b import c`` gives ``a.b`` and ``a.b.c`` (``c`` may be a module or a name in ``a.b``)."""
    module, out = module_name(path, root), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                parts = module.split(".")
                base_parts = parts[: len(parts) - node.level + (path.name == "__init__.py")]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] == package}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One sorted list of nodes for each strongly connected component of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
