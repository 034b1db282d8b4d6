"""Every contender of the loading benchmark yields correct batches on tiny data (not a benchmark: a smoke test)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from medload.bench.loading import Prepared, peak_pss, prepare, run_contender
from medload.bench.peers import CONTENDERS, PeerUnavailable

BATCH = 2


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Prepared:
    return prepare(tmp_path_factory.mktemp("bench"), series=2, slices=6, rows=64, cols=64, samples=7, seed=3)


def expected_hu(prep: Prepared) -> np.ndarray:
    """Ground-truth HU of every sample, (samples, 3, rows, columns), straight from the generator."""
    return np.stack([prep.truth[s][z - 1 : z + 2] for s, z in zip(prep.series_index, prep.z)])


def test_prepare_draws_samples_inside_every_series(prep: Prepared):
    assert len(prep.z) == 7 and set(prep.series_index) <= {0, 1}
    assert all(1 <= z <= prep.series[s].depth - 2 for s, z in zip(prep.series_index, prep.z))
    path = Path(prep.root) / "prepared-test.json"
    prep.save(path)
    again = Prepared.load(path)
    assert again.series == prep.series and np.array_equal(again.z, prep.z)
    assert np.array_equal(again.series_index, prep.series_index)


@pytest.mark.parametrize("name", list(CONTENDERS))
def test_contender_yields_the_windowed_samples(prep: Prepared, name: str):
    try:
        loader = CONTENDERS[name](prep, BATCH, 0, "cpu")
        batches = [b.clone() for b in loader]  # ceilings reuse one buffer
    except PeerUnavailable as exc:
        pytest.skip(str(exc))
    assert [tuple(b.shape) for b in batches] == [(2, 3, 64, 64)] * 3 + [(1, 3, 64, 64)]
    got = torch.cat(batches).numpy()
    hu = expected_hu(prep)
    if name == "ceiling_int16":
        assert got.dtype == np.int16 and np.array_equal(got, hu)
        return
    assert got.dtype == np.float32 and got.min() >= 0 and got.max() <= 1
    want = (np.clip(hu.astype(np.float64), -160, 240) + 160) / 400
    atol = 0.5 / 255 + 1e-6 if name == "medload_uint8" else 1e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    assert 0 < want.mean() < 1  # the window cuts through the phantom: the check is not vacuous


def test_ceiling_threads_and_dataloader_workers_give_the_same_batches(prep: Prepared):
    one = [b.clone() for b in CONTENDERS["ceiling_float32"](prep, BATCH, 1, "cpu")]
    two = [b.clone() for b in CONTENDERS["ceiling_float32"](prep, BATCH, 2, "cpu")]
    forked = list(CONTENDERS["npy_memmap"](prep, BATCH, 2, "cpu"))
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(one, forked))


def test_run_contender_times_passes_and_checks_batches(prep: Prepared):
    res = run_contender("npy_memmap", prep, batch_size=BATCH, num_workers=0, device="cpu", warmup=1, batches=2,
                        repeats=2)
    assert len(res["seconds"]) == 2 and all(s > 0 for s in res["seconds"])
    with pytest.raises(ValueError, match=r"batch is \(1, 3, 64, 64\).*expected \(2, 3, 64, 64\)"):  # the 4th is short
        run_contender("npy_memmap", prep, batch_size=BATCH, num_workers=0, device="cpu", warmup=1, batches=3, repeats=1)
    with pytest.raises(RuntimeError, match="yielded 1 batches, expected 2"):
        run_contender("npy_memmap", prep, batch_size=7, num_workers=0, device="cpu", warmup=1, batches=1, repeats=1)


def test_peak_pss_sees_this_process():
    import os

    with peak_pss(os.getpid(), interval=0.005) as peak:
        ballast = np.ones(50_000_000 // 8)
        import time

        time.sleep(0.05)
    assert peak.mb > 50 and ballast.sum() > 0
