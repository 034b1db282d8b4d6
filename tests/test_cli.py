"""The ``medload`` command line, run as a real process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
from conftest import DATA, PHILIPS

MEDLOAD = [sys.executable, "-m", "medload.cli"]


def medload(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*MEDLOAD, *map(str, args)], capture_output=True, text=True, env=os.environ.copy())
    if check and proc.returncode != 0:
        raise AssertionError(f"medload {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "store"
    proc = medload("ingest", PHILIPS / "dicom", DATA / "monai_ct_4slice" / "CT_DICOM", path, "--workers", "2",
                   "--windows", "brain,lung", "--no-progress")
    assert "1 ingested" in proc.stdout and "1 rejected" in proc.stdout
    return path


def test_ls_json_has_the_contract_fields(store):
    records = json.loads(medload("ls", store, "--json").stdout)
    assert len(records) == 1
    rec = records[0]
    for field in ("key", "shape", "spacing", "affine", "modality", "digest"):
        assert field in rec
    assert rec["shape"] == [28, 512, 512] and rec["windows"] == ["brain", "lung"]
    assert len(rec["affine"]) == 4 and len(rec["digest"]) == 32


def test_info_lists_series_and_quarantine(store):
    out = medload("info", store).stdout
    assert "28x512x512" in out and "blosc2-lz4" in out and "brain, lung" in out
    assert "skipped" in out and "rejected" in out


def test_export_writes_the_volume_with_its_affine(store, tmp_path):
    key = json.loads(medload("ls", store, "--json").stdout)[0]["key"]
    out = tmp_path / "vol.nii.gz"
    medload("export", store, key[:8], out)
    img = nib.load(out)
    assert img.shape == (512, 512, 28) and img.get_data_dtype() == np.int16
    rec = json.loads(medload("ls", store, "--json").stdout)[0]
    assert np.allclose(img.affine, rec["affine"], atol=1e-4)
    assert medload("export", store, "ffff", out, check=False).returncode == 2


def test_rejects_json_and_all(store):
    rejected = json.loads(medload("rejects", store, "--json").stdout)
    assert [r["status"] for r in rejected] == ["rejected"]
    assert "irregular spacing" in rejected[0]["reason"]
    everything = json.loads(medload("rejects", store, "--json", "--all").stdout)
    assert {r["status"] for r in everything} == {"rejected", "skipped"}
    assert len(everything) == 1 + 1 + 6  # spacing; localizer; 6 secondary captures


def test_strict_makes_rejections_an_error(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DATA / "ge_ct_3slice_seg" / "ct-3slice", src)
    (src / "junk.txt").write_text("hello")
    assert medload("ingest", src, tmp_path / "a", "--no-progress").returncode == 0
    proc = medload("ingest", src, tmp_path / "b", "--strict", "--no-progress", check=False)
    assert proc.returncode == 1 and "1 ingested" in proc.stdout


def test_bad_arguments_give_clear_errors(tmp_path):
    proc = medload("ingest", DATA / "ge_ct_3slice_seg" / "ct-3slice", tmp_path / "s", "--windows", "nope", check=False)
    assert proc.returncode == 2 and "unknown window 'nope'" in proc.stderr
    proc = medload("info", tmp_path, check=False)
    assert proc.returncode == 2 and "not a medload store" in proc.stderr


def test_every_command_has_help():
    """``medload --help`` lists every command, and each command and subcommand (view, cache warm...) has
    its own help (in-process through click: one interpreter start per command would be slow)."""
    from click.testing import CliRunner

    from medload.cli import cli

    listing = medload("--help").stdout
    assert {"ingest", "info", "ls", "export", "rejects", "cache", "view"} <= set(cli.commands)
    paths = [[name] for name in cli.commands]
    paths += [[name, sub] for name, cmd in cli.commands.items() for sub in getattr(cmd, "commands", {})]
    for path in paths:
        assert path[0] in listing
        result = CliRunner().invoke(cli, [*path, "--help"])
        assert result.exit_code == 0 and "Usage" in result.output and cli.commands[path[0]].help, path


def test_the_summary_counts_secondary_captures_as_skipped_files_and_rejects_hints_all(store, tmp_path):
    proc = medload("ingest", PHILIPS / "dicom", tmp_path / "s", "--no-progress")
    summary = " ".join(proc.stdout.split())
    assert "skipped 6 file(s): Secondary Capture" in summary
    assert "files: 6 skipped, 0 rejected" in summary and "quarantined" not in summary
    out = " ".join(medload("rejects", store).stdout.split())
    assert "1 rejected input(s); 7 skipped" in out and "--all lists them too" in out
    assert "skipped (" not in " ".join(medload("rejects", store, "--all").stdout.split())


def test_cache_status_needs_no_budget(store, tmp_path):
    proc = medload("cache", "status", store, "--hot-dir", tmp_path / "hot")
    out = " ".join(proc.stdout.split())
    assert "0.0 MB used" in out and "0 of 1 shard(s)" in out
    budgeted = " ".join(medload("cache", "status", "--hot-dir", tmp_path / "hot", "--hot-budget", "1GB").stdout.split())
    assert "of 1000.0 MB used" in budgeted


def test_help_keeps_environment_variable_names_whole():
    text = medload("ingest", "--help").stdout
    for name in ("MEDLOAD_DICOMWEB_USER", "MEDLOAD_DICOMWEB_PASSWORD", "MEDLOAD_DICOMWEB_TOKEN", "MEDLOAD_KEY_FILE"):
        assert name in text, name


def test_cache_warm_over_budget_says_sizes_that_differ(store, tmp_path):
    shard = next((store / "shards").iterdir())
    held = (shard / "data.mdb").stat().st_size
    budget = held - 1000  # rounds like the shard's size: the message must still tell them apart
    proc = medload("cache", "warm", store, "--hot-dir", tmp_path / "hot", "--hot-budget", str(budget), check=False)
    line = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and "raise --hot-budget" in line, line
    assert f"{budget:,} bytes" in line and "but the hot budget is" in line, line
