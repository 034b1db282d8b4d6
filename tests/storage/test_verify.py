"""``verify_store`` on real stores with real damage: each test fails if the check it targets were missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import lmdb
import numpy as np
import pytest
from conftest import flip_stored_value, write_key

from medload.config import IngestConfig
from medload.errors import ConfigError
from medload.ingest.run import ingest
from medload.storage.keys import slice_key
from medload.storage.manifest import file_digest, read_manifest, shard_path, write_manifest
from medload.storage.records import SeriesRecord
from medload.storage.shard import close_reader_envs
from medload.storage.verify import verify_store
from medload.synthetic import SeriesSpec, make_rtstruct, make_series

_KEY = "8899aabbccddeeff00112233445566778899aabbccddeeff0011223344556677"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Sources of two series (8 and 6 slices, in folders a/ and b/; an RTSTRUCT for a in labels/) and a store
    built from them, with lung window planes."""
    root = tmp_path_factory.mktemp("verify")
    write_key(root / "key", _KEY)
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
    close_reader_envs([path])  # LMDB allows one handle per process: drop a reader's
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
    assert flip_stored_value(path, slice_key(rec.key_bytes, 2)) >= 1

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
    recs = _records(store)
    data = _shard_dir(store) / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    report = verify_store(store)
    name = _shard_dir(store).name[: -len(".lmdb")]
    assert not report.ok and report.unreadable == [name]
    shard_level = [d for d in report.damage if d.kind == "shard"]
    assert {d.where for d in shard_level} == {name} and all(d.unreadable for d in shard_level)
    assert any("store.json says" in d.detail for d in shard_level)  # the manifest's size
    assert any("LMDB needs" in d.detail for d in shard_level)  # and LMDB's own page count: never read past the end
    lost = sorted((d.kind, d.series) for d in report.damage if d.kind != "shard")  # from store.json's key lists
    assert lost == sorted([("label", recs[8].key), ("series", recs[8].key), ("series", recs[6].key)])


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


def test_a_store_of_a_newer_format_is_not_called_damaged(store):
    """A newer medload's store: one line saying to upgrade, exit 3, from verify as from every command."""
    doc = json.loads((store / "store.json").read_text())
    doc["version"] = 4
    (store / "store.json").write_text(json.dumps(doc))
    for args in (("verify", store, "--no-progress"), ("repair", store, "--no-progress"), ("ls", store)):
        proc = subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 3 and "DAMAGED" not in proc.stdout, (args, proc.stdout, proc.stderr)
        assert proc.stderr.strip() == (f"error: {store / 'store.json'} was written by a newer medload (store format "
                                       "version 4, this medload reads up to version 3): upgrade medload to use it")
    assert json.loads((store / "store.json").read_text()) == doc  # repair left it as it was


