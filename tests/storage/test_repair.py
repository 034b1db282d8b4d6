"""Replacing a stored series (``ingest --force``) and ``medload repair``, on real stores: the replaced copy is
superseded once and for all, a crash keeps one live copy, labels go with the replaced series, and a flipped
byte is repaired from the sources."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import lmdb
import numpy as np
import pydicom
import pytest
from conftest import DATA, flip_stored_value

from medload.config import IngestConfig
from medload.errors import ConfigError, ManifestDamagedError, SeriesNotFoundError
from medload.ingest.repair import repair_store
from medload.ingest.run import ingest
from medload.storage.keys import slice_key
from medload.storage.manifest import file_digest, read_manifest, retired_path, shard_path, write_manifest
from medload.storage.store import open_store
from medload.storage.verify import verify_store
from medload.storage.writer import StoreWriter
from medload.synthetic import SeriesSpec, make_series

CFG = IngestConfig(workers=1, windows=("lung",))
GE = DATA / "ge_ct_3slice_seg"


def medload(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Sources of two series (8 and 6 slices, in src/a and src/b) and a store built from them with lung planes."""
    root = tmp_path_factory.mktemp("repair")
    make_series(root / "src" / "a", SeriesSpec(n_slices=8, rows=24, cols=20), seed=1, series_number=1)
    make_series(root / "src" / "b", SeriesSpec(n_slices=6, rows=24, cols=20), seed=2, series_number=2)
    ingest(root / "src", root / "store", config=CFG)
    return root


@pytest.fixture
def store(built, tmp_path):
    """A private copy of the built store."""
    shutil.copytree(built / "store", tmp_path / "store")
    return tmp_path / "store"


def _key(store, depth: int) -> str:
    return next(r.key for r in open_store(store).series() if r.shape[0] == depth)


def _same_data(store, reference, key: str) -> bool:
    a, b = open_store(store), open_store(reference)
    return (np.array_equal(a.read(key), b.read(key)) and a.record(key).digest == b.record(key).digest
            and np.array_equal(a.read(key, plane="lung"), b.read(key, plane="lung")))


