"""``verify_store`` on real stores with real damage: each test fails if the check it targets were missing."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np
import pytest

from medload.config import IngestConfig
from medload.ingest.run import ingest
from medload.storage.keys import slice_key
from medload.storage.manifest import file_digest, read_manifest, shard_path, write_manifest
from medload.storage.records import SeriesRecord
from medload.storage.verify import verify_store
from medload.synthetic import SeriesSpec, make_rtstruct, make_series

_KEY = "8899aabbccddeeff00112233445566778899aabbccddeeff0011223344556677\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Sources of two series (8 and 6 slices, in folders a/ and b/; an RTSTRUCT for a in labels/) and a store
    built from them, with lung window planes."""
    root = tmp_path_factory.mktemp("verify")
    (root / "key").write_text(_KEY)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEDLOAD_KEY_FILE", str(root / "key"))
        gen = make_series(root / "src" / "a", SeriesSpec(n_slices=8, rows=24, cols=20), seed=1, series_number=1)
        square = np.array([[5.5, 5.5], [12.5, 5.5], [12.5, 14.5], [5.5, 14.5]])
        make_rtstruct(gen, {"Liver": [(z, [square]) for z in (2, 3, 4)]}, root / "src" / "labels" / "rt.dcm")
        make_series(root / "src" / "b", SeriesSpec(n_slices=6, rows=24, cols=20), seed=2, series_number=2)
        ingest(root / "src", root / "store", config=IngestConfig(workers=1, windows=("lung",)))
    return root


@pytest.fixture
def store(built, tmp_path, monkeypatch) -> Path:
    """A private copy of the built store (tests damage it)."""
    monkeypatch.setenv("MEDLOAD_KEY_FILE", str(built / "key"))
    shutil.copytree(built / "store", tmp_path / "store")
    return tmp_path / "store"


def _records(store: Path) -> dict[int, SeriesRecord]:
    """Series records by depth (8: series a, 6: series b), read straight from the shard."""
    env = lmdb.open(str(_shard_dir(store)), readonly=True, lock=False, max_dbs=64)
    try:
        with env.begin() as txn:
            db = env.open_db(b"series", txn=txn, create=False)
            recs = [SeriesRecord.from_json(v) for _, v in txn.cursor(db=db)]
    finally:
        env.close()
    return {r.shape[0]: r for r in recs}


def _shard_dir(store: Path) -> Path:
    (entry,) = read_manifest(store).shards
    return shard_path(store, entry.name)


def _edit_shard(store: Path, edit) -> None:
    """Change the published shard with LMDB, then make store.json agree, so only the key-level checks can tell."""
    path = _shard_dir(store)
    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=64)
    try:
        with env.begin(write=True) as txn:
            edit(env, txn)
    finally:
        env.close()
    (path / "lock.mdb").unlink(missing_ok=True)
    manifest = read_manifest(store)
    data = path / "data.mdb"
    manifest.shards = [replace(manifest.shards[0], bytes=data.stat().st_size, digest=file_digest(data))]
    write_manifest(store, manifest)


def test_clean_store_verifies(store):
    report = verify_store(store, progress=True)
    assert report.ok, report.damage
    assert (report.shards, report.series, report.slices, report.labels) == (1, 2, 14, 1)
    assert report.notes == []


