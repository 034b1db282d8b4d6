"""Documentation the user sees: an example on every public name, and notebooks committed without outputs."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

import medload

PUBLIC = [name for name in medload.__all__ if not name.startswith("__")]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_a_docstring_with_an_example(name):
    doc = inspect.getdoc(getattr(medload, name)) or ""
    assert "Examples:" in doc and ">>>" in doc.split("Examples:", 1)[1], f"medload.{name} needs an Examples: section"


def test_committed_notebooks_have_no_outputs():
    """Outputs are stripped before committing (see notebooks/README.md); nbmake runs the notebooks."""
    notebooks = sorted((REPO / "notebooks").glob("*.ipynb"))
    assert len(notebooks) >= 2
    for path in notebooks:
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        dirty = [i for i, c in enumerate(cells)
                 if c["outputs"] or c["execution_count"] is not None or "execution" in c["metadata"]]
        assert not dirty, f"{path.name}: code cells {dirty} hold outputs; strip them (see notebooks/README.md)"


def _python_blocks(path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_the_readme_is_short_and_its_tour_is_the_getting_started_page():
    readme = REPO / "README.md"
    assert readme.stat().st_size <= 16 * 1024, "README.md is over 16 KB: move detail into docs/"
    assert _python_blocks(readme) == _python_blocks(REPO / "docs" / "getting-started.md")


def test_the_readme_tour_runs_on_the_sample_on_a_cpu(tmp_path, monkeypatch):
    (tour,) = _python_blocks(REPO / "README.md")
    (tmp_path / "sample_data").symlink_to(REPO / "sample_data")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(tour, "README.md", "exec"), namespace)  # noqa: S102 -- the README's own example
    assert namespace["report"].counts["ingested"] == 1
    assert tuple(namespace["batch"]["image"].shape) == (4, 3, 512, 512)
    # the next steps the README gives after the tour, in the venv the tour ran in (make demo's has the viz extra)
    steps = re.search(r"Then (`medload .*?)\(KEY", readme_text := (REPO / "README.md").read_text(), re.S)
    assert steps, "the README's next steps moved: update this test"
    commands = re.findall(r"`medload ([^`]+)`", steps.group(1))
    assert [c.split()[0] for c in commands] == ["info", "ls", "view"], readme_text
    for command in commands:
        args = command.replace("KEY", namespace["rec"].key[:8]).split()
        proc = subprocess.run([sys.executable, "-m", "medload.cli", *args], capture_output=True, text=True)
        assert proc.returncode == 0, f"medload {command}: {proc.stderr}"
    assert (tmp_path / "slice.png").stat().st_size > 0


def test_nothing_in_the_repository_cites_a_design_file_outside_it():
    name = "DESIGN" + ".md"  # spelled apart, so this file does not cite it
    skip = {".venv", ".git", ".site", "stores", "runs"}
    cited = [p.relative_to(REPO) for p in REPO.rglob("*") if p.suffix in {".py", ".md", ".ipynb", ".toml", ".yml"}
             and not skip & set(p.relative_to(REPO).parts) and name in p.read_text(errors="ignore")]
    assert cited == [], f"these cite {name}, which is not in the repository: {cited}"


def test_the_training_pages_examples_run_on_the_sample_and_on_a_partly_labelled_store(tmp_path, monkeypatch):
    """docs/training.md's first example on the sample study (on the CPU here), its filter error as quoted, and
    its hospital-store example on 9 series with 6 labelled."""
    import re

    from conftest import PHILIPS
    from helpers.labelled_store import make_partly_labelled_store

    from medload.config import IngestConfig
    from medload.data import SliceDataset
    from medload.errors import ConfigError
    from medload.ingest import ingest

    page = (REPO / "docs" / "training.md").read_text()
    first, hospital = _python_blocks(REPO / "docs" / "training.md")[:2]
    ingest(PHILIPS / "dicom", tmp_path / "stores" / "sample", config=IngestConfig(workers=1))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(first, "docs/training.md", "exec"), namespace)  # noqa: S102 -- the page's own example
    assert len(namespace["train"]) == 28 and tuple(namespace["batch"]["image"].shape) == (4, 3, 512, 512)
    with pytest.raises(ConfigError) as err:
        SliceDataset(namespace["store"], modality="MR", thickness=(0.5, 3.0))
    quoted = " ".join(re.search(r"`(no series of stores/sample match the filters: .*?)`", page, re.S)[1].split())
    assert quoted.split(": ", 1)[1] in str(err.value)

    namespace["store"] = medload.open_store(make_partly_labelled_store(tmp_path / "partly"))
    exec(compile(hospital, "docs/training.md", "exec"), namespace)  # noqa: S102
    assert namespace["train"].class_names == {1: "liver", 2: "spleen"} and len(namespace["train"].unlabelled) == 3
