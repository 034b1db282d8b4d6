"""The modules of medload/data import each other in layers, without a cycle: not at module level, not
inside functions (where an import cycle hides until a call takes it), not under TYPE_CHECKING."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO
from helpers.import_graph import cycles, imports, module_name


def import_graph(root: Path = REPO, package: str = "medload.data") -> dict[str, set[str]]:
    """Each module of ``package`` (under ``root``) -> the modules of ``package`` it imports, anywhere in its
    source: an imported name maps to the longest prefix that is a module of the package. The package's own
    ``__init__``, run whenever a submodule is imported, is not counted as an edge."""
    folder = root.joinpath(*package.split("."))
    modules = {module_name(p, root): p for p in sorted(folder.glob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in imports(path, root, package.split(".")[0]):
            parts = target.split(".")
            found = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules),
                         None)
            if found is not None:
                edges.add(found)
        graph[name] = edges - {name, package}
    return graph


def test_the_graph_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import run\n")
    (pkg / "b.py").write_text("def run():\n    from pkg import a\n    return a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.d"}, "pkg.d": {"pkg.c"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    real = import_graph()
    assert "medload.data.autotune" in real["medload.data.loader"]  # make_loader resolves "auto" with it


def test_medload_data_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in medload/data (each a set of modules importing each other): " + "; ".join(
        " <-> ".join(c) for c in found)
