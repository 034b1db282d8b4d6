"""``medload compact`` on real stores: it frees what ``ingest --force`` and ``repair`` left superseded, keeps
every live series, label map and quarantine record bit for bit, refuses a damaged store, and a
``medload compact`` process killed with SIGKILL at each step of its protocol leaves a store that verifies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import pydicom
import pytest
from conftest import DATA, file_hashes, flip_stored_value

from medload.config import IngestConfig
from medload.ingest.run import ingest
from medload.storage.compact import compact_store
from medload.storage.keys import slice_key
from medload.storage.manifest import read_manifest, shard_path
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

CFG = IngestConfig(workers=1, windows=("lung",), shard_bytes=100_000)
GE = DATA / "ge_ct_3slice_seg"


def medload(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True)


def shard_bytes(store) -> int:
    """Bytes of the data.mdb of every shard store.json lists."""
    return sum((shard_path(store, e.name) / "data.mdb").stat().st_size for e in read_manifest(store).shards)


def content(store) -> dict:
    """What a reader gets: per series its record (bar the shard), HU, lung planes and labels; the rejects."""
    st = open_store(store, cache=0)
    out = {r.key: (replace(r, shard=""), st.read(r.key).tobytes(), st.read(r.key, plane="lung").tobytes(),
                   None if st.labels(r.key) is None else (replace(st.labels(r.key), shard=""),
                                                          st.read_label(r.key).tobytes()))
           for r in st.series()}
    out["rejects"] = st.rejects()
    st.close()
    return out


def clean(store) -> None:
    """``medload verify`` finds no damage and nothing superseded left."""
    proc = medload("verify", store, "--json", "--no-progress")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], proc.stdout
    assert not [n for n in report["notes"] if "superseded" in n["detail"]], report["notes"]


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    """Six series in three shards of two series each (and a quarantined file), then one series
    of the first shard and both of the second ingested again with --force: the second shard holds only
    superseded copies. Returns (root, what a reader gets, shard bytes before and after the forced ingest)."""
    root = tmp_path_factory.mktemp("compact")
    for s in range(6):
        make_series(root / "src" / f"s{s}", SeriesSpec(n_slices=6, rows=32, cols=32), seed=40 + s, series_number=s + 1)
    (root / "src" / "junk.dcm").write_bytes(b"not DICOM at all")
    ingest(root / "src", root / "store", config=CFG)
    by_shard = [[r.key for r in open_store(root / "store").series() if r.shard == e.name]
                for e in read_manifest(root / "store").shards]
    assert [len(keys) for keys in by_shard] == [2, 2, 2, 0]  # the last one holds the quarantine record
    before = shard_bytes(root / "store")
    report = ingest(root / "src", root / "store", config=CFG, force=[by_shard[0][0], *by_shard[1]])
    assert report.counts["replaced"] == 3
    return root, content(root / "store"), before, shard_bytes(root / "store")


@pytest.fixture
def store(forced, tmp_path):
    shutil.copytree(forced[0] / "store", tmp_path / "store")
    return tmp_path / "store"


def test_compact_frees_what_force_left_and_keeps_every_series(forced, store):
    _, reference, original, grown = forced
    names = [e.name for e in read_manifest(store).shards]
    proc = medload("compact", store, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rewrote  shard " + names[0] in proc.stdout and "removed  shard " + names[1] in proc.stdout
    after = shard_bytes(store)
    print(f"\nshard bytes: {original} after ingest, {grown} after --force of 3 of 6 series, {after} after compact")
    assert after < grown - original / 3  # the three superseded copies are gone
    clean(store)
    assert content(store) == reference
    listed = [e.name for e in read_manifest(store).shards]
    assert len(listed) == len(names) - 1 and listed[1:] == names[2:]  # the rewritten shard keeps its place
    assert sorted(p.name[:-5] for p in (store / "shards").iterdir()) == sorted(listed)
    assert list((store / "staging").iterdir()) == [] and not (store / "compact.json").exists()

    again = medload("compact", store, "--no-progress")
    assert again.returncode == 0 and "nothing to compact" in again.stdout, again.stdout
    assert shard_bytes(store) == after


def test_a_store_opened_before_compact_reads_from_the_replacement_shards(forced, store, caplog):
    """A reader (a training job) opened before ``medload compact`` ran in another process: its next reads
    of the series whose shard compact rewrote or removed find that shard gone, re-read store.json and read
    the same values from the shard that replaced it; no error reaches the caller."""
    _, reference, _, _ = forced
    reader = open_store(store, cache=0)
    stale = {r.key: r.shard for r in reader.series()}  # records (and shard names) as before compact
    reader.close()  # as a worker that has not opened the shards yet: it opens them by path
    proc = medload("compact", store, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gone = set(stale.values()) - {e.name for e in read_manifest(store).shards}
    assert gone and {r.shard for r in reader.series()} == set(stale.values())  # it has not looked yet
    caplog.set_level("INFO", logger="medload.storage.store")
    for key, (_, hu, lung, label) in ((k, v) for k, v in reference.items() if k != "rejects"):
        assert reader.read(key).tobytes() == hu
        assert b"".join(p.tobytes() for p in reader.planes(key, plane="lung")) == lung
        if label is not None:
            assert reader.read_label(key).tobytes() == label[1]
    assert {r.shard for r in reader.series()}.isdisjoint(gone)  # it follows store.json now
    assert any("was replaced since store.json was read" in m for m in caplog.messages)
    reader.close()


def test_force_and_compact_again_and_again_does_not_grow_the_store(forced, store):
    key = open_store(store).series()[0].key
    sizes = []
    for _ in range(3):
        ingest(forced[0] / "src", store, config=CFG, force=[key])
        sizes.append(compact_store(store).bytes_after)
    assert sizes == [sizes[0]] * 3, sizes
    assert content(store) == forced[1]


def test_compact_keeps_labels_written_in_their_own_shard(tmp_path):
    uid = pydicom.dcmread(GE / "ct-3slice" / "01.dcm", stop_before_pixels=True).SeriesInstanceUID
    mapping = tmp_path / "map.csv"
    mapping.write_text(f"series,label\n{uid},{GE / 'liver_seg.nrrd'}\n")
    src, store, cfg = tmp_path / "src", tmp_path / "store", IngestConfig(workers=1, windows=("lung",))
    shutil.copytree(GE / "ct-3slice", src / "ge")
    make_series(src / "b", SeriesSpec(n_slices=5, rows=32, cols=32), seed=3, series_number=9)
    ingest(src, store, config=cfg)                     # shard 1: both series
    ingest(src / "ge", store, config=cfg, labels=[mapping])  # shard 2: the labels of the GE series
    st = open_store(store)
    ge, other = (next(r.key for r in st.series() if (r.shape[0] == 3) == want) for want in (True, False))
    ingest(src / "b", store, config=cfg, force=[other])  # shard 3: supersedes the other series in shard 1
    reference, names = content(store), [e.name for e in read_manifest(store).shards]

    rewritten = compact_store(store)
    assert [(s.old, s.superseded) for s in rewritten.shards] == [(names[0], 1)]
    clean(store)
    assert content(store) == reference and reference[ge][3] is not None
    assert [e.name for e in read_manifest(store).shards][1:] == names[1:]

    ingest(src / "ge", store, config=cfg, labels=[mapping], force=[ge])  # shard 4: the GE series and its labels
    reference = content(store)
    removed = compact_store(store)
    assert {(s.new, s.superseded) for s in removed.shards} == {(None, 1)} and len(removed.shards) == 2
    clean(store)
    assert content(store) == reference and reference[ge][3] is not None


def test_compact_after_repair_drops_the_damaged_copy(forced, store):
    reference = content(store)
    victim = read_manifest(store).shards[-1]
    key = next(r.key for r in open_store(store).series() if r.shard == victim.name)
    assert flip_stored_value(shard_path(store, victim.name), slice_key(bytes.fromhex(key), 1))
    refused_files = file_hashes(store)
    refused = medload("compact", store, "--no-progress")
    assert refused.returncode == 2 and "error:" in refused.stderr and "medload repair" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and file_hashes(store) == refused_files

    proc = medload("repair", store, "--sources", forced[0] / "src", "--workers", "1", "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    repaired = shard_bytes(store)
    compacted = compact_store(store)
    assert victim.name in [s.old for s in compacted.shards] and compacted.bytes_after < repaired
    clean(store)
    assert content(store) == reference


# ---- kill -9 --------------------------------------------------------------------------------------
#: Where to kill: (a fragment of the log message compact emits right after a step, which occurrence).
#: The first shard is rewritten, the second removed (it holds only superseded copies).
KILL_POINTS = [
    ("copied sub-database", 3),  # building the first replacement
    ("compact: built", 1),  # built and synced, no journal yet
    ("journal written", 1),  # journal written, build not moved
    ("moved into shards", 1),  # replacement in shards/ but not in store.json
    ("store.json lists", 1),  # store.json switched, old shard still there
    ("removed (", 1),  # old shard removed, journal still there
    ("journal written", 2),  # the second shard: journal saying it goes
    ("store.json lists", 2),  # the second shard dropped from store.json, its files still there
]

_KILLER = textwrap.dedent("""
    import logging, os, signal, sys
    fragment, nth, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    seen = []

    class KillAt(logging.Handler):
        def emit(self, record):
            if fragment in record.msg:
                seen.append(record)
                if len(seen) == nth:
                    os.kill(os.getpid(), signal.SIGKILL)

    for name in ("medload.storage.compact", "medload.storage.compact_journal"):
        logging.getLogger(name).setLevel(logging.DEBUG)
        logging.getLogger(name).addHandler(KillAt())
    sys.argv = ["medload", "compact", store, "--no-progress"]
    from medload.cli import main
    main()