def test_flipped_byte_in_a_value_names_the_slice_and_the_shard(store):
    rec = _records(store)[8]
    path = _shard_dir(store)
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=64)
    with env.begin() as txn:
        value = bytes(txn.get(slice_key(rec.key_bytes, 2), db=env.open_db(b"slices", txn=txn, create=False)))
    env.close()
    data = bytearray((path / "data.mdb").read_bytes())
    hits, at = 0, data.find(value)
    while at >= 0:  # LMDB may keep stale copies of a page: damage every one
        data[at + len(value) // 2] ^= 0x40
        hits, at = hits + 1, data.find(value, at + 1)
    assert hits >= 1
    (path / "data.mdb").write_bytes(bytes(data))

    report = verify_store(store)
    assert not report.ok
    where = {(d.kind, d.where) for d in report.damage}
    assert ("slice", f"{rec.key} z=2") in where
    assert ("shard", path.name[: -len(".lmdb")]) in where
    assert all(rec.key in d.where or d.kind == "shard" for d in report.damage)


def test_deleted_slice_key_is_named_with_its_z(store):
    rec = _records(store)[8]
    _edit_shard(store, lambda env, txn: txn.delete(slice_key(rec.key_bytes, 3), db=env.open_db(b"slices", txn=txn)))
    report = verify_store(store)
    assert [(d.kind, d.where) for d in report.damage] == [("slice", rec.key)]
    assert "missing slice 3 of 8" in report.damage[0].detail


def test_truncated_shard_is_named_and_not_read(store):
    data = _shard_dir(store) / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    report = verify_store(store)
    name = _shard_dir(store).name[: -len(".lmdb")]
    assert not report.ok
    assert {d.kind for d in report.damage} == {"shard"} and {d.where for d in report.damage} == {name}
    assert any("store.json says" in d.detail for d in report.damage)  # the manifest's size
    assert any("LMDB needs" in d.detail for d in report.damage)  # and LMDB's own page count: never read past the end


def test_missing_window_plane_and_label_slice(store):
    a, b = _records(store)[8], _records(store)[6]

    def delete(env, txn):
        txn.delete(slice_key(b.key_bytes, 5), db=env.open_db(b"win_lung", txn=txn))
        txn.delete(slice_key(a.key_bytes, 2), db=env.open_db(b"labels", txn=txn))

    _edit_shard(store, delete)
    report = verify_store(store)
    assert sorted((d.kind, d.where) for d in report.damage) == [("label", a.key), ("slice", b.key)]
    details = " | ".join(d.detail for d in report.damage)
    assert "missing slice 5 of 6 in win_lung" in details and "missing label slice 2 of 8 in labels" in details


def test_index_entry_pointing_nowhere(store):
    ghost = bytes(range(16))
    _edit_shard(store, lambda env, txn: txn.put(b"CT", ghost, db=env.open_db(b"idx_modality", txn=txn, dupsort=True),
                                                dupdata=True))
    report = verify_store(store)
    assert [d.kind for d in report.damage] == ["index"]
    assert "idx_modality" in report.damage[0].where and ghost.hex() in report.damage[0].detail


def test_series_missing_from_an_index(store):
    rec = _records(store)[6]
    _edit_shard(store, lambda env, txn: txn.delete(rec.modality.encode(), rec.key_bytes,
                                                   db=env.open_db(b"idx_modality", txn=txn, dupsort=True)))
    report = verify_store(store)
    assert [(d.kind, d.where) for d in report.damage] == [("index", rec.key)]


def test_stray_slice_without_a_series_record_is_an_orphan(store):
    rec = _records(store)[6]
    ghost = bytes(range(100, 116))

    def put_stray(env, txn):
        db = env.open_db(b"slices", txn=txn)
        txn.put(slice_key(ghost, 0), txn.get(slice_key(rec.key_bytes, 0), db=db), db=db)

    _edit_shard(store, put_stray)
    report = verify_store(store)
    assert [(d.kind, d.where) for d in report.damage] == [("orphan", ghost.hex())]


def test_unlisted_shard_is_a_note_not_damage(store):
    shutil.copytree(_shard_dir(store), store / "shards" / "leftover.lmdb")
    report = verify_store(store)
    assert report.ok
    assert [(d.kind, d.where) for d in report.notes] == [("orphan", "shards/leftover.lmdb")]


def test_damaged_manifest(store):
    (store / "store.json").write_text("{not json")
    report = verify_store(store)
    assert [d.kind for d in report.damage] == ["manifest"]


def test_deep_finds_a_modified_source_file(built, store, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(built / "src", src)
    recs = _records(store)
    assert verify_store(store, deep=True, sources=[src]).ok

    only_b = verify_store(store, deep=True, sources=[src / "b"])  # a's sources not given: a note, not damage
    assert only_b.ok and [(d.kind, d.where) for d in only_b.notes] == [("source", recs[8].key)]

    changed = sorted((src / "a").rglob("*.dcm"))[4]
    data = bytearray(changed.read_bytes())
    data[-1] ^= 0x01  # one pixel byte
    changed.write_bytes(bytes(data))
    report = verify_store(store, deep=True, sources=[src])
    assert [(d.kind, d.where) for d in report.damage] == [("source", recs[8].key)]
    assert "1 of 8 source slices" in report.damage[0].detail and str(changed) in report.damage[0].detail


def test_swapped_slices_pass_their_checksums_but_not_the_series_digest(store):
    rec = _records(store)[8]

    def swap(env, txn):
        db = env.open_db(b"slices", txn=txn)
        one, two = (bytes(txn.get(slice_key(rec.key_bytes, z), db=db)) for z in (1, 2))
        txn.put(slice_key(rec.key_bytes, 1), two, db=db)
        txn.put(slice_key(rec.key_bytes, 2), one, db=db)

    _edit_shard(store, swap)
    report = verify_store(store)
    assert [(d.kind, d.where) for d in report.damage] == [("series", rec.key)]
    assert "content digest" in report.damage[0].detail
