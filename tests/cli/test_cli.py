"""The ``medload`` command line, run as a real process."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest
from conftest import DATA, PHILIPS, file_hashes

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
    (src / "junk.txt").write_text("hello")  # not DICOM: ignored, which --strict lets pass
    assert medload("ingest", src, tmp_path / "a", "--strict", "--no-progress").returncode == 0
    good = (src / "01.dcm").read_bytes()
    (src / "cut.dcm").write_bytes(good[: len(good) // 2])
    assert medload("ingest", src, tmp_path / "b", "--no-progress").returncode == 0
    proc = medload("ingest", src, tmp_path / "c", "--strict", "--no-progress", check=False)
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
    assert "0.0 MB used" in out and "0 of 2 shard(s)" in out  # the series, and the reject record the ingest wrote
    budgeted = " ".join(medload("cache", "status", "--hot-dir", tmp_path / "hot", "--hot-budget", "1GB").stdout.split())
    assert "of 1000.0 MB used" in budgeted


def test_help_keeps_environment_variable_names_whole():
    text = medload("ingest", "--help").stdout
    for name in ("MEDLOAD_DICOMWEB_USER", "MEDLOAD_DICOMWEB_PASSWORD", "MEDLOAD_DICOMWEB_TOKEN", "MEDLOAD_KEY_FILE"):
        assert name in text, name


def test_cache_warm_over_budget_says_sizes_that_differ(store, tmp_path):
    held = sum((shard / "data.mdb").stat().st_size for shard in (store / "shards").iterdir())
    budget = held - 1000  # rounds like the shards' size: the message must still tell them apart
    proc = medload("cache", "warm", store, "--hot-dir", tmp_path / "hot", "--hot-budget", str(budget), check=False)
    line = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and "raise --hot-budget" in line, line
    assert f"{budget:,} bytes" in line and "but the hot budget is" in line, line


def _not_dicom_files(folder):
    """What lies next to DICOM in real exports: notes, a licence, JSON, a NIfTI volume."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text("# Export\nSeries from the PACS, see the ticket.\n")
    (folder / "LICENSE").write_text("Permission is hereby granted, free of charge...\n")
    (folder / "meta.json").write_text(json.dumps({"Modality": "CT", "slices": 3}))
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.int16), np.eye(4)), folder / "scan.nii")
    return 4


def test_sources_without_dicom_are_an_error_that_creates_no_store(tmp_path, store):
    docs = tmp_path / "docs"
    _not_dicom_files(docs)
    new = tmp_path / "stores" / "new"
    proc = medload("ingest", docs, new, "--no-progress", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = " ".join(proc.stderr.split())
    assert f"error: no DICOM found in {docs}: 4 ignored, e.g. {docs}/LICENSE (not DICOM: text)" in message
    assert not new.exists() and not (tmp_path / "stores").exists() or list((tmp_path / "stores").iterdir()) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert medload("ingest", docs, empty, "--no-progress", check=False).returncode == 2
    assert list(empty.iterdir()) == []  # the folder given stays, and stays empty
    before = {k: v for k, v in file_hashes(store).items() if not k.endswith("writer.lock")}
    proc = medload("ingest", docs, store, "--windows", "brain,lung", "--no-progress", check=False)
    assert proc.returncode == 2 and "no DICOM found" in proc.stderr
    assert {k: v for k, v in file_hashes(store).items() if not k.endswith("writer.lock")} == before


def test_files_not_dicom_are_counted_as_ignored_apart_from_rejected_ones(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(DATA / "ge_ct_3slice_seg" / "ct-3slice", src / "ct")
    _not_dicom_files(src / "docs")
    good = (src / "ct" / "01.dcm").read_bytes()
    (src / "cut.dcm").write_bytes(good[: len(good) // 2])
    proc = medload("ingest", src, tmp_path / "s", "--strict", "--no-progress", check=False)
    assert proc.returncode == 1  # the damaged file, not the others
    assert "files: 0 skipped, 1 rejected, 4 ignored (not DICOM)" in proc.stdout
    assert f"ignored 3 file(s): not DICOM: text  [e.g. {src}/docs/LICENSE]" in proc.stdout
    assert f"ignored 1 file(s): not DICOM: NIfTI-1 image  [e.g. {src}/docs/scan.nii]" in proc.stdout
    records = json.loads(medload("rejects", tmp_path / "s", "--json", "--all").stdout)
    assert sorted((r["status"], r["source"].rsplit("/", 1)[1]) for r in records) == [
        ("ignored", "LICENSE"), ("ignored", "README.md"), ("ignored", "meta.json"), ("ignored", "scan.nii"),
        ("rejected", "cut.dcm")]
    out = " ".join(medload("rejects", tmp_path / "s").stdout.split())
    assert "1 rejected input(s); 4 ignored (not DICOM); --all lists them too" in out and "LICENSE" not in out


def test_the_summary_never_breaks_a_word_or_a_number_across_lines(tmp_path):
    """Not in a terminal (a log, a pipe), nothing is wrapped: each quantity and each example path stays whole."""
    src = tmp_path / "src"
    shutil.copytree(DATA / "ge_ct_3slice_seg" / "ct-3slice", src / "ct")
    deep = src.joinpath(*[f"folder_with_a_long_name_{i:02d}" for i in range(8)])
    deep.mkdir(parents=True)
    (deep / "notes.txt").write_text("see the PACS\n")
    proc = medload("ingest", src, tmp_path / "s", "--no-progress")
    lines = proc.stdout.splitlines()
    assert any(re.search(r"\d+ files, [\d.]+ MB in [\d.]+ s \(\d+ files/s, \d+ MB/s\)", line) for line in lines), lines
    assert any(f"[e.g. {deep}/notes.txt]" in line for line in lines), lines
    assert any("files: 0 skipped, 0 rejected, 1 ignored (not DICOM)" in line for line in lines), lines


def test_the_summary_wraps_a_terminal_only_between_words(tmp_path, monkeypatch):
    from rich.console import Console

    import medload.cli.ingest as cli_ingest
    from medload.ingest.report import IngestReport, SeriesOutcome
    from medload.storage.records import RejectRecord

    report = IngestReport(store="stores/ct", files=123456, bytes=98765432100, seconds=1234.5)
    report.series.append(SeriesOutcome("ab" * 16, "ingested", "CT", 300, (300, 512, 512)))
    report.rejects += [RejectRecord("ignored", "discover", "not DICOM: text", "/export/README.md"),
                       RejectRecord("rejected", "header", "truncated file: element (7FE0,0010) declares 524288 bytes",
                                    "/export/series_0001/IM000123.dcm")]
    out = io.StringIO()
    monkeypatch.setattr(cli_ingest, "console", Console(file=out, width=44, force_terminal=True, color_system=None))
    cli_ingest._print_ingest_summary(report)
    text = out.getvalue()
    words = " ".join(text.split())
    for whole in ("123456 files", "98765.4 MB", "1234.5 s", "100 files/s", "80 MB/s", "/export/series_0001/IM000123.dcm",
                  "1 ingested, 0 already present", "0 skipped, 1 rejected, 1 ignored"):
        assert whole in words, whole
    assert all(len(line) <= 44 for line in text.splitlines())
    tokens = set(" ".join([*(r.reason for r in report.rejects), *(r.source for r in report.rejects)]).split())
    printed = set(re.split(r"[\s\[\]]+", text))
    assert "(7FE0,0010)" in tokens and tokens <= printed, tokens - printed  # no word cut in two
