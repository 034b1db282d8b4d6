"""Every contender of the loading benchmark yields correct batches on tiny data, 2.5D and 3D (not a
benchmark: a smoke test), and the harness times, caps and measures what it says."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from medload.bench.common import peak_pss
from medload.bench.loading import run_contender
from medload.bench.loading_data import Prepared, prepare
from medload.bench.peers import CONTENDERS, INT16, MEDLOAD, PeerUnavailable, resolve

BATCH = 2


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Prepared:
    return prepare(tmp_path_factory.mktemp("bench"), series=2, slices=6, rows=64, cols=64, samples=7, seed=3)


@pytest.fixture(scope="module")
def prep3d(tmp_path_factory) -> Prepared:
    return prepare(tmp_path_factory.mktemp("bench3d"), series=2, slices=9, rows=32, cols=32, samples=5, seed=5,
                   kind="3d", depth=4)


def expected_hu(prep: Prepared) -> np.ndarray:
    """Ground-truth HU of every sample, (samples, *sample_shape), straight from the generator."""
    return np.stack([prep.truth[s][z : z + prep.depth].reshape(prep.sample_shape)
                     for s, z in zip(prep.series_index, prep.z0)])


def test_prepare_draws_samples_inside_every_series(prep: Prepared, prep3d: Prepared):
    assert len(prep.z0) == 7 and set(prep.series_index) <= {0, 1}
    assert prep.sample_shape == (3, 64, 64) and prep3d.sample_shape == (1, 4, 32, 32)
    for p in (prep, prep3d):
        assert all(0 <= z <= p.series[s].depth - p.depth for s, z in zip(p.series_index, p.z0))
        assert all(s.dicom_dir and s.npy for s in p.series) and p.monai_note is None
    path = Path(prep3d.root) / "prepared-test.json"
    prep3d.save(path)
    again = Prepared.load(path)
    assert again.series == prep3d.series and np.array_equal(again.z0, prep3d.z0)
    assert np.array_equal(again.series_index, prep3d.series_index)
    assert (again.kind, again.depth, again.sample_shape) == ("3d", 4, (1, 4, 32, 32))


@pytest.mark.parametrize("kind", ["2.5d", "3d"])
@pytest.mark.parametrize("name", list(CONTENDERS))
def test_contender_yields_the_windowed_samples(prep: Prepared, prep3d: Prepared, name: str, kind: str):
    p = prep if kind == "2.5d" else prep3d
    n = len(p.z0)
    try:
        loader = CONTENDERS[name](p, BATCH, 0, "cpu")
        batches = [b.clone() for b in loader]  # ceilings reuse one buffer
    except PeerUnavailable as exc:
        pytest.skip(reason=f"the peer cannot read this data: {exc}")
    assert [tuple(b.shape) for b in batches] == [(2, *p.sample_shape)] * (n // 2) + [(1, *p.sample_shape)] * (n % 2)
    got = torch.cat(batches).numpy()
    hu = expected_hu(p)
    if name in INT16:  # unwindowed HU: what a GPU path ships
        assert got.dtype == np.int16 and np.array_equal(got, hu)
        return
    assert got.dtype == np.float32 and got.min() >= 0 and got.max() <= 1
    want = (np.clip(hu.astype(np.float64), -160, 240) + 160) / 400
    atol = 0.5 / 255 + 1e-6 if name == "medload_uint8" else 1e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    assert 0 < want.mean() < 1  # the window cuts through the phantom: the check is not vacuous
    if name in MEDLOAD:
        stats = loader.cache_stats()
        lookups = stats["l1_hits"] + stats["l1_misses"]
        assert lookups == n * p.depth and stats["l3_reads"] == stats["l1_misses"] > 0
        assert stats["l1_hit_rate"] == stats["l1_hits"] / lookups


def test_medload_counts_cache_reads_in_every_worker(prep3d: Prepared):
    loader = CONTENDERS["medload"](prep3d, BATCH, 2, "cpu")
    for _ in range(2):  # two epochs: the workers' L1s serve the second
        assert sum(len(b) for b in loader) == len(prep3d.z0)
    stats = loader.cache_stats()
    assert stats["l1_hits"] + stats["l1_misses"] == 2 * len(prep3d.z0) * prep3d.depth
    assert stats["l1_hits"] > 0 and stats["l3_reads"] == stats["l1_misses"]
    assert stats["next_ms"] > 0 and stats["next_cpu_ms"] > 0  # the training thread's time inside next(loader)
    assert (loader.counters[0] == 0).all() and (loader.counters[1:].sum(dim=1) > 0).all()  # the workers read


def test_ceiling_threads_and_dataloader_workers_give_the_same_batches(prep: Prepared):
    one = [b.clone() for b in CONTENDERS["ceiling_float32"](prep, BATCH, 1, "cpu")]
    two = [b.clone() for b in CONTENDERS["ceiling_float32"](prep, BATCH, 2, "cpu")]
    forked = list(CONTENDERS["npy_memmap"](prep, BATCH, 2, "cpu"))
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(one, forked))


def test_run_contender_times_passes_and_checks_batches(prep: Prepared):
    res = run_contender("npy_memmap", prep, batch_size=BATCH, num_workers=0, device="cpu", warmup=1, batches=2,
                        repeats=2, pss_root=os.getpid())
    assert len(res["seconds"]) == 2 and all(s > 0 for s in res["seconds"]) and res["samples"] == [4, 4]
    assert res["cache"] is None and res["pss_in_run_mb"] > 50
    with pytest.raises(ValueError, match=r"batch is \(1, 3, 64, 64\).*expected \(2, 3, 64, 64\)"):  # the 4th is short
        run_contender("npy_memmap", prep, batch_size=BATCH, num_workers=0, device="cpu", warmup=1, batches=3, repeats=1)
    with pytest.raises(RuntimeError, match="yielded 1 batches, expected 2"):
        run_contender("npy_memmap", prep, batch_size=7, num_workers=0, device="cpu", warmup=1, batches=1, repeats=1)


def slow_loader(prep: Prepared, batch_size: int, num_workers: int, device: str):
    """A contender of our own (resolved from this file): one batch every 50 ms."""
    for _ in range(0, len(prep.z0), batch_size):
        time.sleep(0.05)
        yield torch.zeros((batch_size, *prep.sample_shape))


class _Slow:
    def __init__(self, prep, batch_size):
        self.prep, self.batch_size = prep, batch_size

    def __iter__(self):
        return slow_loader(self.prep, self.batch_size, 0, "cpu")


def slow(prep: Prepared, batch_size: int, num_workers: int, device: str):
    return _Slow(prep, batch_size)


def test_a_pass_stops_at_max_pass_s_and_own_contenders_resolve(prep: Prepared):
    name = f"{__file__}:slow"
    assert resolve(name).__name__ == "slow"
    with pytest.raises(KeyError, match="unknown contender"):
        resolve("no_such_loader")
    res = run_contender(name, prep, batch_size=1, num_workers=0, device="cpu", warmup=0, batches=6, repeats=1,
                        max_pass_s=0.08)
    assert res["samples"] == [2]  # the first timed batch always counts, then it stops once 80 ms have passed


def test_peak_pss_sees_this_process():
    with peak_pss(os.getpid(), interval=0.005) as peak:
        ballast = np.ones(50_000_000 // 8)
        time.sleep(0.05)
    assert peak.mb > 50 and ballast.sum() > 0
