"""The corruption matrix (issue 19): one damage at a time to a real store of 12 series in 3 shards, then what
an operator would run. For each damage: ``ls``, ``info`` and a reader with a real loader (in their own
processes, whose exit status must not be a signal) show the damaged shard's series as unavailable or fail
on them with a MedloadError naming the shard, while every other series reads bit-exact; no command prints a
traceback; and ``verify`` -> ``repair --sources`` -> ``verify`` ends clean (for store.json damage, ``repair``
restores it from its copy)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.corruption import DAMAGE

from medload.config import IngestConfig
from medload.ingest.run import ingest
from medload.storage.manifest import read_manifest, retired_path
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

PROBE = Path(__file__).resolve().parents[1] / "helpers" / "corruption_probe.py"
#: damage that leaves the shard's file unopenable, or another size, or with other records than store.json lists
AT_OPEN = {"flip_meta_page", "truncate_half", "truncate_4k", "truncate_zero", "delete_shard_dir", "delete_data_mdb",
           "swap_two_shards"}
#: damage found when values are read: the error each read of a damaged series raises
AT_READ = {"flip_branch_page": "ShardUnavailableError", "flip_value": "ChecksumError"}
#: another size than store.json records: the reader must not even map the file
OTHER_SIZE = {"truncate_half", "truncate_4k", "truncate_zero"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Sources of 12 series of 12 slices, a store of them in 3 shards of 4 series (of equal size, so swapped
    files are told apart by their records only), and reference.json: the sha256 of every slice."""
    root = tmp_path_factory.mktemp("matrix")
    for i in range(12):
        make_series(root / "src" / f"s{i:02d}", SeriesSpec(n_slices=12, rows=24, cols=20), seed=i + 1,
                    series_number=i + 1)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1, windows=("lung",), shard_bytes=200_000))
    shards = read_manifest(root / "store").shards
    assert [s.series for s in shards] == [4, 4, 4] and len({s.bytes for s in shards}) == 1
    st = open_store(root / "store")
    reference = {r.key: [hashlib.sha256(s.tobytes()).hexdigest() for s in st.read(r.key)] for r in st.series()}
    st.close()
    (root / "reference.json").write_text(json.dumps(reference))
    return root


def _run(*args) -> subprocess.CompletedProcess:
    """A process of ours: it must exit by itself (never killed by a signal) and print no traceback."""
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode >= 0, f"{args[:3]} was killed by signal {-proc.returncode}: {proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return proc


def _medload(*args) -> subprocess.CompletedProcess:
    return _run("-m", "medload.cli", *args)


def _probe(store: Path, built: Path) -> dict:
    proc = _run(PROBE, store, built / "reference.json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_corruption_matrix(built, tmp_path, case):
    store = tmp_path / "store"
    shutil.copytree(built / "store", store)
    entries = {e.name: e for e in read_manifest(store).shards}
    damaged = DAMAGE[case](store)
    reference = json.loads((built / "reference.json").read_text())
    victims = {k for name in damaged for k in entries[name].keys.series}
    if case == "flip_value":
        victims = {entries[damaged[0]].keys.series[0]}  # the series whose value was flipped

    ls, info, seen = _medload("ls", store, "--json"), _medload("info", store), _probe(store, built)
    if case == "truncate_store_json":
        for proc in (ls, info):
            assert proc.returncode == 2 and proc.stdout == ""
            (line,) = proc.stderr.strip().splitlines()  # one line: what is wrong and what to do
            assert line.startswith("error: ") and "store.json is not valid JSON" in line
            assert f"medload repair {store}" in line
        assert seen["open"].startswith("ManifestDamagedError")
    else:
        assert ls.returncode == info.returncode == 0 and seen["open"] is None
        listed = {r["key"]: r for r in json.loads(ls.stdout)}
        assert set(listed) == set(reference)  # every series, damaged ones included
        for key, row in listed.items():
            if case in AT_OPEN and key in victims:
                assert row["shard"] in damaged and row["unavailable"]  # the reason
                assert f"{key[:12]} " in info.stdout
            else:
                assert row["unavailable"] is None and "digest" in row
        assert ("cannot be read" in info.stdout) == (case in AT_OPEN)
        for key, got in seen["reads"].items():
            if key not in victims:
                assert got == "ok", (key, got)
            elif case in AT_OPEN:
                assert got.startswith("ShardUnavailableError") and "medload repair" in got
                assert any(name in got for name in damaged)
            else:
                assert got.startswith(AT_READ[case]) and damaged[0] in got and "medload repair" in got
        readable = len(reference) - len(victims)
        assert seen["loader"] == {"batches": -(-readable * 12 // 5), "slices": readable * 12, "differ": 0, "error": None}
        if case in AT_OPEN:
            assert {k for u in seen["unavailable"] for k in u["series"]} == victims
            assert seen["full_loader"] == seen["loader"]  # the loader takes the series that can be read
        else:
            assert seen["unavailable"] == [] and seen["full_loader"]["error"].startswith(AT_READ[case])
        if case in OTHER_SIZE:
            assert seen["mapped"] and not any(damaged[0] in path for path in seen["mapped"])

    before = _medload("verify", store, "--no-progress", "--json")
    assert before.returncode == 1 and json.loads(before.stdout)["ok"] is False
    repair = _medload("repair", store, "--sources", built / "src", "--workers", "1", "--no-progress")
    assert repair.returncode == 0, repair.stdout + repair.stderr
    after = _medload("verify", store, "--no-progress", "--json")
    assert after.returncode == 0, after.stdout
    assert json.loads(after.stdout)["damage"] == []

    if case == "truncate_store_json":
        assert "restored  store.json from its copy" in repair.stdout
    for key in victims if case != "truncate_store_json" else ():
        assert f"repaired  {key}" in repair.stdout
    unreadable = damaged if case in AT_OPEN or case == "flip_branch_page" else []
    for name in unreadable:  # retired with a note, never deleted
        assert f"retired   shard {name}" in repair.stdout and name not in {e.name for e in read_manifest(store).shards}
        note = json.loads(retired_path(store, name).with_suffix(".json").read_text())
        assert note["shard"] == name and note["reason"] and sorted(note["store_json_entry"]["keys"]["series"])
        assert retired_path(store, name).exists() == (case != "delete_shard_dir")
    st = open_store(store)  # clean now: read here, every series bit-exact
    assert st.unavailable() == [] and {r.key for r in st.series()} == set(reference)
    for key, digests in reference.items():
        assert [hashlib.sha256(s.tobytes()).hexdigest() for s in st.read(key)] == digests
    st.close()
