"""The loader's slot memory (medload.data.shared_tensors): forked workers share it without /dev/shm, so a
container's 64 MB /dev/shm no longer stops make_loader; spawned workers get a /dev/shm tensor, and too
little room there is said up front. The container is real: a mount namespace whose /dev/shm is a 16 MB
tmpfs."""

from __future__ import annotations

import multiprocessing
import os
import textwrap

import numpy as np
import pytest
import torch
from helpers.small_shm import mount_line, run_in_namespace

from medload.data.shared_tensors import batches_in_flight_fit, shared_empty, start_method
from medload.synthetic import SeriesSpec, make_series


def _write(t: torch.Tensor) -> None:
    t[1].fill_(7)
    t[2, :3] = torch.tensor([1, -2, 3], dtype=t.dtype)


def test_what_a_forked_worker_writes_the_trainer_reads_and_no_dev_shm_file_holds_it():
    t = shared_empty((3, 1000), torch.int16, "fork")
    t.zero_()
    assert not t.is_shared()  # not a torch /dev/shm file: an anonymous shared mapping
    assert t.data_ptr() % 4096 == 0  # page-aligned, as cudaHostRegister wants
    worker = multiprocessing.get_context("fork").Process(target=_write, args=(t,))
    worker.start()
    worker.join()
    assert worker.exitcode == 0
    assert int(t[1].sum()) == 7000 and t[2, :3].tolist() == [1, -2, 3] and int(t[0].abs().sum()) == 0


def test_spawned_workers_get_a_tensor_torch_shares_through_dev_shm():
    t = shared_empty((2, 8), torch.float32, "spawn")
    assert t.is_shared() and t.shape == (2, 8) and t.dtype == torch.float32


def test_the_start_method_is_the_context_given_or_this_interpreters_default():
    assert start_method("spawn") == "spawn"
    assert start_method(multiprocessing.get_context("forkserver")) == "forkserver"
    assert start_method(None) == multiprocessing.get_context().get_start_method()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="/dev/shm is Linux's")
def test_batches_in_flight_beyond_dev_shm_are_said_with_the_figures(caplog):
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    assert batches_in_flight_fit(free // 8, 5)  # fits: nothing said
    assert not caplog.records
    assert not batches_in_flight_fit(free // 4, 5)
    (said,) = [r for r in caplog.records if "in flight" in r.getMessage()]
    assert said.levelname == "WARNING" and "5 batches of about" in said.getMessage() and "--shm-size" in said.getMessage()


_SCRIPT = mount_line("16m") + textwrap.dedent("""
    import sys, zlib
    import medload
    from medload.data import SliceDataset, make_loader
    from medload.errors import ConfigError
    store = medload.open_store(sys.argv[1])
    ds = SliceDataset(store, context=1)
    if sys.argv[3] != "0":  # 3D patches of that many voxels a side, resampled on the CPU in the workers
        from medload.data import PatchDataset
        side = int(sys.argv[3])
        ds = PatchDataset(store, patch=(side, side, side), samples_per_epoch=8, seed=0)
    try:
        loader = make_loader(ds, batch_size=12 if sys.argv[3] == "0" else 2, num_workers=2,
                             multiprocessing_context=sys.argv[2])
        crc = 0
        for batch in loader:
            crc = zlib.crc32(batch["image"].numpy().tobytes(), crc)
        print("crc", crc)
    except ConfigError as exc:
        print("error", exc)
""")


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("shm")
    make_series(root / "src", SeriesSpec(n_slices=24, rows=256, cols=256), seed=5)
    from medload.config import IngestConfig
    from medload.ingest import ingest

    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"


def _in_small_dev_shm(store, context: str, patch_side: int = 0) -> str:
    """Run _SCRIPT in a new mount namespace whose /dev/shm is a 16 MB tmpfs: what it prints."""
    out = run_in_namespace(_SCRIPT, str(store), context, str(patch_side))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_loader_whose_slots_exceed_a_small_dev_shm_reads_the_same_batches(store_path):
    """Slots of 5 x 12 x 3 x 256 x 256 int16 (23.6 MB) do not fit a 16 MB /dev/shm:
    torch's share_memory_() failed there ("unable to allocate shared memory"). Forked workers now share
    the slots without it, and the batches are those of a loader without workers."""
    import zlib

    import medload
    from medload.data import SliceDataset, make_loader

    crc = 0
    for batch in make_loader(SliceDataset(medload.open_store(store_path), context=1), batch_size=12, num_workers=0):
        crc = zlib.crc32(np.ascontiguousarray(batch["image"].numpy()).tobytes(), crc)
    assert _in_small_dev_shm(store_path, "fork") == f"crc {crc}"


def test_spawned_workers_and_a_small_dev_shm_are_a_config_error_with_the_fix(store_path):
    line = _in_small_dev_shm(store_path, "spawn")
    assert line.startswith("error ") and "/dev/shm has" in line and "--shm-size" in line and "'fork'" in line


def test_patch_batches_that_cannot_all_be_in_flight_in_dev_shm_go_through_pipes_not_a_hang(store_path):
    """The patch loader's workers send each batch as new tensors, through /dev/shm whatever the start method;
    5 batches in flight of 2 x 96^3 float32 (7.08 MB) do not fit 16 MB, and a worker that could not send one
    left torch's DataLoader waiting for ever. Its workers now send arrays through their pipes: the same
    patches as a loader without workers."""
    import zlib

    import medload
    from medload.data import PatchDataset, make_loader

    ds = PatchDataset(medload.open_store(store_path), patch=(96, 96, 96), samples_per_epoch=8, seed=0)
    crc = 0
    for batch in make_loader(ds, batch_size=2, num_workers=0):
        crc = zlib.crc32(np.ascontiguousarray(batch["image"].numpy()).tobytes(), crc)
    assert _in_small_dev_shm(store_path, "fork", patch_side=96) == f"crc {crc}"
