"""``make_loader(..., num_workers="auto")``: loader settings from a short measurement on this store and machine.

1. **Measure** (:func:`measure_costs`): a few batches of distinct random samples are read through the
   real loader (:func:`~medload.data.build.build_loader`) with ``num_workers=0`` under
   :func:`medload.data.profile.profile`, which gives per batch
   the reader's cost ``r`` (store reads, decode, collate: what a worker would do) and the trainer's
   cost ``m`` (copy, cast, window, augment). The first batch (opening the store) is not counted.
   When the dataset's decoded slices fit a reader's L1 cache (:func:`dataset_bytes`), every epoch
   after the first reads from it, so the same batches are read again and ``r`` is their warm cost.
2. **Model** (:func:`estimate_rate`): with ``n`` workers the loader delivers at most ``n / r`` batches/s
   (workers side by side), ``1 / (m + h)`` (the trainer, which also receives each batch from a worker:
   ``h`` = 0.08 ms, measured with torch 2.13 on 2 cores as the DataLoader's per-batch hand-off of the
   meta dict, its sample indices a list of ints) and ``cores / (c + m + h)``, where ``c`` is the CPU time of a read
   (less than ``r`` when reads wait for a disk or NFS): the CPU work of a batch spread over the
   free cores: those this process may use, less the load other processes put on them by the 1-minute
   load average; on a GPU ``m`` does not load the CPU); with no workers ``1 / (r + m)``. No model step
   is assumed: a slower step needs fewer workers, never more.
3. **Choose** (:func:`choose_settings`): the fewest workers within 10% of the best estimate (workers
   also cost memory and start-up time, which the model leaves out); prefetch
   depth 2, or 4 when first reads vary more than twofold between batches (and the dataset does not
   fit L1); page-locked slots on CUDA only. Then, within ``memory_budget``: batch slots
   (``slot_count(n, prefetch)`` batches, two more on CUDA for copies in flight) and one L1 cache per
   reading process (``store.cache.l1_bytes``) must fit -- prefetch is lowered first, then workers.
4. **Check** (:func:`measured_rate`): a choice with workers is run for real on the same samples (the
   model knows nothing of other processes competing for memory bandwidth and caches); unless it is
   at least 10% faster than the measured rate without workers, no workers are used.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any

import numpy as np
import torch

from medload import windows as win
from medload.cgroup_limits import available_memory, usable_cores
from medload.config import format_size, parse_size
from medload.data.build import build_loader
from medload.data.loader_types import Augment, LoaderDataset, LoaderTuning
from medload.data.slot_ring import COPIES_IN_FLIGHT
from medload.data.slots import slot_count
from medload.data.stage_times import profile
from medload.errors import ConfigError

__all__ = ["LoaderTuning", "LoaderCosts", "tune_loader", "measure_costs", "measured_rate", "choose_settings",
           "estimate_rate",
           "loader_memory", "dataset_bytes", "default_memory_budget", "free_cores"]

log = logging.getLogger(__name__)

_NEAR_BEST = 0.9      # fewest workers whose estimate is within 10% of the best
_MAX_WORKERS = 16     # candidates beyond the cores only pay off when reads wait for I/O (the model says when)
_CHECK_GAIN = 1.1     # workers are kept only if measured at least 10% faster than none
_HANDOFF_S = 0.08e-3  # a batch's meta dict from a worker to the trainer (see the module docstring)
_JITTER = 2.0         # slowest / median read time above which prefetch goes to 4
_MEASURE_BATCHES = 6  # timed batches at most (plus one not counted)
_MEASURE_SECONDS = 3.0


@dataclass(frozen=True)
class LoaderCosts:
    """Measured seconds per batch: ``read`` in a reader (each batch, first reads), ``trainer`` on the
    training side (mean), the ``cores`` free for loading (see :func:`free_cores`), and ``warm_read``:
    the same batches read again, when the dataset fits each reader's L1 cache (else empty)."""

    read: tuple[float, ...]
    trainer: float
    cores: int
    warm_read: tuple[float, ...] = ()
    cpu_share: float = 1.0  # CPU time / wall time of the reads: below 1 where they wait for I/O

    @property
    def steady_read(self) -> float:
        """Median read time per batch once training runs: warm reads where the dataset fits L1."""
        return float(np.median(self.warm_read or self.read))

    @property
    def jittery(self) -> bool:
        """First reads vary more than twofold (and the dataset does not fit L1)."""
        return not self.warm_read and max(self.read) > _JITTER * float(np.median(self.read))




