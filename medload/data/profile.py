"""Where a training loop's time goes, stage by stage, measured on the real loader.

``with profile(loader) as prof:`` around a training loop (entered before the ``for``) times:

- **trainer stages**, in the training process, as consecutive intervals of one clock, so they add up
  to the wall time of the loop: ``start`` (starting the workers), ``wait`` (the step waiting for the
  next batch), ``copy`` (host to device: the label and, on CUDA, the image through pinned memory),
  ``window`` (cast to float and window on the device; on the CPU this is also the image's copy out of
  its slot), ``augment`` (the ``augment=`` callable) and ``step`` (the caller's code between batches:
  the training step). ``outside`` is the rest of the ``with`` block's wall time (model set-up, time
  between epochs). On CUDA the clock synchronises the device at each stage boundary (only while
  profiling), so device work is charged to the stage that queued it.
- **worker stages**, where each batch is read, and sent back with the batch's slot number: ``read_l1``
  (slices served by the in-process LRU, and filling it), ``read_l2`` / ``read_l3`` (LMDB range scans
  on the hot copy or the store, checksums included), ``decode`` (codec decompression) and ``collate``
  (the rest of building the batch in its slot: shapes, edge replication). The loader has no CPU
  transforms: windowing happens on the device -- except with ``num_workers=0`` on the CPU, where each
  slice is cast and windowed as it is read (into the float batch, not a slot), and ``collate``
  includes that work. With ``num_workers=0`` these stages run inside ``wait``; with workers they run
  alongside the trainer and are reported as busy time per worker.

The read path is timed by wrapping three methods of the store (``Store._planes``, ``Store._scan`` and
``SliceCodec.decompress_into``) in the processes that read, only while a profile runs: a loader that is
never profiled pays one flag check per batch.

Examples:
    >>> loader = make_loader(SliceDataset(store), batch_size=8, num_workers=2)  # doctest: +SKIP
    >>> with profile(loader) as prof:   # doctest: +SKIP
    ...     for batch in loader:
    ...         train_step(batch)
    >>> print(prof.report().verdict())   # doctest: +SKIP
    input-bound: 71% of the training loop getting data; biggest stage: decode (38%)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter, process_time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from medload.data.autotune import LoaderTuning

__all__ = ["profile", "profile_training", "Profile", "ProfileReport", "timed_batch", "STAGE_LABELS"]

TRAINER_STAGES = ("start", "wait", "copy", "window", "augment", "step")
WORKER_STAGES = ("read_l1", "read_l2", "read_l3", "decode", "collate")
TIERS = ("l1", "l2", "l3")
STAGE_LABELS = {
    "start": "start workers", "wait": "wait for data", "copy": "host→device copy", "window": "cast + window",
    "augment": "augment", "step": "training step", "outside": "outside the loader",
    "read_l1": "L1 cache (hits, fills)", "read_l2": "read L2 (hot copy)", "read_l3": "read L3 (store)",
    "decode": "decode (codec)", "collate": "collate (into slot; cast + window at 0 workers on CPU)",
}
"""What the table and the verdict call each stage."""


class _Probe:
    """Timers around the store's read path in this process (installed only while profiling)."""

    def __init__(self) -> None:
        self.saved: tuple | None = None
        self.reset()

    def reset(self) -> None:
        self.read = 0.0                      # in Store._planes: every tier, L1 included
        self.scan = {"l2": 0.0, "l3": 0.0}   # in range scans, less their decoding
        self.decode = 0.0
        self.requested = 0
        self.scanned = {"l2": 0, "l3": 0}

    def install(self) -> None:
        if self.saved is not None:
            return
        from medload.storage.codec import SliceCodec
        from medload.storage.store import Store

        self.saved = read, scan, decompress = Store._planes, Store._scan, SliceCodec.decompress_into
        probe = self

        @functools.wraps(read)
        def timed_read(store, rec, db, dtype, z0, z1, *args, **kwargs):
            t0 = perf_counter()
            try:
                return read(store, rec, db, dtype, z0, z1, *args, **kwargs)
            finally:
                probe.read += perf_counter() - t0
                probe.requested += (rec.shape[0] if z1 is None else z1) - z0

        @functools.wraps(scan)
        def timed_scan(store, entry, db, key, z0, z1, *args, **kwargs):
            t0, decoded = perf_counter(), probe.decode
            try:
                return scan(store, entry, db, key, z0, z1, *args, **kwargs)
            finally:
                where = store._tiers._where.get(entry.name)
                tier = "l2" if where is not None and where.tier == "l2" else "l3"
                probe.scan[tier] += perf_counter() - t0 - (probe.decode - decoded)
                probe.scanned[tier] += z1 - z0

        @functools.wraps(decompress)
        def timed_decompress(codec, payload, out):
            t0 = perf_counter()
            try:
                return decompress(codec, payload, out)
            finally:
                probe.decode += perf_counter() - t0

        _patch(Store, SliceCodec, (timed_read, timed_scan, timed_decompress))

    def uninstall(self) -> None:
        if self.saved is None:
            return
        from medload.storage.codec import SliceCodec
        from medload.storage.store import Store

        _patch(Store, SliceCodec, self.saved)
        self.saved = None


