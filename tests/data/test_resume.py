"""Exact mid-epoch resume (medload.data.loader_state): a training process with a two-worker loader is
SIGKILLed at a random step, restored from its last saved state in a new process, and the whole sequence of
samples, images and augmentation parameters it trained on is compared with an uninterrupted run's."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import REPO
from helpers import elastic_run, resume_run

from medload.config import IngestConfig
from medload.data import (
    BatchAugment,
    DistributedPatientSampler,
    SliceDataset,
    UniformSampler,
    make_loader,
    shards_for_rank,
)
from medload.data.state_version import STATE_VERSION
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

SIZES = [(32, 40), (40, 40)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Four patients of two matrix sizes (so batches come from shape buckets), 6..9 slices each, in shards
    of about one series."""
    root = tmp_path_factory.mktemp("resume")
    for p in range(4):
        rows, cols = SIZES[p % 2]
        make_series(root / "src" / f"p{p}", SeriesSpec(n_slices=6 + p, rows=rows, cols=cols), seed=80 + p,
                    patient_id=f"RES-{p}")
    ingest(root / "src", root / "store", config=IngestConfig(workers=1, shard_bytes=20_000))  # a shard per series
    return root / "store"


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _script(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "resume_run.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


@pytest.mark.parametrize(("kind", "order"), [("slice", "shuffle"), ("slab", "sampler"), ("slice", "buckets"),
                                             ("patch", "sampler")])
def test_a_run_killed_mid_epoch_resumes_with_the_same_samples_and_augmentation(store, tmp_path, kind, order):
    reference = tmp_path / "reference.jsonl"
    resume_run.run(str(store), kind, order, reference)
    expected = _lines(reference)
    assert len({line["epoch"] for line in expected}) == resume_run.EPOCHS
    kill_at = random.randrange(1, len(expected) - 1)
    log = tmp_path / "run.jsonl"
    killed = _script(store, kind, order, log, "--kill-at", kill_at)
    assert killed.returncode == -9, f"step {kill_at}: exited {killed.returncode}\n{killed.stderr}"
    assert _lines(log) == expected[:kill_at], f"killed at step {kill_at}: the run before the kill differs"
    restored = _script(store, kind, order, log, "--resume")
    assert restored.returncode == 0, restored.stderr
    got = _lines(log)
    assert [line["index"] for line in got] == [line["index"] for line in expected], f"killed at step {kill_at}"
    assert got == expected, f"killed at step {kill_at}: same samples, but the images or augmentation differ"


def test_batches_read_ahead_by_the_workers_count_as_not_seen(store):
    """Two workers read up to four batches ahead; a state taken after the second batch resumes at the third."""
    ds = SliceDataset(open_store(store))

    def loader():
        return make_loader(ds, 3, 2, sampler=UniformSampler.from_dataset(ds, seed=1), augment=BatchAugment(seed=2),
                           window="soft_tissue")

    first = loader()
    batches = iter(first)
    taken = [next(batches)["index"].tolist() for _ in range(2)]
    state = first.state_dict()
    rest = [b["index"].tolist() for b in batches]
    again = loader()
    again.load_state_dict(state)
    assert state["batches"] == 2 and len(again) == len(first)
    assert [b["index"].tolist() for b in again] == rest
    assert len(taken) + len(rest) == len(first)


def test_a_trainer_that_fetches_ahead_gives_its_own_count_of_consumed_batches(store):
    """A trainer holding a fetched batch it has not stepped on (``progress.consumed``): the state counts the
    steps, so the held batch and its augmentation draw come again after a restore."""
    ds = SliceDataset(open_store(store))

    def loader():
        return make_loader(ds, 3, 2, shuffle=True, seed=6, augment=BatchAugment(seed=1), window="soft_tissue")

    first, steps = loader(), 0
    first.progress.consumed = lambda: steps
    batches = iter(first)
    held = next(batches)
    for _ in range(2):  # step on the held batch while the next one is fetched
        held, steps = next(batches), steps + 1
    state = first.state_dict()
    assert (state["batches"], state["augment"]["draws"]) == (2, 2) and first.progress.handed == 3
    again = loader()
    again.load_state_dict(state)
    assert torch.equal(next(iter(again))["image"], held["image"])


def test_a_sampler_alone_resumes_at_its_position_and_an_abandoned_pass_repeats_from_the_start():
    sampler = UniformSampler(50, seed=3)
    sampler.set_epoch(2)
    whole = list(sampler)
    taken = iter(sampler)
    head = [next(taken) for _ in range(7)]
    state = sampler.state_dict()
    assert head == whole[:7] and state["position"] == 7 and list(sampler) == whole  # left off: starts again
    again = UniformSampler(50, seed=3)
    again.load_state_dict(state)
    assert list(again) == whole[7:] and list(again) == whole  # the restored place holds for one pass


def test_distributed_samplers_alone_restored_on_more_ranks_cover_the_epoch_once():
    patients = np.repeat(np.arange(7), [5, 3, 8, 2, 6, 4, 5])
    old = [DistributedPatientSampler(patients, rank=r, world_size=2, seed=1) for r in range(2)]
    seen = Counter()
    for sampler in old:
        sampler.set_epoch(4)
        steps = iter(sampler)
        seen.update(next(steps) for _ in range(6))
    state = old[0].state_dict()
    padding = Counter()
    owner = {}
    for rank in range(3):
        sampler = DistributedPatientSampler(patients, rank=rank, world_size=3, seed=1)
        sampler.load_state_dict(state)
        rest = list(sampler)
        seen.update(rest)
        padding.update(i for i, pad in zip(rest, sampler.padding.tolist()) if pad)
        mine = {int(patients[i]) for i in rest}
        assert not mine & set(owner), f"patients {mine & set(owner)} on rank {rank} and another"
        owner.update(dict.fromkeys(mine, rank))
    seen.subtract(padding)
    assert seen == Counter(range(patients.size))


def test_a_state_is_small_versioned_and_refused_where_it_does_not_fit(store):
    ds = SliceDataset(open_store(store))
    loader = make_loader(ds, 4, 0, shuffle=True, seed=3)
    state = loader.state_dict()
    assert state["version"] == STATE_VERSION and len(json.dumps(state)) < 600  # seeds and counters, no index list
    with pytest.raises(ConfigError, match="newer medload"):
        loader.load_state_dict({**state, "version": STATE_VERSION + 1})
    with pytest.raises(ConfigError, match="batch_size"):
        make_loader(ds, 5, 0, shuffle=True, seed=3).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed=3"):
        make_loader(ds, 4, 0, shuffle=True, seed=4).load_state_dict(state)
    with pytest.raises(ConfigError, match="not of a UniformSampler"):
        UniformSampler(len(ds)).load_state_dict(state)


def _torchrun(world: int, *args) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(world), str(REPO / "tests" / "helpers" / "elastic_run.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, f"torchrun of {world} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.torchrun
def test_two_ranks_restored_on_three_see_every_sample_of_the_epoch_once(store, tmp_path):
    """torchrun of 2 ranks stops two steps into epoch 1; 3 ranks restore rank 0's state: the rest of the
    epoch is re-partitioned by patient over them (each remaining sample once, bar padding repeats), on the
    shards `medload cache warm --rank R --world 3` copies, and epoch 2 is the 3-rank partition."""
    _torchrun(2, "first", store, tmp_path, "--steps", 2)
    _torchrun(3, "rest", store, tmp_path)
    first = [json.loads((tmp_path / f"first-rank{r}.json").read_text())["1"] for r in range(2)]
    rest = [json.loads((tmp_path / f"rest-rank{r}.json").read_text()) for r in range(3)]
    ds = SliceDataset(open_store(store))
    samples = Counter(i for part in first for i in part["samples"])
    assert sum(samples.values()) == 2 * 2 * elastic_run.BATCH
    for part in rest:
        samples.update(part["1"]["samples"])
        samples.subtract(part["1"]["padding"])
    assert samples == Counter(range(len(ds))), "epoch 1: not every sample exactly once"
    patients = [set(ds.index.patients[part["1"]["samples"]].tolist()) for part in rest]
    assert all(not a & b for n, a in enumerate(patients) for b in patients[n + 1:]), "a patient on two ranks"
    for rank, part in enumerate(rest):
        shards = {ds.records[s].shard for s in ds.index.series[part["1"]["samples"]].tolist()}
        assert shards <= set(shards_for_rank(ds.records, rank, 3, seed=elastic_run.SEED))
        sampler = DistributedPatientSampler.from_dataset(ds, rank=rank, world_size=3, seed=elastic_run.SEED)
        sampler.set_epoch(2)
        assert sorted(part["2"]["samples"]) == sorted(sampler), f"epoch 2 of rank {rank}: not the 3-rank partition"
