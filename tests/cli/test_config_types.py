"""Config values are checked against their dataclass annotations, from TOML and from Python alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from medload.config import CacheConfig, IngestConfig, MedloadConfig, load_config
from medload.errors import ConfigError


def _load(tmp_path, text: str) -> MedloadConfig:
    path = tmp_path / "medload.toml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize(("section", "line", "expected"), [
    ("cache", 'verify = "false"', "not a boolean"),
    ("ingest", "strict = 1", "not a boolean"),
    ("ingest", 'workers = "4"', "not an integer"),
    ("ingest", "max_frames = 1.5", "not an integer"),
    ("ingest", 'shard_bytes = "lots"', "not a size"),
    ("ingest", "shard_bytes = 1.5", "not a size"),
    ("cache", "hot_budget = true", "not a size"),
    ("ingest", 'decode_timeout = "60"', "not a number"),
    ("ingest", "codec = 3", "not a string"),
    ("cache", "hot_dir = 5", "not a path"),
    ("ingest", "windows = 3", "not a list of names"),
    ("ingest", 'windows = ["lung", 3]', "not a list of names"),
])
def test_a_wrong_type_in_toml_names_the_file_the_key_and_the_type(tmp_path, section, line, expected):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, f"[{section}]\n{line}\n")
    key = line.split(" =")[0]
    assert f"{tmp_path / 'medload.toml'} [{section}]: {key} = " in str(err.value)
    assert expected in str(err.value)


@pytest.mark.parametrize(("cls", "section"), [(IngestConfig, "ingest"), (CacheConfig, "cache")])
def test_every_field_is_checked(tmp_path, cls, section):
    """A value no field can take (a TOML inline table; an object in Python) is an error for each field."""
    for f in dataclasses.fields(cls):
        with pytest.raises(ConfigError, match=rf"\[{section}\]: {f.name} = \{{"):
            _load(tmp_path, f"[{section}]\n{f.name} = {{ a = 1 }}\n")
        with pytest.raises(ConfigError, match=rf"^{cls.__name__}\.{f.name} = <object"):
            cls(**{f.name: object()})


def test_toml_values_become_the_field_types(tmp_path):
    cfg = _load(tmp_path, '[ingest]\nwindows = "lung"\nshard_bytes = "2GB"\nworker_memory = 1000\n'
                          'decode_timeout = 60\nstrict = true\n'
                          '[cache]\nl1_bytes = "1MiB"\nhot_dir = "/ssd/hot"\nhot_budget = "1GB"\nmax_rate = "200MB"\n'
                          'verify = false\n')
    assert cfg.ingest.windows == ("lung",)  # one window, not ("l", "u", "n", "g")
    assert cfg.ingest.shard_bytes == 2 * 10**9 and cfg.ingest.worker_memory == 1000
    assert cfg.ingest.decode_timeout == 60.0 and isinstance(cfg.ingest.decode_timeout, float)
    assert cfg.ingest.strict is True and cfg.cache.verify is False
    assert cfg.cache.l1_bytes == 2**20 and cfg.cache.hot_budget == 10**9 and cfg.cache.max_rate == 2 * 10**8
    assert cfg.cache.hot_dir == Path("/ssd/hot")
    assert _load(tmp_path, '[ingest]\nwindows = ["lung", "350/50"]\n').ingest.windows == ("lung", "350/50")


def test_python_arguments_are_checked_and_converted_the_same_way():
    with pytest.raises(ConfigError, match=r"IngestConfig\.workers = '4' is not an integer"):
        IngestConfig(workers="4")
    with pytest.raises(ConfigError, match=r"CacheConfig\.verify = 'false' is not a boolean"):
        CacheConfig(verify="false")
    with pytest.raises(ConfigError, match=r"IngestConfig\.strict = 'yes'"):
        dataclasses.replace(IngestConfig(), strict="yes")  # replace() goes through the same check
    with pytest.raises(ConfigError, match=r"MedloadConfig\.cache = \{\} is not of type CacheConfig"):
        MedloadConfig(cache={})
    cfg = IngestConfig(windows="lung,soft_tissue", shard_bytes="2GB", decode_timeout=30)
    assert cfg.windows == ("lung", "soft_tissue") and cfg.shard_bytes == 2 * 10**9 and cfg.decode_timeout == 30.0
    assert IngestConfig(workers=None).workers is None and CacheConfig(max_rate=None).max_rate is None
    assert CacheConfig(hot_dir="/ssd", hot_budget=1).hot_dir == Path("/ssd")


def test_range_errors_from_a_file_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"medload\.toml \[cache\]: l1_bytes must be >= 0"):
        _load(tmp_path, "[cache]\nl1_bytes = -1\n")
    with pytest.raises(ConfigError, match=r"cache = 3 is not a table"):
        _load(tmp_path, "cache = 3\n")
