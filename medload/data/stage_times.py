"""The profiler's stage clock and its report: :func:`profile` times a loader's stages while a block runs
(what they are: :mod:`medload.data.profile`), and :class:`ProfileReport` sums them up.

It sits below the loader's front (:func:`~medload.data.make_loader` measures with it when it tunes
``num_workers="auto"``) and above the read path's instrumentation (:mod:`medload.data.read_probe`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter, thread_time
from typing import TYPE_CHECKING, Literal, cast

import torch

from medload.data.next_cost import NextCost
from medload.data.read_probe import stop_timing

if TYPE_CHECKING:
    from medload.data.device_loader import DeviceLoader
    from medload.data.slots import _SlotDataset

__all__ = ["profile", "Profile", "ProfileReport", "STAGE_LABELS", "TRAINER_STAGES", "WORKER_STAGES", "TIERS"]

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
        self.sync_s = self.sync_cpu_s = 0.0  # the clock's own device syncs, left out of the time inside next()
        self.in_next: NextCost | None = None  # set by profile() when the block ends

    def mark(self, stage: str | None, meta: dict | None = None) -> None:
        """Charge the time since the previous mark to ``stage`` (None: to nothing, e.g. a new epoch);
        ``meta``: a batch's meta dict, whose worker stage times are added."""
        if self.stopped is not None:
            return
        if self._sync is not None:
            before, cpu = perf_counter(), thread_time()
            torch.cuda.synchronize(self._sync)
            self.sync_s += perf_counter() - before
            self.sync_cpu_s += thread_time() - cpu
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
        cost = self.in_next or NextCost()
        return ProfileReport(next_batches=cost.batches, next_wall_s=cost.wall_s, next_cpu_s=cost.cpu_s,
                             wall_s=end - self.started, num_workers=self.num_workers, batches=self.batches,
                             samples=self.samples, unprofiled=self.unprofiled, trainer=dict(self.trainer),
                             worker_stages=dict(self.worker_stages), busy=dict(sorted(self.busy.items())),
                             cpu=dict(sorted(self.cpu.items())), slices=dict(self.slices))


@contextmanager
def profile(loader: DeviceLoader) -> Iterator[Profile]:
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
    slots = cast("_SlotDataset", loader.loader.dataset)  # make_loader builds it over a _SlotDataset
    prof = Profile(loader.device, loader.loader.num_workers)
    before = loader.cost.snapshot()
    loader.profiler = prof
    slots.control[0] = 1
    try:
        yield prof
    finally:
        prof.stop()
        prof.in_next = loader.cost.since(before).less(prof.sync_s, prof.sync_cpu_s)
        loader.profiler = None
        slots.control[0] = 0
        stop_timing(slots)   # this process's observer (num_workers=0); workers take theirs off at their next batch


@dataclass
class ProfileReport:
    """Stage times of one :func:`profile` block, in seconds.

    ``trainer`` stages partition the training loop's wall time (``accounted_s``; ``outside`` is the
    rest of ``wall_s``). ``worker_stages`` are summed over the processes that read (the trainer itself
    with ``num_workers=0``, where they are part of ``wait``); ``busy`` is each reader's total and
    ``cpu`` its CPU time (less than ``busy`` where reads wait for a disk or network; key -1: the
    trainer process). ``slices`` counts slices served per cache tier. ``next_wall_s`` and ``next_cpu_s``:
    the training thread's wall and CPU time inside ``next(loader)`` over ``next_batches`` batches (the
    profiler's own device syncs left out): what the loader costs the thread that launches the model.

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
    next_batches: int = 0
    next_wall_s: float = 0.0
    next_cpu_s: float = 0.0

    @property
    def next_ms(self) -> tuple[float, float] | None:
        """Milliseconds per batch inside ``next(loader)``: (wall, CPU); None before a batch."""
        if not self.next_batches:
            return None
        return 1e3 * self.next_wall_s / self.next_batches, 1e3 * self.next_cpu_s / self.next_batches

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
                "slices": self.slices, "in_next": {"batches": self.next_batches, "wall_s": self.next_wall_s,
                                                   "cpu_s": self.next_cpu_s},
                "input_bound": self.input_bound, "biggest_stage": self.biggest_stage()[0],
                "verdict": self.verdict()}

    def table(self):
        """A rich Table: trainer stages (adding up to the wall time), then worker stages."""
        from rich.table import Table

        wall, per = self.wall_s, max(self.batches, 1)
        table = Table(title=f"{self.batches} batches, {self.samples} samples, num_workers={self.num_workers}",
                      caption=self._caption())
        columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
            ("stage", "left"), ("seconds", "right"), ("% of wall", "right"), ("ms per batch", "right"))
        for name, justify in columns:
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
        if self.next_batches:
            table.add_section()
            row("training thread inside next(loader)", self.next_wall_s)
            row("  of which its CPU time", self.next_cpu_s, style="dim")
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
