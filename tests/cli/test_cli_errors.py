"""Every way a ``medload`` command fails ends in one ``error:`` line that says what to do, with an exit code;
the traceback comes only with ``-v`` or ``--debug``. Run as real processes."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import flip_stored_value, write_key
from rich.console import Console

from medload.cli.failures import BUG, ERROR, report
from medload.config import IngestConfig
from medload.ingest.run import ingest
from medload.storage.keys import slice_key
from medload.storage.manifest import read_manifest, shard_path
from medload.storage.store import open_store
from medload.storage.writer import StoreWriter
from medload.synthetic import SeriesSpec, make_series

MEDLOAD = [sys.executable, "-m", "medload.cli"]


def medload(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*MEDLOAD, *map(str, args)], capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A store of one series, its sources, and things that are not what a command wants."""
    root = tmp_path_factory.mktemp("cli-errors")
    make_series(root / "src", SeriesSpec(n_slices=4, rows=16, cols=16), seed=1)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    (root / "file").write_text("a file, not a folder")
    (root / "empty").mkdir()
    (root / "badjson").mkdir()
    (root / "badjson" / "store.json").write_text('{"format": "medl')
    (root / "bad.toml").write_text("not toml at all")
    write_key(root / "other.key", "ff" * 32)
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("someone's folder")
    key = open_store(root / "store").series()[0].key
    return SimpleNamespace(root=root, src=root / "src", store=root / "store", file=root / "file", key=key,
                           empty=root / "empty", badjson=root / "badjson")


CASES = {
    "not a store": (lambda e: ["info", e.empty], "not a medload store"),
    "damaged store.json": (lambda e: ["ls", e.badjson], "the store manifest is damaged"),
    "store is a file": (lambda e: ["ingest", e.src, e.file, "--no-progress"], "is a file, not a folder"),
    "swapped arguments": (lambda e: ["ingest", e.store, e.src, "--no-progress"], "swapped arguments?"),
    "store in someone's folder": (lambda e: ["ingest", e.src, e.root / "notes", "--no-progress"],
                                  "is not a medload store and is not empty (it holds todo.txt)"),
    "verify a non-store": (lambda e: ["verify", e.empty], "not a medload store"),
    "store under a file": (lambda e: ["ingest", e.src, e.file / "store", "--no-progress"], "a part of it is a file"),
    "other key": (lambda e: ["ingest", e.src, e.store, "--key-file", e.root / "other.key", "--no-progress"],
                  "pass the store's key with --key-file"),
    "unknown window": (lambda e: ["ingest", e.src, e.root / "new", "--windows", "nope"], "unknown window 'nope'"),
    "bad size": (lambda e: ["ingest", e.src, e.root / "new", "--shard-bytes", "lots"], "is not a size"),
    "bad config": (lambda e: ["--config", e.root / "bad.toml", "ls", e.store], "cannot read config"),
    "unknown key": (lambda e: ["export", e.store, "ffff", e.root / "x.nii.gz"], "list them with `medload ls"),
    "export to a file's child": (lambda e: ["export", e.store, e.key, e.file / "x.nii.gz"], "a file where a folder"),
    "export suffix": (lambda e: ["export", e.store, e.key, e.root / "x.txt"], "must end with .nii or .nii.gz"),
    "view suffix": (lambda e: ["view", e.store, e.key, "-o", e.root / "x.jpg"], "must end with .png"),
    "slice out of range": (lambda e: ["view", e.store, e.key, "-o", e.root / "x.png", "--z", "99"], "outside series"),
    "no labels": (lambda e: ["view", e.store, e.key, "-o", e.root / "x.png", "--label"], "--labels"),
    "hot dir under a file": (lambda e: ["cache", "warm", e.store, "--hot-dir", e.file / "hot", "--hot-budget", "1GB"],
                             "a part of it is a file"),
    "no hot dir": (lambda e: ["cache", "status"], "give --hot-dir"),
    "not a device": (lambda e: ["profile", e.store, "--device", "nonsense"], "is not a torch device"),
    "absent GPU": (lambda e: ["profile", e.store, "--device", "cuda:99"], "CUDA device"),
    "unknown option": (lambda e: ["ls", e.store, "--bogus"], "--help"),
    "unknown command": (lambda e: ["nocommand"], "No such command"),
}


@pytest.mark.parametrize("case", CASES)
def test_an_error_is_one_line_saying_what_to_do(env, case):
    args, advice = CASES[case]
    proc = medload(*args(env))
    lines = proc.stderr.splitlines()
    assert proc.returncode == ERROR, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and advice in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_refused_stores_leave_the_folders_as_they_were(env):
    """The swapped ingest and the store in someone's folder write nothing into them."""
    for folder in (env.src, env.root / "notes"):
        before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
        target = (env.store, env.src) if folder == env.src else (env.src, folder)
        assert medload("ingest", *target, "--no-progress").returncode == ERROR
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before


def test_a_second_writer_is_refused_in_one_line(env):
    manifest = read_manifest(env.store)
    with StoreWriter(env.store, codec=manifest.codec, windows=manifest.windows, key_fingerprint=manifest.key_fingerprint):
        proc = medload("ingest", env.src, env.store, "--no-progress")
    assert proc.returncode == ERROR and proc.stderr.startswith("error: another medload process")
    assert len(proc.stderr.splitlines()) == 1


def test_repair_without_sources_says_to_give_them(env, tmp_path):
    store = tmp_path / "store"
    ingest(env.src, store, config=IngestConfig(workers=1))
    st = open_store(store)
    record = st.series()[0]
    assert flip_stored_value(shard_path(store, record.shard), slice_key(record.key_bytes, 1)) >= 1
    proc = medload("repair", store, "--no-progress")
    assert proc.returncode == ERROR and "give the folders, files or archives that hold them with --sources" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("flag", ["-v", "--debug"])
def test_verbose_or_debug_adds_the_traceback(env, flag):
    proc = medload(flag, "export", env.store, env.key, env.file / "x.nii.gz")
    assert proc.returncode == ERROR
    assert "Traceback (most recent call last)" in proc.stderr and "FileExistsError" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: File exists")


def test_output_to_a_closed_pipe_ends_quietly(env):
    """`medload ls STORE | head -0`: the reader is gone before medload writes."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([*MEDLOAD, "ls", str(env.store)], stdout=write_end, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert proc.returncode == 1 and proc.stderr == ""


def test_an_unexpected_error_is_reported_as_a_bug_to_report():
    out = io.StringIO()
    code = report(RuntimeError("boom"), Console(file=out, width=300), show_traceback=False)
    assert code == BUG
    assert out.getvalue().strip() == ("error: unexpected RuntimeError: boom -- a bug in medload: run the command again "
                                      "with --debug and report the traceback it shows")