def test_force_replaces_a_healthy_series(built, store):
    key = _key(store, 8)
    before = {r["key"]: r for r in json.loads(medload("ls", store, "--json").stdout)}
    proc = medload("ingest", built / "src" / "a", store, "--force", key[:8], "--windows", "lung", "--workers", "1",
                   "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replaced" in proc.stdout and "0 ingested" in proc.stdout and "1 replaced" in proc.stdout
    after = {r["key"]: r for r in json.loads(medload("ls", store, "--json").stdout)}
    assert len(json.loads(medload("ls", store, "--json").stdout)) == len(after) == len(before) == 2  # no duplicate
    assert after[key]["digest"] == before[key]["digest"] and after[key]["shard"] != before[key]["shard"]
    assert _same_data(store, built / "store", key)
    report = verify_store(store)
    assert report.ok, report.damage
    assert [(d.where, d.shard) for d in report.notes] == [(key, before[key]["shard"])]
    assert "superseded copy" in report.notes[0].detail


def test_force_errors_are_clear(built, store, tmp_path):
    key = _key(store, 8)
    with pytest.raises(SeriesNotFoundError, match="no series key starts with"):
        ingest(built / "src" / "a", store, config=CFG, force=["00000000deadbeef"])
    with pytest.raises(ConfigError, match="at least 8 hex digits"):
        ingest(built / "src" / "a", store, config=CFG, force=[key[:4]])
    with pytest.raises(ConfigError, match="not a store"):
        ingest(built / "src" / "a", tmp_path / "nothing", config=CFG, force=[key])
    report = ingest(built / "src" / "b", store, config=CFG, force=[key])  # a's files are not among the sources
    assert [(s.key, s.status) for s in report.series if s.key == key] == [(key, "not_found")]
    assert report.exit_code(strict=False) == 1
    assert len(read_manifest(store).shards) == 1 and verify_store(store).notes == []  # nothing was written


def test_a_crash_between_commit_and_publish_keeps_one_live_copy(built, store):
    """The forced series is committed to staging with its marker, then the ingester is killed before publishing."""
    key = _key(store, 8)
    script = textwrap.dedent(f"""
        import os, signal
        from medload.config import IngestConfig
        from medload.ingest import ingest
        from medload.storage.writer import StoreWriter
        StoreWriter._publish_current = lambda self: os.kill(os.getpid(), signal.SIGKILL)
        ingest({str(built / "src" / "a")!r}, {str(store)!r}, config=IngestConfig(workers=1, windows=("lung",)),
               force=[{key!r}])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert len(list((store / "staging").glob("*.lmdb"))) == 1
    old_shard = open_store(store).record(key).shard
    assert len(open_store(store).series()) == 2  # staging is never read: the old copy is the live one
    assert verify_store(store).ok

    manifest = read_manifest(store)
    StoreWriter(store, codec=manifest.codec, windows=manifest.windows, key_fingerprint=manifest.key_fingerprint).close()
    st = open_store(store)
    assert len(read_manifest(store).shards) == 2 and len(st.series()) == 2
    assert st.record(key).shard != old_shard and _same_data(store, built / "store", key)
    report = verify_store(store)
    assert report.ok and [d.where for d in report.notes] == [key]
    again = ingest(built / "src", store, config=CFG)  # a re-run: present, no duplicate
    assert again.counts["present"] == 2 and len(open_store(store).series()) == 2


def test_repair_restores_a_flipped_byte_from_the_sources(built, store):
    key = _key(store, 8)
    assert flip_stored_value(shard_path(store, read_manifest(store).shards[0].name), slice_key(bytes.fromhex(key), 2))
    assert not verify_store(store).ok

    with pytest.raises(ConfigError, match="--sources"):  # the store keeps source hashes, not paths
        repair_store(store)
    wrong = repair_store(store, [built / "src" / "b"], config=CFG)  # a's files are not there
    assert not wrong.ok and [(s.key, s.status) for s in wrong.series] == [(key, "not_found")]
    proc = medload("repair", store, "--sources", built / "src", "--workers", "1", "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"repaired  {key}" in proc.stdout and "resealed  shard" in proc.stdout
    report = verify_store(store)
    assert report.ok and [d.where for d in report.notes] == [key]  # the damaged copy, superseded
    assert _same_data(store, built / "store", key) and _same_data(store, built / "store", _key(store, 6))


def test_an_unreadable_shard_is_retired_once_its_series_are_stored_again(built, store):
    entry = read_manifest(store).shards[0]
    data = shard_path(store, entry.name) / "data.mdb"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert {u.shard for u in open_store(store).unavailable()} == {entry.name}
    cat = open_store(store).catalog()  # its series, with the reason and no other fields
    assert len(cat) == 2 and cat.unavailable.str.contains("cannot be read").all() and cat.slices.isna().all()

    again = ingest(built / "src", store, config=CFG)  # a plain re-ingest writes nothing over a shard it cannot read
    assert {s.status for s in again.series} == {"unavailable"} and again.exit_code(strict=False) == 1
    assert "medload repair" in again.series[0].reason and read_manifest(store).shards == [entry]

    half = repair_store(store, [built / "src" / "b"], config=CFG)  # a's files are missing: the shard must stay
    assert not half.ok and half.retired == {} and entry.name in half.not_retired
    assert [e.name for e in read_manifest(store).shards][0] == entry.name
    result = repair_store(store, [built / "src"], config=CFG)
    assert result.ok and list(result.retired) == [entry.name] and result.resealed == []
    assert entry.name not in {e.name for e in read_manifest(store).shards}
    assert (retired_path(store, entry.name) / "data.mdb").stat().st_size == entry.bytes // 2  # kept as it was
    note = json.loads(result.retired[entry.name].read_text())
    assert "truncated" in note["reason"] and note["series"] == "stored again in other shards"
    assert sorted(note["store_json_entry"]["keys"]["series"]) == sorted(r.key for r in open_store(built / "store").series())
    assert all(_same_data(store, built / "store", _key(store, n)) for n in (6, 8))
    report = verify_store(store)
    assert report.ok and [d.where for d in report.notes] == [f"retired/{entry.name}.json"]


def test_damage_no_series_owns_is_reported_not_repaired(built, store):
    manifest = read_manifest(store)
    path = shard_path(store, manifest.shards[0].name)
    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=64)
    with env.begin(write=True) as txn:  # a slice value no series record owns: verify names it, repair cannot
        txn.put(slice_key(bytes(range(16)), 0), b"stray", db=env.open_db(b"slices", txn=txn))
    env.close()
    data = path / "data.mdb"
    manifest.shards = [replace(manifest.shards[0], bytes=data.stat().st_size, digest=file_digest(data))]
    write_manifest(store, manifest)
    result = repair_store(store, [built / "src"])
    assert not result.ok and result.series == [] and result.retired == {}
    assert "orphan" in {d.kind for d in result.after.damage}


def _as_format_2(store) -> None:
    """Rewrite store.json as medload of format 2 wrote it: no key lists."""
    doc = json.loads((store / "store.json").read_text())
    doc["version"] = 2
    for entry in doc["shards"]:
        del entry["keys"]
    (store / "store.json").write_text(json.dumps(doc))


def test_a_format_2_store_is_read_and_upgraded(built, store):
    _as_format_2(store)
    assert read_manifest(store).shards[0].keys is None and len(open_store(store).series()) == 2
    proc = medload("repair", store, "--no-progress")  # no damage: no sources needed
    assert proc.returncode == 0 and "upgraded  store.json to format 3" in proc.stdout, proc.stdout + proc.stderr
    manifest = read_manifest(store)
    assert manifest.version == 3
    assert sorted(manifest.shards[0].keys.series) == sorted(r.key for r in open_store(store).series())
    assert verify_store(store).ok


def test_a_format_2_shard_that_cannot_be_read_is_repaired_from_every_missing_series(built, store):
    _as_format_2(store)
    (shard_path(store, read_manifest(store).shards[0].name) / "data.mdb").unlink()
    (down,) = open_store(store).unavailable()
    assert down.series is None  # store.json does not say which series it held
    proc = medload("ls", store)
    assert proc.returncode == 0 and "does not list its series" in proc.stdout
    result = repair_store(store, [built / "src"], config=CFG)
    assert result.ok and list(result.retired) == [down.shard] and len(result.series) == 2
    assert all(_same_data(store, built / "store", _key(store, n)) for n in (6, 8))
    assert read_manifest(store).version == 3


def test_a_damaged_store_json_is_restored_from_its_copy(built, store):
    (store / "store.json").write_text((store / "store.json").read_text()[:40])
    with pytest.raises(ManifestDamagedError, match=f"medload repair {store}"):
        open_store(store)
    result = repair_store(store)
    assert result.restored and result.ok and len(open_store(store).series()) == 2
    (store / "store.json").unlink()
    with pytest.raises(ManifestDamagedError, match="is missing"):
        ingest(built / "src", store, config=CFG)  # a writer does not start a new, empty manifest
    assert repair_store(store).restored and verify_store(store).ok


def test_labels_of_a_replaced_series_are_dropped_until_ingested_again(tmp_path):
    uid = pydicom.dcmread(GE / "ct-3slice" / "01.dcm", stop_before_pixels=True).SeriesInstanceUID
    mapping = tmp_path / "map.csv"
    mapping.write_text(f"series,label\n{uid},{GE / 'liver_seg.nrrd'}\n")
    store, cfg = tmp_path / "store", IngestConfig(workers=1)
    ingest(GE / "ct-3slice", store, config=cfg, labels=[mapping])
    key = open_store(store).series()[0].key
    label = open_store(store).read_label(key)

    dropped = ingest(GE / "ct-3slice", store, config=cfg, force=[key])
    assert [s.status for s in dropped.series] == ["replaced"]
    assert [(o.key, o.status) for o in dropped.labels] == [(key, "dropped")]
    assert open_store(store).labels(key) is None and verify_store(store).ok
    with pytest.raises(ConfigError, match="has no labels"):
        open_store(store).read_label(key)

    back = ingest(GE / "ct-3slice", store, config=cfg, labels=[mapping])  # onto the stored (replacing) copy
    assert [(o.key, o.status) for o in back.labels] == [(key, "ingested")]
    assert np.array_equal(open_store(store).read_label(key), label)

    proc = medload("ingest", GE / "ct-3slice", store, "--force", key, "--labels", mapping, "--workers", "1",
                   "--no-progress")
    assert proc.returncode == 0 and "1 replaced" in proc.stdout and "label ingested" in proc.stdout, proc.stdout
    st = open_store(store)
    assert len(st.series()) == 1 and np.array_equal(st.read_label(key), label)
    assert st.labels(key).shard == st.record(key).shard == read_manifest(store).shards[-1].name
    report = verify_store(store)
    assert report.ok and report.labels == 1, report.damage
    assert len(report.notes) == 3  # the first copy with its labels, the second copy, the labels written onto it


def test_a_published_shard_an_older_store_json_misses_is_adopted(built, tmp_path):
    """store.json put back from before the last ingest: repair, like every writer, lists the later shard again."""
    store = tmp_path / "store"
    ingest(built / "src" / "a", store, config=CFG)
    older = (store / "store.json").read_text()
    ingest(built / "src" / "b", store, config=CFG)
    later = read_manifest(store).shards[-1].name
    (store / "store.json").write_text(older)
    assert len(open_store(store).series()) == 1 and verify_store(store).ok  # the other series is invisible
    proc = medload("repair", store, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"adopted   shard {later}" in proc.stdout and "nothing else to repair" in proc.stdout
    assert [e.name for e in read_manifest(store).shards][-1] == later
    assert all(_same_data(store, built / "store", _key(store, n)) for n in (6, 8))
    report = verify_store(store)
    assert report.ok and report.notes == [] and report.series == 2