def test_deep_finds_a_modified_source_file(built, store, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(built / "src", src)
    recs = _records(store)
    with pytest.raises(ConfigError):
        verify_store(store, deep=True)  # deep needs the sources
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


def test_a_b_tree_pointing_past_the_file_kills_a_child_not_the_verifier(store):
    """A damaged node offset in a dupsort index page makes LMDB read past the end of the mapped file:
    SIGBUS, not an error. A shard whose digest differs is read in a child process, so verify survives it."""
    import struct

    patient = _records(store)[6].patient.encode()
    data_path = _shard_dir(store) / "data.mdb"
    data, hits = bytearray(data_path.read_bytes()), 0
    for page in range(0, len(data), 4096):  # MDB_page: pgno u64, pad u16, flags u16, lower u16, upper u16, ptrs
        flags, lower = struct.unpack_from("<HH", data, page + 10)
        for i in range(16, lower, 2) if flags & 0x02 else ():  # P_LEAF
            node = page + struct.unpack_from("<H", data, page + i)[0]  # MDB_node: lo, hi, flags, ksize, key, data
            lo, _, node_flags, ksize = struct.unpack_from("<HHHH", data, node)
            if node_flags & 0x04 and data[node + 8 : node + 8 + ksize] == patient:  # F_DUPDATA: a sub-page follows
                sub = node + 8 + ksize
                struct.pack_into("<H", data, sub + 16, 0xFFF0)  # its first node "lies" 64 KB further on
                hits += 1
    assert hits >= 1
    data_path.write_bytes(bytes(data))
    report = verify_store(store)
    assert ("shard", _shard_dir(store).name[: -len(".lmdb")]) in {(d.kind, d.where) for d in report.damage}
    assert any("killed the reader" in d.detail for d in report.damage), report.damage


def test_a_key_in_two_shards_is_damage_unless_the_later_one_marks_it_replaced(store):
    a, b = _records(store)[8], _records(store)[6]
    first = read_manifest(store).shards[0]
    shutil.copytree(_shard_dir(store), store / "shards" / "copy.lmdb")
    manifest = read_manifest(store)
    manifest.shards.append(replace(first, name="copy"))
    write_manifest(store, manifest)
    dup = [(d.kind, d.where, d.shard) for d in verify_store(store).damage]
    assert sorted(dup) == [("label", a.key, "copy"), ("series", a.key, "copy"), ("series", b.key, "copy")]

    path = store / "shards" / "copy.lmdb"
    close_reader_envs([path])  # verify's handle: LMDB allows one per process
    env = lmdb.open(str(path), map_size=1 << 30, max_dbs=64)
    with env.begin(write=True) as txn:
        for rec in (a, b):
            txn.put(rec.key_bytes, b"", db=env.open_db(b"replaced", txn=txn))
    env.close()
    (path / "lock.mdb").unlink(missing_ok=True)
    data = path / "data.mdb"
    manifest.shards[1] = replace(first, name="copy", bytes=data.stat().st_size, digest=file_digest(data),
                                 keys=replace(first.keys, replaced=tuple(sorted([a.key, b.key]))))
    write_manifest(store, manifest)
    report = verify_store(store)
    assert report.ok, report.damage
    assert (report.series, report.slices, report.labels) == (2, 14, 1)  # the superseded copies are not checked
    assert sorted(d.where for d in report.notes) == sorted([a.key, b.key])
    assert all(f"superseded copy in shard {first.name}" in d.detail and "bytes reclaimable" in d.detail
               for d in report.notes)


def test_cli_verify_names_a_flipped_byte_a_deleted_key_and_a_truncated_shard(built, tmp_path, monkeypatch):
    """Acceptance (issue 7), through the real command: exit 1 and a line naming the series and z, or the shard."""
    monkeypatch.setenv("MEDLOAD_KEY_FILE", str(built / "key"))
    for name in ("clean", "flipped", "deleted", "truncated"):
        shutil.copytree(built / "store", tmp_path / name)
    a = _records(tmp_path / "clean")[8]
    shard = _shard_dir(tmp_path / "clean").name[: -len(".lmdb")]
    flip_stored_value(_shard_dir(tmp_path / "flipped"), slice_key(a.key_bytes, 2))
    _edit_shard(tmp_path / "deleted",
                lambda env, txn: txn.delete(slice_key(a.key_bytes, 3), db=env.open_db(b"slices", txn=txn)))
    data = _shard_dir(tmp_path / "truncated") / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)

    def verify(name: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "medload.cli", "verify", str(tmp_path / name), "--no-progress",
                               *args], capture_output=True, text=True)

    clean = verify("clean", "--json")
    assert clean.returncode == 0 and json.loads(clean.stdout)["ok"] is True
    flipped, deleted, truncated = verify("flipped"), verify("deleted"), verify("truncated")
    assert flipped.returncode == deleted.returncode == truncated.returncode == 1
    assert f"{a.key} z=2: value fails its xxh3_64 checksum" in flipped.stdout and shard in flipped.stdout
    assert f"{a.key}: missing slice 3 of 8" in deleted.stdout
    assert f"shard    {shard}: data.mdb is truncated" in truncated.stdout
    assert all("DAMAGED" in p.stdout.splitlines()[-1] for p in (flipped, deleted, truncated))
    assert verify("clean", "--deep").returncode == 2  # a usage error: --deep needs --sources