""")


@pytest.fixture(scope="module")
def compacted_bytes(forced, tmp_path_factory):
    """Shard bytes after an uninterrupted compaction of the forced store."""
    store = tmp_path_factory.mktemp("uninterrupted") / "store"
    shutil.copytree(forced[0] / "store", store)
    return compact_store(store).bytes_after


@pytest.mark.parametrize(("fragment", "nth"), KILL_POINTS)
def test_killing_compact_at_any_step_leaves_a_store_that_verifies(forced, store, compacted_bytes, fragment, nth):
    root, reference, _, grown = forced
    killed = subprocess.run([sys.executable, "-c", _KILLER, fragment, str(nth), str(store)], capture_output=True,
                            text=True)
    assert killed.returncode == -9, killed.stdout + killed.stderr  # the kill point was reached
    proc = medload("verify", store, "--json", "--no-progress")
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"], proc.stdout
    assert content(store) == reference

    rerun = medload("ingest", root / "src", store, "--workers", "1", "--windows", "lung", "--no-progress")
    assert rerun.returncode == 0 and "0 ingested" in rerun.stdout, rerun.stdout + rerun.stderr
    listed = {e.name for e in read_manifest(store).shards}
    assert {p.name[:-5] for p in (store / "shards").iterdir()} == listed  # the writer tidied what compact left
    assert list((store / "staging").iterdir()) == [] and not (store / "compact.json").exists()
    assert content(store) == reference

    finish = medload("compact", store, "--no-progress")
    assert finish.returncode == 0, finish.stdout + finish.stderr
    clean(store)
    assert content(store) == reference
    assert shard_bytes(store) == compacted_bytes < grown