def _patch(store: type, codec: type, functions: tuple) -> None:
    """Set Store._planes, Store._scan and SliceCodec.decompress_into (the probes, or the saved originals)."""
    for owner, name, function in zip((store, store, codec), ("_planes", "_scan", "decompress_into"), functions):
        setattr(owner, name, function)


_PROBE = _Probe()


def timed_batch(slots, batch) -> dict:
    """Read ``batch`` like ``slots.fill`` (a loader's slot dataset), adding its stage times to the
    meta dict under ``"profile"``; called in whichever process reads the batch (a worker, or the
    trainer with ``num_workers=0``). Once the profile has ended, takes the probes out again.

    Examples:
        >>> meta = timed_batch(loader.loader.dataset, batch)   # doctest: +SKIP
        >>> sorted(meta["profile"]["stages"])   # doctest: +SKIP
        ['collate', 'decode', 'read_l1', 'read_l2', 'read_l3']
    """
    if not slots.control[0]:
        _PROBE.uninstall()
        slots.probed = False
        return slots.fill(batch)
    _PROBE.install()
    slots.probed = True
    _PROBE.reset()
    t0, c0 = perf_counter(), process_time()
    meta = slots.fill(batch)
    busy, cpu = perf_counter() - t0, process_time() - c0
    p = _PROBE
    in_scans = p.scan["l2"] + p.scan["l3"] + p.decode
    info = torch.utils.data.get_worker_info()
    meta["profile"] = {
        "worker": -1 if info is None else info.id, "busy": busy, "cpu": cpu,
        "stages": {"read_l1": max(p.read - in_scans, 0.0), "read_l2": p.scan["l2"], "read_l3": p.scan["l3"],
                   "decode": p.decode, "collate": max(busy - p.read, 0.0)},
        "slices": {"l1": p.requested - p.scanned["l2"] - p.scanned["l3"], **p.scanned},
    }
    return meta


class Profile:
    """The running tallies of one :func:`profile` block (``report()`` summarises them)."""

    def __init__(self, device: torch.device, num_workers: int) -> None:
        self.num_workers = num_workers
        self._sync = device if device.type == "cuda" else None
        self.trainer = dict.fromkeys(TRAINER_STAGES, 0.0)
        self.worker_stages = dict.fromkeys(WORKER_STAGES, 0.0)
        self.slices = dict.fromkeys(TIERS, 0)
        self.busy: dict[int, float] = {}
        self.cpu: dict[int, float] = {}
        self.batches = self.samples = self.unprofiled = 0
        self.started = perf_counter()
        self.stopped: float | None = None
        self._last = self.started

    def mark(self, stage: str | None, meta: dict | None = None) -> None:
        """Charge the time since the previous mark to ``stage`` (None: to nothing, e.g. a new epoch);
        ``meta``: a batch's meta dict, whose worker stage times are added."""
        if self.stopped is not None:
            return
        if self._sync is not None:
            torch.cuda.synchronize(self._sync)
        now = perf_counter()
        if stage is not None:
            self.trainer[stage] += now - self._last
        self._last = now
        if meta is not None:
            self._add_batch(meta)

    def _add_batch(self, meta: dict) -> None:
        self.batches += 1
        self.samples += len(meta["index"])
        timed = meta.get("profile")
        if timed is None:  # dispatched before the profile began
            self.unprofiled += 1
            return
        for k, v in timed["stages"].items():
            self.worker_stages[k] += v
        for k, v in timed["slices"].items():
            self.slices[k] += v
        self.busy[timed["worker"]] = self.busy.get(timed["worker"], 0.0) + timed["busy"]
        self.cpu[timed["worker"]] = self.cpu.get(timed["worker"], 0.0) + timed["cpu"]

    def stop(self) -> None:
        if self.stopped is None:
            self.stopped = perf_counter()

    def report(self) -> ProfileReport:
        """The figures so far (the wall time runs to now, or to the end of the ``with`` block)."""
        end = self.stopped if self.stopped is not None else perf_counter()
        return ProfileReport(wall_s=end - self.started, num_workers=self.num_workers, batches=self.batches,
                             samples=self.samples, unprofiled=self.unprofiled, trainer=dict(self.trainer),
                             worker_stages=dict(self.worker_stages), busy=dict(sorted(self.busy.items())),
                             cpu=dict(sorted(self.cpu.items())), slices=dict(self.slices))


