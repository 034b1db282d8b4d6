"""One name per setting: a field of the config is its TOML key and, with dashes, its command-line flag;
the old spellings still work, with a warning, for one release."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import warnings

import click
import pytest
from conftest import REPO

from medload.config import RENAMED, CacheConfig, IngestConfig, load_config
from medload.errors import ConfigError
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

EVERY_KEY = """
[ingest]
workers = 3
codec = "zstd"
windows = ["bone"]
spacing_tolerance_mm = 0.2
spacing_tolerance_rel = 0.02
duplicate_tolerance_mm = 0.02
tilt_policy = "shear"
shard_bytes = "1GB"
max_frame_pixels = 1000
max_frames = 10
worker_memory = "2GB"
decode_timeout = 5
plausibility = "flag"
time_series = "reject"
label_min_kept = 0.25
strict = true
share = "group"

[cache]
l1_bytes = "1MB"
hot_dir = "/ssd/hot"
hot_budget = "2GB"
fetch = "never"
max_rate = "100MB"
verify = false
"""


def test_every_field_is_a_toml_key_of_the_same_name(tmp_path):
    path = tmp_path / "medload.toml"
    path.write_text(EVERY_KEY)
    cfg = load_config(path)
    for section, default in (("ingest", IngestConfig()), ("cache", CacheConfig())):
        loaded = getattr(cfg, section)
        for f in dataclasses.fields(default):
            assert getattr(loaded, f.name) != getattr(default, f.name), f"[{section}] {f.name} was not read"


def test_the_documented_config_example_uses_the_current_names(tmp_path):
    (block,) = re.findall(r"```toml\n(.*?)```", (REPO / "docs" / "cli.md").read_text(), re.S)
    path = tmp_path / "readme.toml"
    path.write_text(block)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an old key name would warn
        cfg = load_config(path)
    assert cfg.cache.l1_bytes == 512 * 10**6 and cfg.ingest.windows == ("lung", "soft_tissue")


@pytest.mark.parametrize(("section", "old", "new", "value", "expected"), [
    ("cache", "l1", "l1_bytes", '"1MB"', 10**6),
    ("ingest", "shard_size", "shard_bytes", '"2GB"', 2 * 10**9),
])
def test_old_toml_keys_still_work_and_warn(tmp_path, section, old, new, value, expected):
    assert RENAMED[section][old] == new
    path = tmp_path / "medload.toml"
    path.write_text(f"[{section}]\n{old} = {value}\n")
    with pytest.warns(DeprecationWarning, match=rf"\[{section}\]: {old} is now called {new}"):
        cfg = load_config(path)
    assert getattr(getattr(cfg, section), new) == expected
    path.write_text(f"[{section}]\n{old} = {value}\n{new} = {value}\n")
    with pytest.raises(ConfigError, match=rf"{old} and {new} are one setting: keep {new} only"):
        load_config(path)
    path.write_text(f'[{section}]\n{old} = "lots"\n')
    with pytest.warns(DeprecationWarning, match=old), pytest.raises(ConfigError, match=rf"\[{section}\]: {old} = 'lots'"):
        load_config(path)


def _commands(group: click.Group, path=()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield " ".join((*path, name)), cmd


def test_command_line_flags_of_settings_are_the_field_names_with_dashes():
    """Each visible option that holds a config setting is spelled --field-name; the hidden options are
    exactly the old spellings, each next to its new one."""
    from medload.cli import cli

    settings = {f.name for cls in (IngestConfig, CacheConfig) for f in dataclasses.fields(cls)}
    hidden, flags = {}, {}
    for name, cmd in _commands(cli):
        for p in cmd.params:
            if isinstance(p, click.Option) and p.hidden:
                hidden[(name, p.opts[0])] = p.name
            elif isinstance(p, click.Option) and p.name in settings:
                assert p.opts == ["--" + p.name.replace("_", "-")], (name, p.opts)
                flags.setdefault(name, set()).add(p.name)
    assert {"shard_bytes", "windows", "workers", "worker_memory", "strict"} <= flags["ingest"]
    assert flags["cache warm"] == {"hot_dir", "hot_budget", "max_rate"}
    assert hidden == {("ingest", "--shard-size"): "shard_size", ("cache warm", "--budget"): "budget",
                      ("cache status", "--budget"): "budget", ("cache clear", "--budget"): "budget",
                      ("profile", "--workers"): "workers"}
    for name, cmd in _commands(cli):
        assert "--shard-size" not in cmd.get_help(click.Context(cmd)) and "--budget " not in cmd.get_help(
            click.Context(cmd)), name


def _medload(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True,
                          env=os.environ.copy())
    assert not check or proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two small synthetic series: one shard each when shards hold at most 1 byte."""
    root = tmp_path_factory.mktemp("names")
    for s in (1, 2):
        make_series(root / "src", SeriesSpec(n_slices=3, rows=24, cols=32), seed=s, series_number=s)
    return root / "src"


def _shards(store) -> int:
    st = open_store(store)
    try:
        return len(st.manifest.shards)
    finally:
        st.close()


def test_ingest_shard_bytes_flag_and_its_old_spelling(sources, tmp_path):
    new = _medload("ingest", sources, tmp_path / "a", "--workers", 1, "--shard-bytes", 1, "--no-progress")
    assert "2 ingested" in new.stdout and "warning" not in new.stderr and _shards(tmp_path / "a") == 2
    old = _medload("ingest", sources, tmp_path / "b", "--workers", 1, "--shard-size", 1, "--no-progress")
    assert "--shard-size is now --shard-bytes" in old.stderr and _shards(tmp_path / "b") == 2
    both = _medload("ingest", sources, tmp_path / "c", "--shard-size", 1, "--shard-bytes", 1, check=False)
    assert both.returncode == 2 and "give --shard-bytes only" in both.stderr


def test_config_file_old_key_warns_on_stderr_and_a_wrong_type_names_the_file(sources, tmp_path):
    config = tmp_path / "old.toml"
    config.write_text("[ingest]\nworkers = 1\nshard_size = 1\n")
    proc = _medload("--config", config, "ingest", sources, tmp_path / "s", "--no-progress")
    assert f"{config} [ingest]: shard_size is now called shard_bytes" in proc.stderr and _shards(tmp_path / "s") == 2
    bad = tmp_path / "bad.toml"
    bad.write_text('[ingest]\nworkers = "4"\n[cache]\nverify = "false"\n')
    proc = _medload("--config", bad, "ingest", sources, tmp_path / "t", check=False)
    assert proc.returncode == 2 and f"{bad} [ingest]: workers = '4' is not an integer" in proc.stderr
    assert not (tmp_path / "t").exists()


def test_cache_hot_budget_flag_and_its_old_spelling(sources, tmp_path):
    store, hot = tmp_path / "store", tmp_path / "hot"
    _medload("ingest", sources, store, "--workers", 1, "--shard-bytes", 1, "--no-progress")
    assert "2 copied" in _medload("cache", "warm", store, "--hot-dir", hot, "--hot-budget", "1GB").stdout
    old = _medload("cache", "status", store, "--hot-dir", hot, "--budget", "1GB")
    assert "--budget is now --hot-budget" in old.stderr and "2 of 2 shard(s)" in old.stdout
    missing = _medload("cache", "warm", store, "--hot-dir", hot, check=False)  # status needs no budget; warm does
    assert missing.returncode == 2 and "--hot-budget" in missing.stderr
