"""Every Python example in docs/ runs, so the pages cannot drift from the code.

Each page's ```python blocks run in order in one namespace (as a reader runs them one after another), in a
folder holding the stores the pages name: ``stores/sample`` (the sample study with a bone label, voxels
above 300 HU) and ``stores/ct`` (the labelled store of docs/nnunet.md's worked example). What a test machine
lacks is replaced, and only that (:data:`STAND_INS`): the pages' PACS address by a real Orthanc holding the
sample study, ``device="cuda"`` by the CPU where no GPU is, the reader's own ``train_step`` by a no-op. The
README's tour (the same block as docs/getting-started.md) runs in tests/project/test_docs.py, with its next steps.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import PHILIPS, REPO
from helpers.labelled_store import add_bone_mask, make_liver_bone_store
from helpers.orthanc_server import Orthanc

PAGES = sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "getting-started.md")
PACS = "dicomweb://pacs.example.org:8042/dicom-web"
#: Pages whose examples talk to a PACS: they run against a real Orthanc.
NEEDS_PACS = {p.name for p in PAGES if PACS in p.read_text()}


def _blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def test_every_page_with_python_is_run_here():
    """A new page's examples run without a change here; a page losing its last example is noticed."""
    assert {p.name for p in PAGES if _blocks(p)} >= {"explore.md", "nnunet.md", "training.md", "writeback.md"}


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Path:
    """``stores/sample`` and ``stores/ct``, built once for every page."""
    root = tmp_path_factory.mktemp("docs-stores")
    add_bone_mask(root / "stores" / "sample", root / "sample-masks")
    shutil.move(make_liver_bone_store(root / "ct"), root / "stores" / "ct")
    return root / "stores"


def _stand_ins(code: str, pacs_url: str | None) -> str:
    """The page's code with what this machine lacks replaced (see the module docstring)."""
    if pacs_url is not None:
        code = code.replace(PACS, pacs_url)
    if not torch.cuda.is_available():
        code = code.replace('device="cuda"', 'device="cpu"')
    return code


@pytest.mark.parametrize("page", [pytest.param(p, id=p.name, marks=[pytest.mark.orthanc] * (p.name in NEEDS_PACS))
                                  for p in PAGES if _blocks(p)])
def test_the_python_examples_of_the_page_run(page, stores, tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "stores").mkdir(parents=True)
    shutil.copytree(stores / "sample", work / "stores" / "sample")
    if page.name not in NEEDS_PACS:  # the PACS pages ingest their own stores/ct from the PACS
        shutil.copytree(stores / "ct", work / "stores" / "ct")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # ~/.config/medload/pacs.cred, as the pages write it
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"train_step": lambda batch: None}
    server = None
    try:
        if page.name in NEEDS_PACS:
            (tmp_path / "orthanc").mkdir()
            server = Orthanc(tmp_path / "orthanc")
            server.upload(PHILIPS / "dicom")
            cred = tmp_path / "home" / ".config" / "medload" / "pacs.cred"
            cred.parent.mkdir(parents=True)
            cred.write_text(f"{server.user}:{server.password}\n")
            cred.chmod(0o600)
        for i, block in enumerate(_blocks(page)):
            code = _stand_ins(block, server.dicomweb_url if server else None)
            exec(compile(code, f"{page.name} example {i + 1}", "exec"), namespace)  # noqa: S102 -- the page's own
    finally:
        if server is not None:
            server.stop()
