"""Read observers: hooks a :class:`~medload.Store` calls as it reads, for a profiler or a metrics exporter.

``store.observe(observer)`` registers an observer on that Store object, in the process that calls it
(an observer is not pickled: a DataLoader worker registers its own); ``store.unobserve(observer)``
removes it. Without observers a read pays one attribute check; with them, a few clock readings per
read call, range read and value decoded. The hooks run in the reading thread, on every read of the
Store (:meth:`~medload.Store.read`, :meth:`~medload.Store.planes`, :meth:`~medload.Store.read_label`):

- :meth:`ReadObserver.read`: one read call, from the L1 lookups to the last slice in place, every tier;
- :meth:`ReadObserver.l1`: the slices of that call the in-process LRU served, and those it kept;
- :meth:`ReadObserver.range_read`: one LMDB range scan of the hot copy (``"l2"``) or the store
  (``"l3"``): positioned reads, checksums and decoding;
- :meth:`ReadObserver.decoded`: one value decompressed by the codec (inside a range read).

:mod:`medload.data.read_probe` (what ``medload profile`` times reads with) is one.

Examples:
    >>> class Count(ReadObserver):
    ...     slices = 0
    ...     def read(self, slices, seconds):
    ...         self.slices += slices
    >>> counter = store.observe(Count())
    >>> _ = store.read(store.series()[0].key, 0, 3); store.unobserve(counter); counter.slices
    3
"""

from __future__ import annotations

__all__ = ["ReadObserver", "Observers"]


class ReadObserver:
    """The hooks (each does nothing here: override those you need). Times are ``time.perf_counter`` seconds."""

    def read(self, slices: int, seconds: float) -> None:
        """A read call of ``slices`` slices took ``seconds``, every tier included."""

    def l1(self, hits: int, fills: int) -> None:
        """Of the slices of a read call, the L1 served ``hits``; it kept ``fills`` of those read from disk."""

    def range_read(self, tier: str, slices: int, nbytes: int, seconds: float) -> None:
        """One range scan of ``slices`` values (``nbytes`` stored bytes) from ``tier`` (``"l2"`` or ``"l3"``)
        took ``seconds``, checksums and decoding included."""

    def decoded(self, seconds: float) -> None:
        """The codec decompressed one value in ``seconds``."""


class Observers(ReadObserver):
    """The observers of one Store: each hook calls theirs, in the order they were registered."""

    def __init__(self, observers: tuple[ReadObserver, ...]) -> None:
        self.observers = observers

    def read(self, slices: int, seconds: float) -> None:
        for o in self.observers:
            o.read(slices, seconds)

    def l1(self, hits: int, fills: int) -> None:
        for o in self.observers:
            o.l1(hits, fills)

    def range_read(self, tier: str, slices: int, nbytes: int, seconds: float) -> None:
        for o in self.observers:
            o.range_read(tier, slices, nbytes, seconds)

    def decoded(self, seconds: float) -> None:
        for o in self.observers:
            o.decoded(seconds)
