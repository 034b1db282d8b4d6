"""The 3D patch section end to end at a tiny size on the CPU: its data in every contender's format, a row
per contender at 2 workers with the page cache cold (other workers counts and the warm mode differ only
in a number passed to the DataLoader and in reading the files first),
with positive figures, the targets read from them, and the training step of its GPU variant on the CPU.
No speed is asserted: that is the benchmark's job."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from medload.bench.patches import run_child, run_patches
from medload.bench.patches_data import PatchPrep, PatchSettings
from medload.bench.patches_report import patch_tables
from medload.bench.targets import PATCH_TARGETS, patch_targets

pytestmark = pytest.mark.slow  # 4 fresh processes, each importing torch and MONAI, and their workers

TINY = PatchSettings(series=3, slices=10, size=40, patch=(16, 16, 16), spacing=4.0, workers=(2,), modes=("cold",), warmup=1,
                     batches=1, repeats=1, timeout=600.0)


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    root = tmp_path_factory.mktemp("patches")
    return run_patches(root / "data", root / "work", TINY, key_file=root / "key", progress=False)


def test_every_contender_has_a_row_with_positive_figures(section):
    rows = [r for r in section["rows"] if not r["train"]]
    assert {(r["contender"], r["num_workers"], r["mode"]) for r in rows} == {
        (n, w, m) for n in TINY.contenders for w in TINY.workers for m in TINY.modes}
    for r in rows:
        if r["contender"] == "nnunet" and r["status"] == "skipped":
            assert "nnunetv2 is not installed" in r["reason"]
            continue
        assert r["status"] == "ok", r
        assert r["patches_per_s"] > 0 and r["peak_pss_mb"] > 0 and r["mb_read_per_patch"] >= 0
    decoded = {r["contender"]: r["decoded_mb"] for r in rows}
    assert decoded["medload"] > 0 and decoded["monai_persistent"] > 0 and decoded["monai_cache"] == 0
    assert section["store_gb"] > 0


def test_the_gpu_variant_trains_on_the_resident_batch_and_on_medload_batches(section):
    # the DynUNet's fifth level halves 32 voxels four times: 2^3 is the least instance norm takes
    settings = replace(TINY, patch=(32, 32, 32), train=True)
    prep = PatchPrep.load(Path(section["root"]) / "prepared-patches.json")
    for name in ("resident", "medload"):
        out = run_child(name, prep, settings, 0, "cpu", cold=False, train=True)
        assert out["patches"] == [settings.batch_size] and out["seconds"][0] > 0


def test_targets_are_read_from_the_rows_and_printed(section):
    targets = patch_targets(section)
    assert [t["run"] for t in targets[:len(PATCH_TARGETS)]] == [
        f"3D patches, page cache {m}, {w} workers" for m, w, _ in PATCH_TARGETS]
    measured = [t for t in targets if t["run"].endswith("cold, 2 workers")]  # the one setting this run measured
    assert measured and all(t["value"] is not None and t["met"] in (True, False) for t in measured)
    assert all(t["value"] is None and t["met"] is None for t in targets if t not in measured)
    tables = patch_tables({"patches": section, "patch_targets": targets})
    assert [t.title.split(":")[0] for t in tables] == ["3D patches", "3D patch targets, read from the rows above"]
    shown = [row[-1] for row in tables[-1].rows]
    assert [m for m, t in zip(shown, targets) if t in measured] and all(
        m in ("yes", "NO") if t in measured else m == "-" for m, t in zip(shown, targets))
