"""Every docstring example in the package runs, against the sample study, so examples cannot drift.

Examples run in a folder holding ``stores/sample`` (the sample study ingested with a bone label: voxels
above 300 HU, as ``make demo`` trains on) and ``sample_data``, with ``store`` (that store, open),
``medload``, ``np``, ``torch``, ``SliceDataset``, ``SlabDataset`` and ``make_loader`` in their namespace
besides their module's globals. Examples that need a
GPU or minutes of work keep ``# doctest: +SKIP``.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import warnings

import numpy as np
import pytest
import torch
from conftest import REPO
from helpers.labelled_store import add_bone_mask

import medload
from medload.data import SlabDataset, SliceDataset, make_loader

#: Modules whose examples need something a test machine lacks.
_NEEDS = {"medload.bench.gpu": "CUDA"}


def _modules() -> list[str]:
    return ["medload"] + sorted(m.name for m in pkgutil.walk_packages(medload.__path__, "medload.")
                                if m.name not in _NEEDS and not m.name.endswith("__main__"))


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    out = []
    for name in _modules():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
        out += [t for t in finder.find(module, name) if t.examples and t.name.startswith(name)]
    return sorted(out, key=lambda t: t.name)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with ``stores/sample`` (the sample study, with a bone label) and ``sample_data``."""
    root = tmp_path_factory.mktemp("doctests")
    add_bone_mask(root / "stores" / "sample", root / "masks")
    (root / "sample_data").symlink_to(REPO / "sample_data")
    return root


EXAMPLES = _examples()


@pytest.mark.parametrize("test", EXAMPLES, ids=[t.name for t in EXAMPLES])
def test_docstring_example_runs(test, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    test.globs = {**test.globs, "medload": medload, "np": np, "torch": torch, "SliceDataset": SliceDataset,
                  "SlabDataset": SlabDataset, "make_loader": make_loader,
                  "store": medload.open_store(workdir / "stores" / "sample")}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.run(test, out=failures.append)
    assert not failures, "".join(failures)
