"""What the training thread pays per batch inside ``next(loader)``: wall time and CPU time.

Every moment the training thread spends in the loader is a moment it does not launch the model's
kernels; on a fast GPU that is the input pipeline's real cost, however fast the workers read. The
loader's iterator charges the time from each resumption to its next ``yield`` (and to its end) to a
:class:`NextCost`: the wall clock, and the thread's own CPU time (``time.thread_time``), which leaves
out time spent blocked -- waiting for a worker's batch, or for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter, thread_time

__all__ = ["NextCost"]


@dataclass
class NextCost:
    """Running totals: ``batches`` handed out, ``wall_s`` and ``cpu_s`` spent inside ``next(loader)``.

    Examples:
        >>> cost = NextCost()
        >>> cost.enter(); cost.leave(batch=True)
        >>> cost.batches, cost.wall_s >= 0
        (1, True)
    """

    batches: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    _since: tuple[float, float] | None = None

    def enter(self) -> None:
        """The training thread entered the loader (a ``next`` resumed its iterator)."""
        self._since = (perf_counter(), thread_time())

    def leave(self, batch: bool) -> None:
        """It leaves, with a batch (``batch``) or at the end of the epoch."""
        if self._since is None:
            return
        wall, cpu = self._since
        self.wall_s += perf_counter() - wall
        self.cpu_s += thread_time() - cpu
        self.batches += batch
        self._since = None

    def snapshot(self) -> NextCost:
        return NextCost(self.batches, self.wall_s, self.cpu_s)

    def since(self, before: NextCost) -> NextCost:
        """The totals accrued since ``before`` (a :meth:`snapshot`)."""
        return NextCost(self.batches - before.batches, self.wall_s - before.wall_s, self.cpu_s - before.cpu_s)

    def less(self, wall_s: float, cpu_s: float) -> NextCost:
        """These totals less time that was not the loader's (the profiler's own device syncs)."""
        return NextCost(self.batches, max(self.wall_s - wall_s, 0.0), max(self.cpu_s - cpu_s, 0.0))

    @property
    def wall_ms_per_batch(self) -> float | None:
        return 1e3 * self.wall_s / self.batches if self.batches else None

    @property
    def cpu_ms_per_batch(self) -> float | None:
        return 1e3 * self.cpu_s / self.batches if self.batches else None