@contextmanager
def profile(loader) -> Iterator[Profile]:
    """Time every stage of ``loader`` (a :class:`~medload.data.loader.DeviceLoader`) while the block
    runs; enter it before the ``for`` loop. Works with any ``num_workers``.

    Examples:
        >>> loader = make_loader(SliceDataset(store), batch_size=8, window="soft_tissue")
        >>> with profile(loader) as prof:
        ...     for batch in loader:
        ...         pass                              # your training step
        >>> rep = prof.report(); rep.wall_s > 0 and sum(rep.slices.values()) >= len(loader.dataset)
        True
    """
    slots = loader.loader.dataset
    prof = Profile(loader.device, loader.loader.num_workers)
    loader.profiler = prof
    slots.control[0] = 1
    try:
        yield prof
    finally:
        prof.stop()
        loader.profiler = None
        slots.control[0] = 0
        _PROBE.uninstall()   # this process's probes (num_workers=0); workers take theirs out at their next batch
        slots.probed = False


def profile_training(store, *, batch_size: int = 4, num_workers: int | str = 0, steps: int = 20,
                     window: str | None = "soft_tissue", context: int = 1, device: str | torch.device = "cpu",
                     model: str = "small", augment: bool = False, seed: int = 0
                     ) -> tuple[ProfileReport, LoaderTuning | None]:
    """Profile ``steps`` training steps of the 2.5D pipeline on ``store`` (what ``medload profile`` runs):
    :class:`~medload.data.SliceDataset` -> :func:`~medload.data.make_loader` (optionally
    :class:`~medload.data.BatchAugment`) -> the UNet step of ``pipelines/train_segmentation.py``
    (``model="small"`` or ``"full"``; ``"none"`` times the loader alone). The target is the label
    where the store has labels, else the voxels at the top of the window. Returns the report and the
    loader's ``tuning`` (what ``num_workers="auto"`` chose, or None).

    Examples:
        >>> report, _ = profile_training(medload.open_store("stores/sample"), steps=10)   # doctest: +SKIP
        >>> report.verdict()   # doctest: +SKIP
        'compute-bound: 83% of the training loop in the training step; biggest input stage: cast + window (9%)'
    """
    from medload.data.augment import BatchAugment
    from medload.data.datasets import SliceDataset
    from medload.data.loader import make_loader
    from medload.errors import ConfigError
    from medload.models import TrainStep, segmentation_unet

    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    device = torch.device(device)
    dataset = SliceDataset(store, context=context)
    loader = make_loader(dataset, batch_size, num_workers, device, window=window, shuffle=True, seed=seed,
                         augment=BatchAugment(device=device, seed=seed) if augment else None)
    train = None if model == "none" else TrainStep(segmentation_unet(2, dataset.channels, small=model == "small")
                                                   .to(device))
    done, epoch = 0, 0
    with profile(loader) as prof:
        while done < steps:
            loader.set_epoch(epoch)
            for batch in loader:
                if train is not None:
                    target = batch["label"] > 0 if "label" in batch else batch["image"][:, context:context + 1] >= 1.0
                    train(batch["image"].float(), target.float())
                done += 1
                if done == steps:
                    break
            epoch += 1
    return prof.report(), loader.tuning


