"""The pseudonymisation key file: created only where asked, never for a store it cannot match, never shared.

A new key gives every patient new pseudonyms, so a typo in a key path must be an error, not a new key;
a store built with one key must not leave a useless new key behind when given another path; and a key
file others can read is refused as a credentials file is (see :mod:`medload.deid`).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_key

from medload.deid import KeyFile, Pseudonymizer, load_key
from medload.errors import ConfigError
from medload.ingest.run import ingest
from medload.storage.manifest import read_manifest
from medload.synthetic import SeriesSpec, make_series

MEDLOAD = [sys.executable, "-m", "medload.cli"]
ERROR = 2
KEY_B = "ff" * 32


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A small series in src/ and a store of it, built with the session's key (key A)."""
    root = tmp_path_factory.mktemp("keys")
    make_series(root / "src", SeriesSpec(n_slices=3, rows=16, cols=16), seed=1)
    ingest(root / "src", root / "store")
    return root


def _medload(*args, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*MEDLOAD, *map(str, args)], capture_output=True, text=True, env=env)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line a refused command ends with (exit 2, no traceback)."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == ERROR and len(lines) == 1 and lines[0].startswith("error: "), proc.stdout + proc.stderr
    return lines[0]


def _env(home: Path, key: Path | None) -> dict[str, str]:
    """A user whose home is ``home``, with ``$MEDLOAD_KEY_FILE`` set to ``key`` (unset for None); wide lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("MEDLOAD_KEY_FILE", "XDG_CONFIG_HOME")}
    env.update(HOME=str(home), COLUMNS="400")
    return env if key is None else {**env, "MEDLOAD_KEY_FILE": str(key)}


@pytest.mark.parametrize("given", ["--key-file", "MEDLOAD_KEY_FILE"])
@pytest.mark.parametrize("folder", ["exists", "typo"])
def test_a_given_key_path_that_does_not_exist_is_an_error_that_creates_nothing(built, tmp_path, given, folder):
    """The issue: ``MEDLOAD_KEY_FILE=/nonexistent/dir/k.key medload ingest`` created the folders and a key."""
    key = (tmp_path if folder == "exists" else tmp_path / "no" / "such") / "k.key"
    home = tmp_path / "home"
    args = ["ingest", built / "src", tmp_path / "store", "--no-progress"]
    proc = _medload(*args, *(["--key-file", key] if given == "--key-file" else []),
                    env=_env(home, key if given == "MEDLOAD_KEY_FILE" else None))
    line = _error_line(proc)
    named = "--key-file" if given == "--key-file" else "$MEDLOAD_KEY_FILE"
    assert f"pseudonymisation key {key} (from {named}) does not exist" in line
    assert "add --new-key" in line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == []  # no key, folder, store or home


def test_new_key_creates_the_given_key_in_an_existing_folder_only(built, tmp_path):
    key = tmp_path / "keys" / "k.key"
    with pytest.raises(ConfigError, match=f"the folder {key.parent} does not exist"):
        ingest(built / "src", tmp_path / "store", key_file=KeyFile(key, new=True))
    assert sorted(tmp_path.iterdir()) == []
    key.parent.mkdir(mode=0o700)
    assert ingest(built / "src", tmp_path / "store", key_file=KeyFile(key, new=True)).counts["ingested"] == 1
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    made = Pseudonymizer(load_key(key)).fingerprint
    assert read_manifest(tmp_path / "store").key_fingerprint == made
    again = ingest(built / "src", tmp_path / "store", key_file=KeyFile(key, new=True))  # an existing key is used
    assert again.counts["present"] == 1 and Pseudonymizer(load_key(key)).fingerprint == made


def test_the_default_key_is_created_on_a_first_ingest_with_no_options(built, tmp_path):
    """The zero-configuration first run (``make demo``): no option, no variable, a fresh home."""
    proc = _medload("ingest", built / "src", tmp_path / "store", "--no-progress", env=_env(tmp_path / "home", None))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    key = tmp_path / "home" / ".config" / "medload" / "pseudonym.key"
    assert "created a new pseudonymisation key" in proc.stderr
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("where", ["default", "given", "given --new-key"])
def test_an_existing_store_with_its_key_missing_names_its_fingerprint_and_creates_no_key(built, tmp_path, where):
    """The store was built with key A; a path where no key is could only get a new key, which could never
    match the store: refused before anything is written (the old code wrote the key, then refused it)."""
    recorded = read_manifest(built / "store").key_fingerprint
    home, key = tmp_path / "home", tmp_path / "fresh.key"
    options = [] if where == "default" else ["--key-file", key] + (["--new-key"] if "new" in where else [])
    proc = _medload("ingest", built / "src", built / "store", *options, "--no-progress", env=_env(home, None))
    looked = home / ".config" / "medload" / "pseudonym.key" if where == "default" else key
    line = _error_line(proc)
    assert f"{built / 'store'} was built with pseudonymisation key {recorded}, and there is no key file at {looked}" \
        in line
    assert sorted(tmp_path.iterdir()) == []


def test_another_existing_key_is_refused_naming_both_fingerprints_and_the_key(built, tmp_path):
    other = write_key(tmp_path / "b.key", KEY_B)
    recorded = read_manifest(built / "store").key_fingerprint
    used = Pseudonymizer(bytes.fromhex(KEY_B)).fingerprint
    with pytest.raises(ConfigError, match=f"built with pseudonymisation key {recorded}, this run uses {used} "
                                          rf"\(the key in {other}\)"):
        ingest(built / "src", built / "store", key_file=other)


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640])
def test_a_key_others_may_read_is_refused_as_a_credentials_file_is(built, tmp_path, mode):
    key = write_key(tmp_path / "k.key", KEY_B)
    key.chmod(mode)
    proc = _medload("ingest", built / "src", tmp_path / "store", "--key-file", key, "--no-progress",
                    env=_env(tmp_path / "home", None))
    line = _error_line(proc)
    assert f"pseudonymisation key {key} is readable or writable by other users (mode {mode:04o})" in line
    assert f"run `chmod 600 {key}`, or pass --allow-shared-key" in line
    assert not (tmp_path / "store").exists()


def test_allow_shared_key_uses_it_with_a_warning(built, tmp_path):
    key = write_key(tmp_path / "k.key", KEY_B)
    key.chmod(0o644)
    proc = _medload("ingest", built / "src", tmp_path / "store", "--key-file", key, "--allow-shared-key",
                    "--no-progress", env=_env(tmp_path / "home", None))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join(proc.stderr.split())
    assert "WARNING" in said and f"pseudonymisation key {key} is readable or writable by other users" in said
    assert read_manifest(tmp_path / "store").key_fingerprint == Pseudonymizer(bytes.fromhex(KEY_B)).fingerprint


def test_the_old_module_name_still_works_with_a_deprecation_warning():
    import importlib
    import sys

    sys.modules.pop("medload.ingest.deid", None)
    with pytest.warns(DeprecationWarning, match="medload.ingest.deid moved to medload.deid"):
        old = importlib.import_module("medload.ingest.deid")
    assert old.Pseudonymizer is Pseudonymizer and old.load_key is load_key
