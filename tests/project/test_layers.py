"""The package's layering (docs/architecture.md, "What may import what"), read from the import statements of
every module -- those inside functions too, which hide an upward import as well as a top-level one does."""

from __future__ import annotations

from collections import defaultdict

from conftest import REPO
from helpers.import_graph import cycles, imports, module_name

PACKAGE = REPO / "medload"
#: Bottom to top. A part may import its own layer's parts and those of the layers below, never above.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "version", "config", "deid", "owner_only", "windows", "devices", "extras", "progress",
               "allocator", "cgroup_limits", "models", "synthetic"}),
    frozenset({"storage", "cache", "lineage"}),  # cache: the deprecated alias of storage.cache
    frozenset({"labels", "export", "viz"}),
    frozenset({"ingest", "data"}),
    frozenset({"pacs", "lightning"}),
    frozenset({"writeback"}),
    frozenset({"cli", "bench"}),
)
#: Imports the layers alone would allow, refused by name.
FORBIDDEN = {("bench", "cli")}


def _part(module: str) -> str | None:
    """The top-level part of the package a module belongs to (None: the package's own ``__init__``, the facade
    that re-exports from every layer)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = _part(module_name(path, REPO))
        if source is None:
            continue
        graph[source] |= {p for p in map(_part, imports(path, REPO)) if p is not None and p != source}
    return graph


def _layer(part: str) -> int:
    found = [i for i, layer in enumerate(LAYERS) if part in layer]
    assert found, f"medload.{part} is in no layer of tests/project/test_layers.py: add it where docs/architecture.md puts it"
    return found[0]


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(module_name(p, REPO)) for p in PACKAGE.rglob("*.py")} - {None}
    assert parts == set().union(*LAYERS), "LAYERS and the package's folders disagree"


def test_no_part_imports_a_layer_above_it():
    upward = sorted((a, b) for a, targets in _part_graph().items() for b in targets
                    if _layer(b) > _layer(a) or (a, b) in FORBIDDEN)
    assert upward == [], f"imports from a lower layer to a higher one: {upward}"


def test_the_parts_of_one_layer_do_not_import_each_other_in_a_circle():
    graph = _part_graph()
    for layer in LAYERS:
        found = cycles({part: graph[part] & layer for part in layer})
        assert found == [], f"parts of one layer importing each other in a circle: {found}"


def test_the_checks_see_an_import_inside_a_function(tmp_path):
    """The reading catches what a lazy import would hide (storage reaching up to ingest and data)."""
    module = tmp_path / "medload" / "storage" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from medload.ingest.run import ingest\n    from ..data import loader\n")
    assert {"medload.ingest.run", "medload.data", "medload.data.loader"} <= imports(module, tmp_path)