def free_cores() -> int:
    """Cores this process may use (its affinity mask, or its cgroup's CPU quota where less), less the load of
    other processes: the 1-minute load average minus this process's own one, rounded; at least 1."""
    cores = usable_cores()
    try:
        others = max(0.0, os.getloadavg()[0] - 1.0)
    except OSError:
        others = 0.0
    return max(1, min(cores, round(cores - others)))


def default_memory_budget() -> int:
    """A quarter of the memory available now (the machine's, or a container's or job's limit where less:
    :func:`~medload.cgroup_limits.available_memory`), at most 4 GB."""
    available = available_memory()
    return min(4 * 10**9, (8 * 10**9 if available is None else available) // 4)


def dataset_bytes(dataset: LoaderDataset) -> int:
    """Decoded bytes of every slice (and label) the dataset's series hold: what an L1 cache needs to
    serve every epoch after the first."""
    per_voxel = dataset.dtype.itemsize + (0 if dataset.label_dtype is None else dataset.label_dtype.itemsize)
    return sum(int(np.prod(r.shape)) for r in dataset.records) * per_voxel


def loader_memory(num_workers: int, prefetch_factor: int, batch_bytes: int, l1_bytes: int, pinned: bool) -> int:
    """Bytes a loader holds: its batch slots (with two for device copies in flight where they are page-locked)
    and one L1 per reading process."""
    return (slot_count(num_workers, prefetch_factor, COPIES_IN_FLIGHT if pinned else 0) * batch_bytes
            + max(num_workers, 1) * l1_bytes)


def estimate_rate(num_workers: int, costs: LoaderCosts, *, trainer_uses_cpu: bool = True) -> float:
    """Batches/s the loader can deliver with ``num_workers`` (see the module docstring's model)."""
    r, m = costs.steady_read, costs.trainer
    if num_workers == 0:
        return 1.0 / max(r + m, 1e-9)
    cpu = r * costs.cpu_share + _HANDOFF_S + (m if trainer_uses_cpu else 0.0)
    return min(num_workers / max(r, 1e-9), 1.0 / (m + _HANDOFF_S), costs.cores / cpu)


def choose_settings(costs: LoaderCosts, *, batch_bytes: int, l1_bytes: int, memory_budget: int, device: torch.device,
                    batches: int, prefetch_factor: int | None = None, pin_memory: bool | None = None,
                    max_workers: int | None = None) -> LoaderTuning:
    """The settings for these measured costs (a pure function: no measuring, no loader); at most
    ``max_workers`` workers where given.

    Examples:
        >>> costs = LoaderCosts(read=(0.04, 0.05, 0.04), trainer=0.01, cores=4)
        >>> t = choose_settings(costs, batch_bytes=12_582_912, l1_bytes=256_000_000, memory_budget=2 * 10**9,
        ...                     device=torch.device("cpu"), batches=100)
        >>> t.num_workers, t.prefetch_factor
        (3, 2)
    """
    on_cpu = device.type == "cpu"
    pinned = device.type == "cuda" if pin_memory is None else bool(pin_memory) and device.type == "cuda"
    most = max(0, min(batches, _MAX_WORKERS if max_workers is None else max_workers))
    rates = [estimate_rate(n, costs, trainer_uses_cpu=on_cpu) for n in range(most + 1)]
    wanted = next(n for n, rate in enumerate(rates) if rate >= _NEAR_BEST * max(rates))
    prefetch = prefetch_factor or (4 if costs.jittery else 2)
    workers, why_less = wanted, ""
    while loader_memory(workers, prefetch, batch_bytes, l1_bytes, pinned) > memory_budget:
        if workers and prefetch > 2 and prefetch_factor is None:
            prefetch, why_less = 2, "prefetch lowered to fit the memory budget"
        elif workers:
            workers, why_less = workers - 1, f"{wanted} worker(s) would not fit the memory budget"
        else:
            need = loader_memory(0, prefetch, batch_bytes, l1_bytes, pinned)
            raise ConfigError(f"memory budget {format_size(memory_budget)} is below one batch buffer plus one L1 cache "
                              f"({format_size(need)}): raise memory_budget, lower batch_size, or lower the store's "
                              "L1 budget (open_store(path, cache=...))")
    memory = loader_memory(workers, prefetch, batch_bytes, l1_bytes, pinned)
    chosen = f"{workers} worker{'s' if workers != 1 else ''}, prefetch {prefetch}" if workers else "no workers"
    reason = (f"{chosen}, "
              f"{'page-locked slots' if pinned else 'no pinning'} (device {device}): a batch takes "
              f"{1000 * costs.steady_read:.1f} ms to read ({'median from the L1 cache: the dataset fits it; ' if costs.warm_read else 'median; '}"
              f"first reads {1000 * float(np.median(costs.read)):.1f} ms, slowest {1000 * max(costs.read):.1f} ms) and "
              f"{1000 * costs.trainer:.1f} ms on the trainer; reads {costs.cpu_share:.0%} CPU; {costs.cores} free cores; estimated "
              f"{rates[workers]:.1f} batches/s (best {max(rates):.1f} with {rates.index(max(rates))}, "
              f"{rates[0]:.1f} with none); {format_size(memory)} of the {format_size(memory_budget)} memory budget")
    if costs.jittery and prefetch_factor is None and prefetch == 4:
        reason += "; read times vary more than twofold, so prefetch 4"
    if why_less:
        reason += f"; {why_less}"
    return LoaderTuning(num_workers=workers, prefetch_factor=prefetch, pin_memory=pinned, memory_bytes=memory,
                        memory_budget=memory_budget, read_s=costs.steady_read, trainer_s=costs.trainer,
                        cores=costs.cores, estimated_batches_per_s=rates[workers], reason=reason)


def _timed_pass(dataset: LoaderDataset, order: list[int], batch_size: int, device: torch.device, *,
                skip_first: bool, **loader_kw: Any) -> tuple[list[float], float, float]:
    """Read ``order`` through a real ``num_workers=0`` loader under the profiler: each batch's reader
    seconds, the trainer's mean seconds per batch (copy, window, augment), and the reads' CPU share."""
    loader = build_loader(dataset, batch_size, 0, device, sampler=order, **loader_kw)
    reads, busy, cpu, trainer, started = [], 0.0, 0.0, 0.0, perf_counter()
    with profile(loader) as prof:
        batches = iter(loader)
        if skip_first:
            next(batches)  # opens the store in this process: not counted
            first = prof.report()
            busy, cpu = first.busy.get(-1, 0.0), first.cpu.get(-1, 0.0)
            trainer = first.input_s - first.trainer["wait"]
        for _ in batches:
            reads.append(prof.report().busy[-1] - busy)
            busy += reads[-1]
            if perf_counter() - started > _MEASURE_SECONDS:
                break
        rep = prof.report()
    if not reads:  # a dataset of one batch: its only (first) batch is all there is
        return [rep.busy[-1]], 0.0, 1.0
    share = min(1.0, (rep.cpu[-1] - cpu) / max(sum(reads), 1e-9))
    return reads, max(rep.input_s - rep.trainer["wait"] - trainer, 0.0) / len(reads), share


def _measure_order(dataset: LoaderDataset, batch_size: int, seed: int) -> list[int]:
    """The distinct random samples the measurements read: one uncounted batch and the timed ones."""
    return np.random.default_rng(seed).permutation(len(dataset))[: (_MEASURE_BATCHES + 1) * batch_size].tolist()


def measured_rate(dataset: LoaderDataset, batch_size: int, device: torch.device, tuning: LoaderTuning, *,
                  seed: int = 0, **loader_kw: Any) -> float:
    """Batches/s of a real loader with ``tuning``'s workers over the measurement's samples (the first
    batch, which starts the workers, not counted): the check of the model's choice.

    Examples:
        >>> measured_rate(SliceDataset(store), 8, torch.device("cpu"), loader.tuning)  # doctest: +SKIP
        96.1
    """
    loader = build_loader(dataset, batch_size, tuning.num_workers, device, sampler=_measure_order(dataset, batch_size, seed),
                          prefetch_factor=tuning.prefetch_factor, pin_memory=tuning.pin_memory,
                          persistent_workers=False, **loader_kw)
    batches = iter(loader)
    next(batches)
    t0 = perf_counter()
    count = sum(1 for _ in batches)
    return count / (perf_counter() - t0) if count else 0.0


def measure_costs(dataset: LoaderDataset, batch_size: int, device: torch.device, *,
                  window: str | win.Window | None = None, augment: Augment | None = None,
                  dtype: torch.dtype = torch.float32, warm: bool = False, seed: int = 0) -> LoaderCosts:
    """Per-batch reader and trainer costs of this dataset on this machine (see the module docstring):
    a few batches of distinct random samples, and with ``warm`` the same batches again (from the L1
    cache, as every epoch after the first reads them when the dataset fits it).

    Examples:
        >>> costs = measure_costs(SliceDataset(store), 8, torch.device("cpu"), window="soft_tissue")  # doctest: +SKIP
        >>> costs.steady_read, costs.trainer, costs.cores   # doctest: +SKIP
        (0.041, 0.012, 2)
    """
    order = _measure_order(dataset, batch_size, seed)
    kw = {"window": window, "augment": augment, "dtype": dtype}
    reads, trainer, share = _timed_pass(dataset, order, batch_size, device, skip_first=True, **kw)
    warm_reads: tuple[float, ...] = ()
    if warm and len(order) > batch_size:
        again = order[batch_size : (len(reads) + 1) * batch_size]
        warm_times, _, share = _timed_pass(dataset, again, batch_size, device, skip_first=False, **kw)
        warm_reads = tuple(warm_times)
    return LoaderCosts(read=tuple(reads), trainer=trainer, cores=free_cores(), warm_read=warm_reads, cpu_share=share)


def tune_loader(dataset: LoaderDataset, batch_size: int, device: torch.device, *,
                window: str | win.Window | None = None, augment: Augment | None = None,
                dtype: torch.dtype = torch.float32, prefetch_factor: int | None = None, pin_memory: bool | None = None,
                memory_budget: int | str | None = None) -> LoaderTuning:
    """Measure, then choose ``num_workers``, ``prefetch_factor`` and pinning (what ``make_loader(...,
    num_workers="auto")`` calls); the choice and its reason are logged.

    Examples:
        >>> t = tune_loader(SliceDataset(store), 8, torch.device("cpu"), memory_budget="1GB")  # doctest: +SKIP
        >>> t.reason   # doctest: +SKIP
        '1 worker, prefetch 2, no pinning (device cpu): a batch takes 41.0 ms to read ...'
    """
    budget = default_memory_budget() if memory_budget is None else parse_size(memory_budget)
    resident = dataset_bytes(dataset) <= dataset.store.cache.l1_bytes
    costs = measure_costs(dataset, batch_size, device, window=window, augment=augment, dtype=dtype, warm=resident)
    settings: dict[str, Any] = {
        "batch_bytes": dataset.max_batch_bytes(batch_size), "l1_bytes": dataset.store.cache.l1_bytes,
        "memory_budget": budget, "device": device, "batches": -(-len(dataset) // batch_size),
        "prefetch_factor": prefetch_factor, "pin_memory": pin_memory}
    tuning = choose_settings(costs, **settings)
    if tuning.num_workers:  # check the model against the real thing: the same first reads, with workers
        with_workers = measured_rate(dataset, batch_size, device, tuning, window=window, augment=augment, dtype=dtype)
        without = 1.0 / (float(np.mean(costs.read)) + costs.trainer)
        check = (f"; checked on the same first reads: {with_workers:.1f} batches/s with {tuning.num_workers} "
                 f"worker(s), {without:.1f} without")
        if with_workers < _CHECK_GAIN * without:
            tuning = choose_settings(costs, **settings, max_workers=0)
            check += f", less than {_CHECK_GAIN - 1:.0%} better: no workers"
        tuning = replace(tuning, reason=tuning.reason + check)
    log.info("loader settings: %s", tuning.reason)
    return tuning
