"""The stage profiler on the real loader and a real store: stage times partition the wall time, worker
stage times come back from worker processes, a deliberately slowed stage is named, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.nn.functional as F
from conftest import DEVICES, PHILIPS

from medload.config import IngestConfig
from medload.data import SliceDataset, make_loader
from medload.data.profile import TRAINER_STAGES, WORKER_STAGES, ProfileReport, profile
from medload.ingest import ingest
from medload.models import TrainStep, segmentation_unet
from medload.storage.cache.lru import shared_lru
from medload.storage.store import Store, open_store


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "store"
    ingest(PHILIPS / "dicom", path, config=IngestConfig(workers=1))
    return path


def _train(loader, epochs: int = 2) -> float:
    """A real (small) training loop over ``loader``; returns its wall time."""
    step = TrainStep(segmentation_unet(2, 3, small=True).to(loader.device))
    t0 = time.perf_counter()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            image = F.avg_pool2d(batch["image"], 8)
            step(image, (image[:, 1:2] > 0.5).float())
    return time.perf_counter() - t0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [0, 2])
def test_stage_times_add_up_to_the_wall_time(sample_store, workers, device):
    shared_lru(0).clear()  # this process's L1 may hold the Philips slices from earlier tests (same keys)
    loader = make_loader(SliceDataset(open_store(sample_store), context=1), 4, workers, device, window="soft_tissue")
    with profile(loader) as prof:
        wall = _train(loader)
    rep = prof.report()
    assert rep.batches == 2 * len(loader) and rep.samples == 2 * 28 and rep.unprofiled == 0
    assert abs(rep.accounted_s - wall) <= 0.1 * wall, (rep.accounted_s, wall)
    assert rep.trainer["step"] > 0 and rep.trainer["window"] > 0 and rep.trainer["wait"] > 0
    # the training thread's time inside next(loader): every batch, less than the loop, its CPU time measured
    assert rep.next_batches == rep.batches and 0 < rep.next_wall_s < rep.accounted_s and rep.next_cpu_s > 0
    assert rep.to_dict()["in_next"]["batches"] == rep.batches
    # each sample reads its slice and 2 neighbours (1 at either end of the series); the 28 slices come
    # from the store once per reading process, the rest from its L1 cache
    assert rep.slices["l3"] >= 28 and sum(rep.slices.values()) == 2 * (28 * 3 - 2)
    assert rep.worker_stages["decode"] > 0 and rep.worker_stages["read_l3"] > 0
    if workers:
        assert set(rep.busy) == {0, 1}  # both workers reported their stage times
    else:
        assert set(rep.busy) == {-1}    # read in the trainer, inside the wait
        assert sum(rep.worker_stages[s] for s in WORKER_STAGES) <= rep.trainer["wait"]


def test_profiling_ends_cleanly(sample_store):
    original = Store._planes
    loader = make_loader(SliceDataset(open_store(sample_store), context=0), 4, 0)
    store = loader.dataset.store
    with profile(loader):
        next(iter(loader))
        assert store._observers is not None  # the read path is being timed: a read observer on the store
    assert store._observers is None and loader.profiler is None and not loader.loader.dataset.control[0]
    assert Store._planes is original  # by an observer: no method of the store is ever patched
    assert len(list(loader)) == len(loader)  # and the loader goes on, untimed


def _report(trainer: dict, worker_stages: dict, num_workers: int = 0) -> ProfileReport:
    """A report with these stage times (the rest zero), for the verdict's arithmetic."""
    return ProfileReport(wall_s=sum(trainer.values()), num_workers=num_workers, batches=10, samples=40, unprofiled=0,
                         trainer={**dict.fromkeys(TRAINER_STAGES, 0.0), **trainer},
                         worker_stages={**dict.fromkeys(WORKER_STAGES, 0.0), **worker_stages}, busy={-1: 1.0})


def test_verdict_names_the_biggest_stage_and_the_bound():
    device = _report({"wait": 0.2, "copy": 0.1, "augment": 1.0, "step": 0.3}, {"collate": 0.15})
    assert device.input_bound and device.biggest_stage()[0] == "augment"
    assert device.verdict().startswith("input-bound") and "biggest stage: augment" in device.verdict()
    # worker stages count per reader: 1.2 s of collate over 2 workers costs the loop 0.6 s
    worker = _report({"wait": 0.7, "copy": 0.1, "augment": 0.5, "step": 0.3}, {"collate": 1.2}, num_workers=2)
    assert worker.biggest_stage() == ("collate", 0.6) and "biggest stage: collate" in worker.verdict()
    compute = _report({"wait": 0.1, "step": 2.0}, {"decode": 0.1})
    assert not compute.input_bound and compute.verdict().startswith("compute-bound")


def test_a_slowed_device_stage_is_timed_where_it_runs(sample_store):
    """The sleep is a lower bound whatever else the machine does: at least 50 ms of augment per batch."""
    def slow_augment(image, label):
        time.sleep(0.05)
        return image, label

    loader = make_loader(SliceDataset(open_store(sample_store), context=1), 4, 0, window="soft_tissue",
                         augment=slow_augment)
    with profile(loader) as prof:
        for _ in loader:
            pass
    rep = prof.report()
    assert rep.input_stages()["augment"] >= 0.05 * rep.batches and rep.input_bound


class _SlowReads(SliceDataset):
    """A dataset whose batches take 50 ms longer to build in the worker (outside the store reads)."""

    def read_batch(self, indices, image, label) -> None:
        time.sleep(0.05)
        super().read_batch(indices, image, label)


def test_a_slowed_worker_stage_is_timed_in_the_workers(sample_store):
    loader = make_loader(_SlowReads(open_store(sample_store), context=1), 2, 2, window="soft_tissue")
    with profile(loader) as prof:
        for _ in loader:
            pass
    rep = prof.report()
    assert rep.worker_stages["collate"] >= 0.05 * rep.batches  # 14 batches: the sleeps, at least
    assert all(seconds >= 0.05 * 3 for seconds in rep.busy.values())  # 14 batches over 2 workers


def test_a_slow_step_is_timed_as_the_step(sample_store):
    loader = make_loader(SliceDataset(open_store(sample_store), context=1), 4, 0, window="soft_tissue")
    with profile(loader) as prof:
        for _ in loader:
            time.sleep(0.1)
    rep = prof.report()
    assert rep.trainer["step"] >= 0.1 * rep.batches  # the step is timed as the step (the verdict: above)


def _medload(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True,
                          env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_prints_the_table_and_verdict(sample_store):
    out = _medload("profile", sample_store, "--steps", "3", "--batch-size", "2", "--model", "none").stdout
    assert "wait for data" in out and "decode (codec)" in out and "wall time" in out
    assert "-bound: " in out.splitlines()[-1]


def test_cli_json_with_auto_workers(sample_store):
    out = _medload("profile", sample_store, "--steps", "4", "--batch-size", "2", "--num-workers", "auto", "--model", "none",
                   "--json").stdout
    doc = json.loads(out)
    assert doc["batches"] == 4 and doc["verdict"].split(":")[0] in ("input-bound", "compute-bound")
    assert abs(doc["accounted_s"] + doc["trainer_s"]["outside"] - doc["wall_s"]) < 1e-6
    assert doc["tuning"]["reason"] and doc["num_workers"] == doc["tuning"]["num_workers"]

