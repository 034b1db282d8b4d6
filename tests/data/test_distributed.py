"""Multi-process training and shard locality, for real: torchrun on CPU (gloo) and `medload cache warm --rank`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import PHILIPS, REPO

from medload.config import IngestConfig
from medload.data import DistributedPatientSampler, SlabDataset, SliceDataset, shards_for_rank
from medload.ingest import ingest
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

PIPELINE = REPO / "pipelines" / "train_segmentation.py"


def _run(*args, timeout: int = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=os.environ.copy(),
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The sample study plus five generated patients at its matrix size (6 patients, 88 slices), in
    shards of about two series."""
    root = tmp_path_factory.mktemp("distributed")
    for p in range(5):
        make_series(root / "src" / f"p{p}", SeriesSpec(n_slices=12, rows=512, cols=512, pixel_spacing=(0.45, 0.45)),
                    seed=70 + p, patient_id=f"SYN-{p}")
    ingest([PHILIPS / "dicom", root / "src"], root / "store", config=IngestConfig(workers=1, shard_bytes=5 * 10**6))
    return root / "store"


@pytest.mark.torchrun
def test_torchrun_ranks_train_disjoint_patients_and_validate_once(store, tmp_path):
    """Ranks train on disjoint patients, validate each sample once and agree with one process. With seed 1
    the 6 patients give one validation patient (every fifth along the locality order, from the second),
    so one rank has no validation sample: it must still meet the other in every collective (validation
    runs none but the final all_sum; a metric that all-gathers in its aggregation hung here)."""
    world = 2
    common = ["--store", store, "--quick", "--demo-target", "bone", "--epochs", "1", "--seed", "1"]
    _run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), PIPELINE, *common,
         "--max-steps", "2", "--out", tmp_path / "ddp")
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    ranks = summary["ranks"]
    assert summary["world_size"] == world and [r["rank"] for r in ranks] == list(range(world))
    train = [set(r["train_patients"]) for r in ranks]
    val = [set(r["val_patients"]) for r in ranks]
    everyone = {rec.patient for rec in open_store(store).series()}
    assert len(everyone) == 6 and all(train)
    assert all(not a & b for i, a in enumerate(train) for b in train[i + 1:])
    assert all(not a & b for i, a in enumerate(val) for b in val[i + 1:])
    assert sorted(len(v) for v in val) == [0, 1]  # the case that deadlocked: one rank validates nothing
    assert set().union(*train) == everyone - set().union(*val)  # disjoint, and together every training patient
    for r in ranks:  # what each rank trained on: only its own patients, equal steps (padded with its own)
        assert r["seen_patients"] and set(r["seen_patients"]) <= set(r["train_patients"])
        assert not set(r["train_patients"]) & set(r["val_patients"])
    assert len({r["train_samples"] + r["padded"] for r in ranks}) == 1
    assert sum(r["train_samples"] for r in ranks) == summary["train_samples"]
    epoch = summary["history"][0]
    assert epoch["val_samples_evaluated"] == summary["val_samples"] == sum(r["val_samples"] for r in ranks)

    # each rank reads exactly the shards `cache warm --rank R --world W` copies
    records = open_store(store).series()
    for r in ranks:
        mine = set(r["train_patients"]) | set(r["val_patients"])
        assert {rec.shard for rec in records if rec.patient in mine} == set(shards_for_rank(records, r["rank"], world,
                                                                                              seed=1))

    # the same weights, validated by one process: the same Dice over the same samples
    _run(PIPELINE, *common, "--max-steps", "0", "--init", tmp_path / "ddp" / "best_model.pt", "--out", tmp_path / "one")
    single = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert single["world_size"] == 1 and set(single["ranks"][0]["val_patients"]) == set().union(*val)
    assert single["history"][0]["val_samples_evaluated"] == summary["val_samples"]
    assert single["history"][0]["val_dice"] == pytest.approx(epoch["val_dice"], rel=1e-6, abs=1e-9)


def test_cache_warm_per_rank_copies_exactly_the_shards_its_sampler_reads(tmp_path):
    for p in range(8):  # small patients, three with a second series, in shards of a few series
        for s in range(1 + (p < 3)):
            make_series(tmp_path / "src" / f"p{p}s{s}", SeriesSpec(n_slices=4 + p, rows=32, cols=32), seed=10 * p + s,
                        patient_id=f"P{p}", series_number=s + 1)
    ingest(tmp_path / "src", tmp_path / "store", config=IngestConfig(workers=1, shard_bytes=12_000))
    store = open_store(tmp_path / "store")
    dataset = SliceDataset(store, context=0)
    records = dataset.records
    all_shards = {s.name for s in store.manifest.shards}
    assert len(all_shards) >= 4
    world, hot = 3, {}
    for rank in range(world):
        out = _run("-m", "medload.cli", "cache", "warm", tmp_path / "store", "--hot-dir", tmp_path / f"hot{rank}",
                   "--hot-budget", "1GB", "--rank", rank, "--world", world, "--seed", 1).stdout
        assert f"rank {rank} of {world}" in out
        hot[rank] = {p.name[: -len(".mdb")] for p in (tmp_path / f"hot{rank}").glob("*.mdb")}
        sampler = DistributedPatientSampler.from_dataset(dataset, rank=rank, world_size=world, seed=1, even="none")
        reads = {records[dataset.index.series[i]].shard for i in sampler}
        assert hot[rank] == reads  # every shard it needs, and only those
    assert set().union(*hot.values()) == all_shards
    assert sum(map(len, hot.values())) < world * len(all_shards)  # ranks do not each copy everything


def test_sampler_and_cache_warm_agree_for_every_cost(tmp_path):
    """Series of two matrix sizes: the sampler spreads each series' cost over its samples, and what it reads
    is what shards_for_rank names for the same cost (bytes weigh a 48x40 slice 1.9 times a 32x32 one)."""
    for p in range(8):
        rows, cols = (32, 32) if p % 2 else (48, 40)
        make_series(tmp_path / "src" / f"p{p}", SeriesSpec(n_slices=3 + 2 * p, rows=rows, cols=cols), seed=90 + p,
                    patient_id=f"C{p}")
    ingest(tmp_path / "src", tmp_path / "store", config=IngestConfig(workers=1, shard_bytes=20_000))
    store = open_store(tmp_path / "store")
    records = store.series()
    measured = {r.key: 0.001 * (1 + i % 3) for i, r in enumerate(records)}  # e.g. timed reads, in seconds
    for ds in (SliceDataset(store, context=1), SlabDataset(store, depth=3, stride=2)):
        owners = {}
        for cost in ("bytes", "slices", measured):
            for rank in range(3):
                sampler = DistributedPatientSampler.from_dataset(ds, cost=cost, rank=rank, world_size=3, seed=2,
                                                                 even="none")
                reads = {ds.records[ds.index.series[i]].shard for i in sampler}
                assert reads == set(shards_for_rank(records, rank, 3, seed=2, cost=cost))
                owners.setdefault(str(cost)[:6], {}).update({ds.index.patients[i]: rank for i in sampler})
        assert owners["bytes"] != owners["slices"]  # the cost changes the partition
