"""The modules of medload/data import each other in layers, without a cycle: not at module level, not
inside functions (where an import cycle hides until a call takes it), not under TYPE_CHECKING.

The graph is built from the source (the AST), not by importing, so every import counts, run or not."""

from __future__ import annotations

import ast

from conftest import REPO

PACKAGE = "medload.data"
ROOT = REPO / "medload" / "data"


def import_graph(root=ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Each module of medload/data -> the modules of medload/data it imports, anywhere in its source.

    ``from medload.data.x import y`` is an edge to ``x`` (or to ``x.y`` where that is a module);
    ``from medload.data import y`` to module ``y`` where there is one, else to the package itself.
    The package's own ``__init__``, run whenever a submodule is imported, is not counted as an edge."""
    modules = {package if p.name == "__init__.py" else f"{package}.{p.stem}": p for p in sorted(root.glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            elif isinstance(node, ast.ImportFrom):  # relative: resolved against this package
                base = package if node.level == 1 else package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{node.module}" if node.module else base
                targets = [f"{module}.{alias.name}" for alias in node.names] + [module]
            else:
                continue
            for target in targets:
                # the longest prefix that is a module of the package: the module itself, else the package
                parts = target.split(".")
                for n in range(len(parts), 1, -1):
                    candidate = ".".join(parts[:n])
                    if candidate in modules:
                        edges.add(candidate)
                        break
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
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


def test_the_graph_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    (tmp_path / "a.py").write_text("from pkg.b import run\n")
    (tmp_path / "b.py").write_text("def run():\n    from pkg import a\n    return a\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (tmp_path / "d.py").write_text("import pkg.c\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.d"}, "pkg.d": {"pkg.c"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    real = import_graph()
    assert "medload.data.autotune" in real["medload.data.loader"]  # make_loader resolves "auto" with it


def test_medload_data_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in medload/data (each a set of modules importing each other): " + "; ".join(
        " <-> ".join(c) for c in found)
