"""Documentation the user sees: an example on every public name, and notebooks committed without outputs."""

from __future__ import annotations

import inspect
import json

import pytest

import medload
from conftest import REPO

PUBLIC = [name for name in medload.__all__ if not name.startswith("__")]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_a_docstring_with_an_example(name):
    doc = inspect.getdoc(getattr(medload, name)) or ""
    assert "Example:" in doc and ">>>" in doc.split("Example:", 1)[1], f"medload.{name} needs an Example: section"


def test_committed_notebooks_have_no_outputs():
    """Outputs are stripped before committing (see notebooks/README.md); nbmake runs the notebooks."""
    notebooks = sorted((REPO / "notebooks").glob("*.ipynb"))
    assert len(notebooks) >= 2
    for path in notebooks:
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        dirty = [i for i, c in enumerate(cells)
                 if c["outputs"] or c["execution_count"] is not None or "execution" in c["metadata"]]
        assert not dirty, f"{path.name}: code cells {dirty} hold outputs; strip them (see notebooks/README.md)"
