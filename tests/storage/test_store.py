"""The store layer on a real LMDB on disk: value format, writer transactions, recovery, reads."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from medload.errors import ChecksumError, ConfigError, SeriesNotFoundError, StoreFormatError, StoreLockedError
from medload.storage.codec import CODECS, decode_value, encode_value, get_codec
from medload.storage.keys import series_key, slice_key, split_slice_key
from medload.storage.manifest import file_digest
from medload.storage.records import SeriesRecord
from medload.storage.store import open_store
from medload.storage.writer import StoreWriter

_DTYPES = st.sampled_from([np.int16, np.uint8, np.uint16, np.float32])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(CODECS)), _DTYPES.flatmap(
    lambda dt: arrays(dt, st.tuples(st.integers(1, 40), st.integers(1, 40)),
                      elements={"allow_nan": False} if dt == np.float32 else None)))
def test_codec_round_trip(codec_name, array):
    value = encode_value(array, get_codec(codec_name))
    out = decode_value(value)
    assert out.dtype == array.dtype and np.array_equal(out, array)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 7))
def test_any_flipped_bit_is_detected(position, bit):
    value = bytearray(encode_value(np.arange(400, dtype=np.int16).reshape(20, 20), get_codec("blosc2-lz4")))
    position %= len(value)
    value[position] ^= 1 << bit
    with pytest.raises((ChecksumError, StoreFormatError)):
        decode_value(bytes(value))


def test_slice_keys_sort_by_series_then_z():
    a, b = series_key("p1", "d"), series_key("p2", "d")
    keys = [slice_key(k, z) for k in (a, b) for z in (0, 1, 255, 256, 70000)]
    assert sorted(keys) == sorted(keys, key=lambda k: (k[:16], split_slice_key(k)[1]))
    assert split_slice_key(slice_key(a, 70000)) == (a, 70000)
    assert series_key("p1", "d") != series_key("p1", "e")


def _record(key: bytes, depth: int, rows: int = 6, cols: int = 5) -> SeriesRecord:
    return SeriesRecord(key=key.hex(), shape=(depth, rows, cols), dtype="int16", spacing=(1.0, 1.0, 2.0),
                        affine=tuple(tuple(r) for r in np.eye(4).tolist()), modality="CT", digest="d",
                        orientation=(1, 0, 0, 0, 1, 0), positions=tuple((0.0, 0.0, 2.0 * z) for z in range(depth)),
                        patient="p", study="s", series="x", source_fingerprint="f" + key.hex(),
                        sources=tuple("0" * 16 for _ in range(depth)))


def _write(root, volumes: dict[bytes, np.ndarray], **kw) -> None:
    with StoreWriter(root, codec="blosc2-lz4", windows=(), key_fingerprint="k", **kw) as writer:
        for key, vol in volumes.items():
            txn = writer.begin_series(key, vol.nbytes)
            for z, plane in enumerate(vol):
                txn.put_slice(z, encode_value(plane, get_codec("blosc2-lz4")))
            txn.commit(_record(key, len(vol), *vol.shape[1:]), {"modality": "CT", "study": "s"})


@pytest.fixture
def volumes():
    rng = np.random.default_rng(0)
    return {series_key(f"p{i}", "d"): rng.integers(-1024, 3000, (4 + i, 6, 5)).astype(np.int16) for i in range(3)}


def test_range_reads_equal_slice_reads(tmp_path, volumes):
    _write(tmp_path / "s", volumes)
    store = open_store(tmp_path / "s")
    assert [r.key_bytes for r in store.series()] == sorted(volumes)
    for key, vol in volumes.items():
        assert np.array_equal(store.read(key), vol)
        for z0 in range(len(vol)):
            for z1 in range(z0 + 1, len(vol) + 1):
                assert np.array_equal(store.read(key, z0, z1), vol[z0:z1])
        with pytest.raises(ConfigError, match="outside series"):
            store.read(key, len(vol) - 1, len(vol) + 1)


def test_key_prefixes_and_unknown_keys(tmp_path, volumes):
    _write(tmp_path / "s", volumes)
    store = open_store(tmp_path / "s")
    key = sorted(volumes)[0]
    assert store.record(key.hex()[:10]).key == key.hex()
    assert store.record(key).key == key.hex()
    with pytest.raises(SeriesNotFoundError, match="medload ls"):
        store.record("ffffffffffffff")


def test_store_pickles_to_its_path_and_reopens_after_fork(tmp_path, volumes):
    _write(tmp_path / "s", volumes)
    store = open_store(tmp_path / "s")
    key = sorted(volumes)[0]
    store.read(key)
    clone = pickle.loads(pickle.dumps(store))
    assert pickle.dumps(store) == pickle.dumps(clone) and len(pickle.dumps(store)) < 400
    assert np.array_equal(clone.read(key), volumes[key])
    script = textwrap.dedent(f"""
        import os, pickle, sys
        import numpy as np
        store = pickle.loads({pickle.dumps(store)!r})
        a = store.read(bytes.fromhex("{key.hex()}"))
        pid = os.fork()
        if pid == 0:
            b = store.read(bytes.fromhex("{key.hex()}"))
            os._exit(0 if np.array_equal(a, b) else 1)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0


def test_a_second_writer_is_refused(tmp_path):
    with StoreWriter(tmp_path / "s", codec="raw", windows=(), key_fingerprint="k"), \
            pytest.raises(StoreLockedError, match=rf"another medload process \(pid {os.getpid()} on "):
        StoreWriter(tmp_path / "s", codec="raw", windows=(), key_fingerprint="k")


