"""One set of loader settings, LoaderConfig: the [loader] table of a config file, make_loader's config=,
StoreDataModule, profile_training / ``medload profile`` and the pipeline; an explicit keyword or flag wins
over the config, and each tool keeps its own defaults where neither gives a setting."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import click
import pytest
import torch
from conftest import REPO
from helpers.labelled_store import make_labelled_store

from medload.config import LoaderConfig, load_config
from medload.data import SliceDataset, make_loader
from medload.data.profile import profile_training
from medload.errors import ConfigError
from medload.storage.store import open_store

EVERY_KEY = """
[loader]
batch_size = 16
num_workers = "auto"
window = "lung"
dtype = "bfloat16"
drop_last = true
prefetch_factor = 4
persistent_workers = false
multiprocessing_context = "spawn"
pin_memory = false
memory_budget = "2GB"
meta = true
"""


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return make_labelled_store(tmp_path_factory.mktemp("loader_config"), patients=2)


def _toml(tmp_path, text: str):
    path = tmp_path / "medload.toml"
    path.write_text(text)
    return path


def test_every_field_is_a_loader_key_of_the_same_name(tmp_path):
    loaded, default = load_config(_toml(tmp_path, EVERY_KEY)).loader, LoaderConfig()
    for f in dataclasses.fields(LoaderConfig):
        assert getattr(loaded, f.name) != getattr(default, f.name), f"[loader] {f.name} was not read"
    assert loaded.memory_budget == 2 * 10**9 and loaded.num_workers == "auto"
    assert load_config(_toml(tmp_path, "[loader]\nnum_workers = 3\n")).loader.num_workers == 3


@pytest.mark.parametrize(("line", "expected"), [
    ('num_workers = "4"', 'num_workers must be a whole number >= 0 or "auto"'),
    ("num_workers = true", "num_workers = True is not of type int or str"),
    ("num_workers = -1", "num_workers must be a whole number"),
    ("batch_size = 0", "batch_size must be at least 1"),
    ('batch_size = "8"', "not an integer"),
    ('dtype = "half"', "dtype 'half': use one of float32"),
    ('window = "nope"', "unknown window 'nope'"),
    ('memory_budget = "lots"', "not a size"),
    ('multiprocessing_context = "threads"', "use one of fork, spawn, forkserver"),
    ("meta = 1", "not a boolean"),
    ("workers = 2", "unknown setting(s) workers"),
])
def test_a_wrong_loader_value_names_the_file_and_the_key(tmp_path, line, expected):
    with pytest.raises(ConfigError) as err:
        load_config(_toml(tmp_path, f"[loader]\n{line}\n"))
    assert f"{tmp_path / 'medload.toml'} [loader]: " in str(err.value) and expected in str(err.value)


def test_the_documented_config_example_shows_every_loader_key():
    (block,) = re.findall(r"```toml\n(.*?)```", (REPO / "docs" / "cli.md").read_text(), re.S)
    assert set(tomllib.loads(block)["loader"]) == {f.name for f in dataclasses.fields(LoaderConfig)}


def test_make_loader_takes_a_config_and_an_explicit_keyword_wins(store_path):
    ds = SliceDataset(open_store(store_path), context=1)
    cfg = LoaderConfig(batch_size=3, dtype="float16", window="soft_tissue", drop_last=True)
    loader = make_loader(ds, config=cfg)
    batch = next(iter(loader))
    assert batch["image"].shape[0] == 3 and batch["image"].dtype == torch.float16 and loader.window.name == "soft_tissue"
    assert len(loader) == len(ds) // 3  # drop_last from the config
    explicit = make_loader(ds, 4, config=cfg, dtype=torch.float32, window=None, drop_last=False)
    batch = next(iter(explicit))
    assert batch["image"].shape[0] == 4 and batch["image"].dtype == torch.float32 and explicit.window is None
    assert len(explicit) == -(-len(ds) // 4)
    with pytest.raises(ConfigError, match="give a batch size"):
        make_loader(ds, config=LoaderConfig())
    with pytest.raises(ConfigError, match="config must be a LoaderConfig"):
        make_loader(ds, 4, config={"batch_size": 4})


def test_the_data_module_takes_a_config(store_path):
    pytest.importorskip("lightning", reason="PyTorch Lightning is an optional extra (medload[lightning])")
    from medload.lightning import StoreDataModule

    data = StoreDataModule(store_path, config=LoaderConfig(batch_size=3, dtype="float16"), val_fraction=0.5)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert batch["image"].shape[0] == 3 and batch["image"].dtype == torch.float16
    data = StoreDataModule(store_path, batch_size=2, config=LoaderConfig(batch_size=3), val_fraction=0.5)
    data.setup()
    assert data.batch_size == 2 and next(iter(data.val_dataloader()))["image"].shape[0] == 2
    assert StoreDataModule(store_path).batch_size == 8  # its own default without a config
    with pytest.raises(ConfigError, match="config must be a LoaderConfig"):
        StoreDataModule(store_path, config={"batch_size": 3})


def test_profile_training_takes_a_config_and_keeps_its_defaults(store_path):
    store = open_store(store_path)
    report, _ = profile_training(store, steps=2, model="none", config=LoaderConfig(batch_size=3))
    assert report.samples == 6
    report, _ = profile_training(store, steps=2, model="none", batch_size=2, config=LoaderConfig(batch_size=3))
    assert report.samples == 4
    report, _ = profile_training(store, steps=1, model="none")
    assert report.samples == 4  # batches of 4 without a config, as before


def _medload(*args):
    proc = subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True,
                          env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    return proc


def test_medload_profile_reads_the_loader_table_and_a_flag_wins(store_path, tmp_path):
    config = _toml(tmp_path, "[loader]\nbatch_size = 3\n")
    doc = json.loads(_medload("--config", config, "profile", store_path, "--steps", 2, "--model", "none", "--json").stdout)
    assert doc["samples"] == 6
    doc = json.loads(_medload("profile", store_path, "--config", config, "--batch-size", 2, "--steps", 2, "--model",
                              "none", "--json").stdout)
    assert doc["samples"] == 4


def test_loader_settings_have_one_flag_name_and_ingest_workers_are_decode_processes():
    from medload.cli import cli

    profile = cli.commands["profile"]
    options = {p.name: p for p in profile.params if isinstance(p, click.Option) and not p.hidden}
    settings = {f.name for f in dataclasses.fields(LoaderConfig)}
    for name in settings & set(options):
        assert options[name].opts == ["--" + name.replace("_", "-")]
    assert {"batch_size", "num_workers", "window"} <= set(options)
    (ingest_workers,) = [p for p in cli.commands["ingest"].params if p.name == "workers"]
    assert "Decode processes" in ingest_workers.help


def _pipeline():
    spec = importlib.util.spec_from_file_location("train_segmentation", REPO / "pipelines" / "train_segmentation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pipeline_flag_is_num_workers_and_workers_warns(tmp_path):
    pipeline = _pipeline()
    args = pipeline.parse_args(["--store", "s"])
    assert (args.batch_size, args.num_workers, args.window) == (8, 2, "soft_tissue")  # its defaults, as before
    args = pipeline.parse_args(["--store", "s", "--quick"])
    assert (args.batch_size, args.num_workers) == (4, 0)
    assert pipeline.parse_args(["--store", "s", "--num-workers", "3"]).num_workers == 3
    with pytest.warns(FutureWarning, match="--workers is now --num-workers"):
        assert pipeline.parse_args(["--store", "s", "--workers", "3"]).loader.num_workers == 3
    with pytest.raises(SystemExit):
        pipeline.parse_args(["--store", "s", "--workers", "3", "--num-workers", "2"])
    config = _toml(tmp_path, '[loader]\nbatch_size = 16\nnum_workers = 1\nwindow = "lung"\ndtype = "float16"\n')
    args = pipeline.parse_args(["--store", "s", "--quick", "--config", str(config), "--batch-size", "5"])
    assert (args.batch_size, args.num_workers, args.window) == (5, 1, "lung")
    assert args.loader == LoaderConfig(batch_size=5, num_workers=1, dtype="float16")  # the window is applied by the step
