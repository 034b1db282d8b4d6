"""A store shared with a group stays readable by the group's members through every write of its owner
(ingest, ingest --force, compact, repair); one that is not shared with a user says so in one line.

The reader runs as another user (uid 65534, "nobody") in a subprocess started by ``setpriv``, with only the
store's group as a supplementary group: that needs root, which the tests here run as (CI containers);
elsewhere they skip.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import DATA, PHILIPS, REPO, flip_stored_value

from medload.config import IngestConfig
from medload.ingest.repair import repair_store
from medload.ingest.run import ingest
from medload.storage.compact import compact_store
from medload.storage.keys import slice_key
from medload.storage.manifest import read_manifest, shard_path
from medload.storage.store import open_store

pytestmark = [pytest.mark.slow,  # about a minute on 2 cores
              pytest.mark.skipif(os.geteuid() != 0, reason="reading as another user needs root, to switch to uid "
                                                           "65534 with the store's group (CI runs the tests as root)")]

NOBODY = 65534
TEAM = 4242  # a group id of no one: the store's group, and the reader's only supplementary group
MEDLOAD = [sys.executable, "-m", "medload.cli"]
READER = """
import hashlib, json, sys
from medload import open_store
from medload.errors import MedloadError
try:
    store = open_store(sys.argv[1])
    print(json.dumps({r.key: hashlib.sha256(store.read(r.key).tobytes()).hexdigest() for r in store.series()}))
except MedloadError as exc:
    print(f"{type(exc).__name__}: {exc}")
    sys.exit(3)
"""


@pytest.fixture
def public_tmp():
    """A folder every user may traverse (pytest's tmp_path may sit under a folder only its owner enters)."""
    path = Path(tempfile.mkdtemp(prefix="medload-share-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _as_member(args: list[str], group: int = TEAM) -> subprocess.CompletedProcess:
    """Run ``args`` as uid 65534 in group 65534, with ``group`` as its one supplementary group."""
    if shutil.which("setpriv") is None:
        pytest.skip(reason="needs setpriv (util-linux) to run the reader as another user")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/nonexistent"}
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", f"--groups={group}", *args],
                          capture_output=True, text=True, env=env, cwd="/")


def _read_as_member(store: Path, group: int = TEAM) -> subprocess.CompletedProcess:
    proc = _as_member([sys.executable, "-c", READER, str(store)], group)
    if proc.returncode not in (0, 3) and "medload" not in proc.stderr:
        pytest.skip(reason=f"uid {NOBODY} cannot run this Python here: {proc.stderr.strip()[-300:]}")
    return proc


def _owner_reads(store: Path) -> dict[str, str]:
    s = open_store(store)
    return {r.key: hashlib.sha256(s.read(r.key).tobytes()).hexdigest() for r in s.series()}


def test_a_store_shared_by_hand_stays_shared_through_ingest_compact_and_repair(public_tmp):
    store = public_tmp / "store"
    ingest(PHILIPS / "dicom", store, config=IngestConfig(workers=1))
    subprocess.run(["chgrp", "-R", str(TEAM), str(store)], check=True)  # the administrator shares it
    subprocess.run(["chmod", "-R", "go+rX", str(store)], check=True)
    assert json.loads(_read_as_member(store).stdout) == _owner_reads(store)

    ingest(DATA / "ge_ct_3slice_seg" / "ct-3slice", store, config=IngestConfig(workers=1))  # a new shard
    philips = open_store(store).series()[-1].key
    ingest(PHILIPS / "dicom", store, config=IngestConfig(workers=1), force=[philips])  # supersedes a copy
    assert [s.superseded for s in compact_store(store).shards] == [1]
    flip_stored_value(shard_path(store, read_manifest(store).shards[-1].name), slice_key(bytes.fromhex(philips), 5))
    (store / "store.json").unlink()
    result = repair_store(store, [PHILIPS / "dicom"])  # restores store.json, ingests the damaged series again
    assert result.restored and result.after.ok

    proc = _read_as_member(store)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout) == _owner_reads(store) and len(json.loads(proc.stdout)) == 2
    assert read_manifest(store).share == "group"  # recorded: the owner's next write keeps it
    for top, dirs, files in os.walk(store):
        for name in [*dirs, *files]:
            info = (Path(top) / name).lstat()
            assert info.st_gid == TEAM and info.st_mode & stat.S_IRGRP, f"{Path(top) / name} is not the group's"
            assert not info.st_mode & 0o007, f"{Path(top) / name} is open to every user"


def test_a_store_not_shared_with_a_user_says_so_in_one_line(public_tmp):
    store = public_tmp / "store"
    ingest(PHILIPS / "dicom", store, config=IngestConfig(workers=1))  # its owner's only, by default
    store.chmod(0o755)  # even where the folder lets the user in, the files do not
    proc = _read_as_member(store)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # a MedloadError, not a raw PermissionError
    assert proc.stdout.startswith("StorePermissionError: cannot read ") and "store.json" in proc.stdout
    assert f"medload share {store} --group" in proc.stdout
    cli = _as_member([*MEDLOAD, "info", str(store)])
    assert cli.returncode == 2 and "Traceback" not in cli.stderr
    assert len(cli.stderr.splitlines()) == 1 and "store.json: permission denied" in cli.stderr, cli.stderr

    for path in (store, store / "store.json", store / "shards"):  # shared by hand, but for a shard
        os.chown(path, -1, TEAM)
        path.chmod(path.stat().st_mode | stat.S_IRGRP | (stat.S_IXGRP if path.is_dir() else 0))
    proc = _read_as_member(store)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.startswith("StorePermissionError: cannot read ") and "data.mdb" in proc.stdout


def test_share_sets_who_reads_the_store(public_tmp):
    team = grp.getgrnam("users").gr_gid if "users" in {g.gr_name for g in grp.getgrall()} else None
    if team is None:
        pytest.skip(reason="needs a group named users, to share with it by name")
    store = public_tmp / "store"
    created = subprocess.run([*MEDLOAD, "ingest", str(PHILIPS / "dicom"), str(store), "--workers", "1",
                              "--no-progress", "--share", "group:users"], capture_output=True, text=True)
    assert created.returncode == 0, created.stderr
    assert read_manifest(store).share == "group:users" and store.stat().st_gid == team
    assert _read_as_member(store, team).returncode == 0

    private = subprocess.run([*MEDLOAD, "share", str(store), "--private"], capture_output=True, text=True)
    assert private.returncode == 0, private.stderr
    assert read_manifest(store).share == "private"
    store.chmod(0o755)
    assert _read_as_member(store, team).stdout.startswith("StorePermissionError: ")

    shared = subprocess.run([*MEDLOAD, "share", str(store), "--group", "users"], capture_output=True, text=True)
    assert shared.returncode == 0 and "readable by group users" in shared.stdout, shared.stderr
    assert _read_as_member(store, team).returncode == 0
