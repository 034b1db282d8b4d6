"""make_loader's tuning options: ``num_workers="auto"`` (the choice within a memory budget, its reason,
correct batches) and half-precision batches."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import PHILIPS

from medload.config import IngestConfig
from medload.data import SliceDataset, make_loader
from medload.data.autotune import LoaderCosts, choose_settings, loader_memory
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.store import open_store

BATCH = 4 * 3 * 512 * 512 * 2  # bytes of an int16 2.5D batch of 4
L1 = 256 * 10**6
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("autotune") / "store"
    ingest(PHILIPS / "dicom", path, config=IngestConfig(workers=1))
    return path


def _choose(costs: LoaderCosts, budget: int = 10**10, device=CPU, **kw):
    return choose_settings(costs, batch_bytes=BATCH, l1_bytes=L1, memory_budget=budget, device=device, batches=100,
                           **kw)


SLOW_READS = LoaderCosts(read=(0.040, 0.045, 0.050), trainer=0.005, cores=8)


def test_slow_reads_get_workers_and_cheap_reads_none():
    assert _choose(SLOW_READS).num_workers >= 4
    cheap = _choose(LoaderCosts(read=(0.0005, 0.0005, 0.0005), trainer=0.02, cores=8))
    assert cheap.num_workers == 0  # the trainer's own work is the limit: workers would only cost memory


def test_cpu_bound_reads_get_no_more_workers_than_cores_and_io_bound_ones_more():
    slow = LoaderCosts(read=(1.0, 1.0, 1.0), trainer=0.001, cores=2)
    assert _choose(slow).num_workers == 2
    waiting = LoaderCosts(read=(1.0, 1.0, 1.0), trainer=0.001, cores=2, cpu_share=0.01)
    assert 2 < _choose(waiting).num_workers <= 16
    capped = _choose(slow, max_workers=0)
    assert capped.num_workers == 0 and capped.reason.startswith("no workers")


def test_the_memory_budget_is_never_exceeded():
    roomy = _choose(SLOW_READS)
    budget = loader_memory(2, 2, BATCH, L1, False)  # room for 2 workers at prefetch 2, not more
    tight = _choose(SLOW_READS, budget=budget)
    assert tight.num_workers == 2 < roomy.num_workers and tight.memory_bytes <= budget
    assert "would not fit the memory budget" in tight.reason
    tiny = _choose(SLOW_READS, budget=loader_memory(0, 2, BATCH, L1, False))
    assert tiny.num_workers == 0 and tiny.memory_bytes <= tiny.memory_budget
    with pytest.raises(ConfigError, match="raise memory_budget"):
        _choose(SLOW_READS, budget=L1)


def test_jittery_reads_prefetch_deeper_unless_memory_is_short():
    jittery = LoaderCosts(read=(0.01, 0.01, 0.08), trainer=0.005, cores=2)
    deep = _choose(jittery)
    assert deep.prefetch_factor == 4 and "vary more than twofold" in deep.reason
    budget = loader_memory(deep.num_workers, 2, BATCH, L1, False)
    short = _choose(jittery, budget=budget)
    assert (short.num_workers, short.prefetch_factor) == (deep.num_workers, 2) and "prefetch lowered" in short.reason
    assert _choose(jittery, prefetch_factor=3).prefetch_factor == 3  # an explicit prefetch is kept


def test_pinning_only_on_cuda():
    assert not _choose(SLOW_READS).pin_memory
    cuda = _choose(SLOW_READS, device=torch.device("cuda"))
    assert cuda.pin_memory and "page-locked slots" in cuda.reason
    assert cuda.memory_bytes == loader_memory(cuda.num_workers, cuda.prefetch_factor, BATCH, L1, True)


def test_auto_loader_reports_its_choice_and_yields_the_right_batches(sample_store):
    dataset = SliceDataset(open_store(sample_store), context=1)
    budget = 2 * 10**9
    auto = make_loader(dataset, 4, "auto", window="soft_tissue", shuffle=False, memory_budget=budget)
    t = auto.tuning
    assert t is not None and t.memory_bytes <= budget and t.read_s > 0 and t.cores >= 1
    assert t.reason.startswith(f"{t.num_workers} worker" if t.num_workers else "no workers")
    assert auto.loader.num_workers == t.num_workers
    if "checked on the same first reads" in t.reason:  # the model wanted workers; a real run decided
        assert t.reason.endswith("no workers") == (t.num_workers == 0)
    plain = make_loader(dataset, 4, 0, window="soft_tissue", shuffle=False)
    pairs = list(zip(auto, plain))
    assert len(pairs) == len(plain) == 7
    for a, b in pairs:
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["image"], b["image"])


class _WaitingReads(SliceDataset):
    """Reads that wait 50 ms per batch without using the CPU, as on a slow network filesystem."""

    def read_batch(self, indices, image, label) -> None:
        time.sleep(0.05)
        super().read_batch(indices, image, label)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # more workers than cores: right for I/O waits
def test_reads_that_wait_for_io_get_workers(sample_store):
    loader = make_loader(_WaitingReads(open_store(sample_store), context=1), 2, "auto", window="soft_tissue",
                         memory_budget="4GB")
    assert loader.tuning.num_workers >= 1 and "CPU" in loader.tuning.reason, loader.tuning.reason
    assert len(list(loader)) == 14


def test_a_tiny_budget_gives_an_auto_loader_without_workers(sample_store):
    dataset = SliceDataset(open_store(sample_store), context=1)
    budget = loader_memory(0, 2, dataset.max_batch_bytes(4), dataset.store.cache.l1_bytes, False) + 1000
    loader = make_loader(dataset, 4, "auto", window="soft_tissue", memory_budget=budget)
    assert loader.tuning.num_workers == 0 and loader.loader.num_workers == 0
    assert len(list(loader)) == 7


def test_bad_num_workers_and_dtype_are_config_errors(sample_store):
    dataset = SliceDataset(open_store(sample_store), context=0)
    with pytest.raises(ConfigError, match="auto"):
        make_loader(dataset, 4, "many")
    with pytest.raises(ConfigError, match="float16"):
        make_loader(dataset, 4, 0, dtype=torch.int32)  # neither float nor the stored int16


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float16, 2**-11), (torch.bfloat16, 2**-8)])
def test_half_precision_batches_match_float32(sample_store, dtype, tolerance):
    """Windowed in float32, then cast: within the rounding of the half type (one ulp below 1.0)."""
    dataset = SliceDataset(open_store(sample_store), context=1)
    half = make_loader(dataset, 4, 0, window="soft_tissue", shuffle=False, dtype=dtype)
    full = make_loader(dataset, 4, 0, window="soft_tissue", shuffle=False)
    for h, f in zip(half, full):
        assert h["image"].dtype == dtype and h["image"].element_size() * 2 == f["image"].element_size()
        assert float(h["image"].min()) >= 0.0 and float(h["image"].max()) <= 1.0
        assert float((h["image"].float() - f["image"]).abs().max()) <= tolerance
        assert 0.0 < float(f["image"].mean()) < 1.0  # a real window of real CT, not all 0 or 1


def test_half_precision_batches_from_workers_with_augmentation(sample_store):
    from medload.data import BatchAugment

    dataset = SliceDataset(open_store(sample_store), context=1)
    loader = make_loader(dataset, 4, 2, window="soft_tissue", dtype=torch.bfloat16,
                         augment=BatchAugment(device="cpu", seed=0))
    batch = next(iter(loader))
    assert batch["image"].dtype == torch.bfloat16 and batch["image"].shape == (4, 3, 512, 512)


def test_the_benchmark_compares_auto_with_the_grid(sample_store):
    from medload.bench.autotune import autotune_table, run_autotune

    sec = run_autotune(sample_store, batch_size=4, warmup=1, batches=3, repeats=1, grid=((0, 2), (1, 2)))
    settings = [r["setting"] for r in sec["rows"]]
    assert settings == ["auto", "0 workers", "1 workers, prefetch 2"]
    assert all(r["samples_per_s"]["median"] > 0 for r in sec["rows"]) and sec["rows"][0]["reason"]
    best = max(r["samples_per_s"]["median"] for r in sec["rows"][1:])
    assert sec["auto_vs_best"] == pytest.approx(sec["rows"][0]["samples_per_s"]["median"] / best)
    assert autotune_table(sec).row_count == 3