@dataclass
class ProfileReport:
    """Stage times of one :func:`profile` block, in seconds.

    ``trainer`` stages partition the training loop's wall time (``accounted_s``; ``outside`` is the
    rest of ``wall_s``). ``worker_stages`` are summed over the processes that read (the trainer itself
    with ``num_workers=0``, where they are part of ``wait``); ``busy`` is each reader's total and
    ``cpu`` its CPU time (less than ``busy`` where reads wait for a disk or network; key -1: the
    trainer process). ``slices`` counts slices served per cache tier.

    Examples:
        >>> rep = prof.report()                                          # doctest: +SKIP
        >>> rep.accounted_s / rep.wall_s > 0.9, rep.biggest_stage()[0]   # doctest: +SKIP
        (True, 'decode')
    """

    wall_s: float
    num_workers: int
    batches: int
    samples: int
    unprofiled: int
    trainer: dict[str, float]
    worker_stages: dict[str, float]
    busy: dict[int, float]
    cpu: dict[int, float] = field(default_factory=dict)
    slices: dict[str, int] = field(default_factory=dict)

    @property
    def accounted_s(self) -> float:
        """The sum of the trainer stages: the wall time of the loop, measured stage by stage."""
        return sum(self.trainer.values())

    @property
    def loop_s(self) -> float:
        """Steady-state loop time: the trainer stages less starting the workers."""
        return self.accounted_s - self.trainer["start"]

    @property
    def input_s(self) -> float:
        """Trainer time spent getting data: waiting, copying, windowing, augmenting."""
        return self.loop_s - self.trainer["step"]

    def _readers(self) -> int:
        return max(1, self.num_workers)

    def input_stages(self) -> dict[str, float]:
        """Each input stage's effective share of the loop, in seconds: worker stages divided by the
        number of workers that run them side by side, trainer stages as measured."""
        out = {k: v / self._readers() for k, v in self.worker_stages.items()}
        out.update({k: self.trainer[k] for k in ("copy", "window", "augment")})
        return out

    def biggest_stage(self) -> tuple[str, float]:
        """The input stage that costs the loop the most, and its effective seconds."""
        stages = self.input_stages()
        name = max(stages, key=stages.__getitem__)
        return name, stages[name]

    @property
    def input_bound(self) -> bool:
        """The loop spends more time getting data than in the training step."""
        return self.input_s > self.trainer["step"]

    def verdict(self) -> str:
        """One line: input- or compute-bound, and the biggest stage."""
        loop = self.loop_s
        if self.batches == 0 or loop <= 0:
            return "no batches were profiled: iterate the loader inside the `with profile(loader)` block"
        name, seconds = self.biggest_stage()
        stage = f"{STAGE_LABELS[name]} ({seconds / loop:.0%})"
        if self.input_bound:
            return (f"input-bound: {self.input_s / loop:.0%} of the training loop getting data "
                    f"({self.trainer['wait'] / loop:.0%} waiting); biggest stage: {stage}")
        return (f"compute-bound: {self.trainer['step'] / loop:.0%} of the training loop in the training step; "
                f"biggest input stage: {stage}")

    def to_dict(self) -> dict:
        """Every figure, the verdict and the biggest stage, for JSON."""
        return {"wall_s": self.wall_s, "accounted_s": self.accounted_s, "loop_s": self.loop_s,
                "num_workers": self.num_workers, "batches": self.batches, "samples": self.samples,
                "unprofiled_batches": self.unprofiled,
                "samples_per_s": self.samples / self.loop_s if self.loop_s > 0 else None,
                "trainer_s": {**self.trainer, "outside": self.wall_s - self.accounted_s},
                "worker_s": self.worker_stages, "busy_s": {str(k): v for k, v in self.busy.items()},
                "cpu_s": {str(k): v for k, v in self.cpu.items()},
                "slices": self.slices, "input_bound": self.input_bound, "biggest_stage": self.biggest_stage()[0],
                "verdict": self.verdict()}

    def table(self):
        """A rich Table: trainer stages (adding up to the wall time), then worker stages."""
        from rich.table import Table

        wall, per = self.wall_s, max(self.batches, 1)
        table = Table(title=f"{self.batches} batches, {self.samples} samples, num_workers={self.num_workers}",
                      caption=self._caption())
        for name, justify in (("stage", "left"), ("seconds", "right"), ("% of wall", "right"),
                              ("ms per batch", "right")):
            table.add_column(name, justify=justify)

        def row(label: str, seconds: float, share: float | None = None, style: str | None = None) -> None:
            share = seconds / wall if share is None and wall > 0 else share or 0.0
            table.add_row(label, f"{seconds:.3f}", f"{share:.1%}", f"{1000 * seconds / per:.1f}", style=style)

        for name in TRAINER_STAGES:
            if name == "augment" and not self.trainer[name]:
                continue
            row(STAGE_LABELS[name], self.trainer[name])
            if name == "wait" and self.num_workers == 0:  # the reads happened inside the wait
                for sub in WORKER_STAGES:
                    row(f"  of which {STAGE_LABELS[sub]}", self.worker_stages[sub], style="dim")
                row("  of which loader overhead", max(self.trainer["wait"] - sum(self.worker_stages.values()), 0.0),
                    style="dim")
        row(STAGE_LABELS["outside"], wall - self.accounted_s)
        row("wall time", wall, style="bold")
        if self.num_workers:
            capacity = self.num_workers * self.loop_s
            table.add_section()
            for sub in WORKER_STAGES:
                row(f"workers: {STAGE_LABELS[sub]}", self.worker_stages[sub],
                    self.worker_stages[sub] / capacity if capacity > 0 else 0.0)
            for worker, seconds in self.busy.items():
                row(f"worker {worker} busy", seconds, seconds / self.loop_s if self.loop_s > 0 else 0.0)
        return table

    def _caption(self) -> str:
        tiers = ", ".join(f"{t.upper()} {self.slices.get(t, 0)}" for t in TIERS)
        text = (f"trainer rows add up to the wall time ({self.accounted_s:.3f} s of {self.wall_s:.3f} s measured "
                f"stage by stage); slices read: {tiers}")
        if self.num_workers:
            text += ("; worker rows ran alongside the trainer: % of the workers' capacity "
                     "(workers x loop time), and each worker's busy share of the loop")
        if self.unprofiled:
            text += f"; {self.unprofiled} batch(es) were read before the profile began (no worker times)"
        return text
