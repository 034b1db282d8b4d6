"""Elastic resume of :class:`~medload.data.DistributedPatientSampler`: the rest of an epoch that stopped
under one number of ranks, re-partitioned by patient over another.

An epoch that ran in stretches (``segments``: ``[world size, count]`` each -- every rank of that world size
ran ``count`` steps) consumed exactly the samples its ranks' orders gave in those steps; each stretch
after the first is the rest of the epoch under its own world size (:meth:`DistributedPatientSampler.plan_for`
with the samples seen before it). Replaying the stretches needs only the seeds and the counts, so a
state stays a few integers, and every rank, old or new, finds the same seen set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from medload.data.samplers import _EpochSampler, _int

__all__ = ["ElasticEpoch"]

#: ``take(order, count)``: the samples ``count`` steps of a rank's ``order`` read
Take = Callable[[np.ndarray, int], np.ndarray]


def _first(order: np.ndarray, count: int) -> np.ndarray:
    """The samples ``count`` positions of ``order`` read (one sample a step: the sampler on its own)."""
    return order[:count]


class ElasticEpoch(_EpochSampler):
    """The base of :class:`~medload.data.DistributedPatientSampler` that resumes an epoch elastically (it
    needs the sampler's ``plan_for``, ``world_size`` and the per-sample ``_ids``)."""

    world_size: int
    _ids: np.ndarray
    _seen: np.ndarray | None
    _segments: list[list[int]]
    _planned: tuple | None
    plan_for: Callable[..., tuple[np.ndarray, np.ndarray, int]]  # (rank, world size, seen) -> (order, padding, dropped)

    def replay(self, segments: Sequence[Sequence[int]], take: Take) -> np.ndarray:
        """The samples of this epoch that ``segments`` consumed: each ``[world size, count]`` is a stretch of
        the epoch every rank of that world size ran for ``count`` steps (``take(order, count)``: the samples
        of a rank's order those steps read), each stretch following on from the ones before it."""
        seen = np.zeros(self._ids.size, bool)
        for n, (world_size, count) in enumerate(segments):
            before = seen.copy() if n else None
            for rank in range(_int("world_size", world_size, low=1)):
                seen[take(self.plan_for(rank, world_size, before)[0], _int("count", count, low=0))] = True
        return seen

    def continue_epoch(self, segments: Sequence[Sequence[int]], take: Take) -> None:
        """Make the rest of this epoch the samples ``segments`` (see :meth:`replay`) left, re-partitioned by
        patient over this sampler's ranks (elastic resume); later epochs are as usual."""
        self._segments = [[int(w), int(c)] for w, c in segments]
        self._seen = self.replay(self._segments, take) if self._segments else None
        self._resume_at(0)
        self._planned = None

    def state_dict(self) -> dict[str, Any]:
        """As the other samplers' (:class:`~medload.data.samplers.UniformSampler`), with the world size and,
        after an elastic restore, ``segments``: this epoch's earlier ``[world size, positions]``."""
        return {**super().state_dict(), "world_size": self.world_size, "segments": [list(s) for s in self._segments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off; saved with another world size, the rest of its epoch is
        re-partitioned by patient over this sampler's ranks (:meth:`continue_epoch`)."""
        position = int(state.get("position", 0))
        super().load_state_dict(state)
        segments = [*state.get("segments", []), [int(state["world_size"]), position]]
        if segments[-1][0] == self.world_size:  # the same world size: continue its order where it stopped
            self.continue_epoch(segments[:-1], _first)
            self._resume_at(position)
        else:
            self.continue_epoch(segments, _first)