def test_other_key_codec_or_windows_are_refused(tmp_path):
    StoreWriter(tmp_path / "s", codec="raw", windows=(), key_fingerprint="k").close()
    with pytest.raises(ConfigError, match="key-file"):
        StoreWriter(tmp_path / "s", codec="raw", windows=(), key_fingerprint="other")
    with pytest.raises(ConfigError, match="codec"):
        StoreWriter(tmp_path / "s", codec="blosc2-lz4", windows=(), key_fingerprint="k")
    with pytest.raises(ConfigError, match="windows"):
        StoreWriter(tmp_path / "s", codec="raw", windows=("lung",), key_fingerprint="k")


def test_newer_format_version_is_refused(tmp_path, volumes):
    _write(tmp_path / "s", volumes)
    manifest = tmp_path / "s" / "store.json"
    doc = json.loads(manifest.read_text())
    doc["version"] = 99
    manifest.write_text(json.dumps(doc))
    with pytest.raises(StoreFormatError, match="version 99"):
        open_store(tmp_path / "s")
    with pytest.raises(StoreFormatError, match="not a medload store"):
        open_store(tmp_path)


def test_a_version_1_store_is_read_and_upgraded_by_its_next_writer(tmp_path, volumes):
    """Version 2 only added the ``replaced`` sub-database, which a version-1 store lacks; version 3 the key
    lists of store.json, which its next writer fills in."""
    keys = sorted(volumes)
    _write(tmp_path / "s", {k: volumes[k] for k in keys[:1]})
    manifest = tmp_path / "s" / "store.json"
    doc = json.loads(manifest.read_text())
    doc["version"] = 1
    manifest.write_text(json.dumps(doc))
    assert open_store(tmp_path / "s").manifest.version == 1
    assert len(open_store(tmp_path / "s").series()) == 1
    _write(tmp_path / "s", {k: volumes[k] for k in keys[1:2]})
    doc = json.loads(manifest.read_text())
    assert doc["version"] == 3 and all(len(entry["keys"]["series"]) == 1 for entry in doc["shards"])
    assert len(open_store(tmp_path / "s").series()) == 2


def _crash_while_writing(root, volumes, die_in: int) -> None:
    """Run a writer in a child process that dies (os._exit) inside the transaction of series ``die_in``."""
    keys = sorted(volumes)
    script = textwrap.dedent(f"""
        import os, numpy as np
        from medload.storage.codec import encode_value, get_codec
        from medload.storage.writer import StoreWriter
        from test_store import _record
        vols = {{bytes.fromhex(k): np.array(v, dtype=np.int16) for k, v in {[(k.hex(), volumes[k].tolist()) for k in keys]!r}}}
        w = StoreWriter({str(root)!r}, codec="blosc2-lz4", windows=(), key_fingerprint="k")
        for i, (key, vol) in enumerate(vols.items()):
            txn = w.begin_series(key, vol.nbytes)
            for z, plane in enumerate(vol):
                txn.put_slice(z, encode_value(plane, get_codec("blosc2-lz4")))
            if i == {die_in}:
                os._exit(9)
            txn.commit(_record(key, len(vol), *vol.shape[1:]), {{}})
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=str(Path(__file__).parent))
    assert run.returncode == 9


def test_uncommitted_series_is_absent_and_committed_ones_survive_a_crash(tmp_path, volumes):
    """A writer killed mid-run: committed series are published by the next writer, the open one is gone."""
    keys = sorted(volumes)
    _crash_while_writing(tmp_path / "s", volumes, die_in=2)
    assert open_store(tmp_path / "s").series() == []  # nothing published yet
    with StoreWriter(tmp_path / "s", codec="blosc2-lz4", windows=(), key_fingerprint="k") as writer:
        assert set(writer.series_fingerprints) == set(keys[:2])
    store = open_store(tmp_path / "s")
    assert [r.key_bytes for r in store.series()] == keys[:2]
    for key in keys[:2]:
        assert np.array_equal(store.read(key), volumes[key])
    assert not list((tmp_path / "s" / "staging").iterdir())


def test_shards_roll_over_and_series_never_span_shards(tmp_path, volumes):
    _write(tmp_path / "s", volumes, shard_bytes=1)  # every series closes its shard
    store = open_store(tmp_path / "s")
    assert len(store.manifest.shards) == 3
    assert sorted(r.shard for r in store.series()) == sorted(s.name for s in store.manifest.shards)
    for entry in store.manifest.shards:  # what a hot copy is checked against
        data = tmp_path / "s" / "shards" / f"{entry.name}.lmdb" / "data.mdb"
        assert entry.bytes == data.stat().st_size and entry.digest == file_digest(data)
    for key, vol in volumes.items():
        assert np.array_equal(store.read(key), vol)


def test_store_files_are_owner_only(tmp_path, volumes):
    _write(tmp_path / "s", volumes)
    for path in (tmp_path / "s").rglob("*"):
        mode = path.stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"


def test_store_json_is_the_manifest_fields_and_reads_back(tmp_path):
    """store.json, built without dataclasses.asdict: the same document asdict gives (every field, keys and
    their lists, a shard without keys as null), and it reads back to the same manifest."""
    import dataclasses
    import json

    from medload.storage.manifest import FORMAT_NAME, Manifest, ShardEntry, ShardKeys

    manifest = Manifest(codec="blosc2-lz4", windows=("lung", "bone"), key_fingerprint="f" * 32, created_by="medload x",
                        shards=[ShardEntry("a", 2, 10, "d" * 32, ShardKeys(("01", "02"), ("03",), ("04",))),
                                ShardEntry("b", 0, 5, "e" * 32, None)], share="private")
    text = manifest.to_json()
    assert text == json.dumps({"format": FORMAT_NAME, **dataclasses.asdict(manifest)}, indent=2, sort_keys=True) + "\n"
    assert Manifest.from_json(text, tmp_path / "store.json") == manifest
