"""Time points of stacks at the same positions: which attribute orders them, and which are complete.

What orders the planes at each position, tried in this order (the first whose values are present and
differ between all planes at every position wins):

1. the standard :data:`~medload.ingest.planes.TIME_ATTRIBUTES` (temporal position, trigger time,
   acquisition number, acquisition time);
2. a vendor's private timer (GE's RTIA timer (0021,105E), :mod:`medload.ingest.vendor`);
3. InstanceNumber (0020,0013), the last resort, flagged ``order_from_instance_number``.

**Ties.** Where AcquisitionNumber orders the points but AcquisitionTime ties between points at one
position, InstanceNumber decides their order when it differs between them -- dcm2niix's order -- and the
parts are flagged ``ties_ordered_by_instance_number``; TemporalPositionIdentifier/Index or TriggerTime,
when present, say the order themselves and win over both.

**Complete and incomplete points.** Where every position holds N planes, time point t is the t-th by that
value at each position. Where positions hold different numbers of planes (a series interrupted during a
time point), a volume-wide attribute (temporal position, acquisition number) that takes N values over the
whole series, each at most once per position, defines the points: those with a plane at every one of the
M positions are stored, the others rejected with "time point t has K of M slices".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from medload.ingest.headers import SliceHeader
from medload.ingest.planes import TIME_ATTRIBUTES

__all__ = ["TimePoints", "time_points", "sort_number"]

_ACQUISITION_NUMBER, _ACQUISITION_TIME = 2, 3
_VOLUME_WIDE = (0, _ACQUISITION_NUMBER)  # attributes with one value per time point, not per slice


def sort_number(text: str) -> tuple:
    """Sort key of a header value: numbers by value, then anything else as text."""
    try:
        return (0, Decimal(text), "")
    except InvalidOperation:
        return (1, Decimal(0), text)


@dataclass
class TimePoints:
    """The planes of each time point (1..N, in order), what ordered them, the number of positions M, and
    the flags every point's volume gets."""

    points: list[list[SliceHeader]]
    attribute: str
    positions: int
    flags: tuple[str, ...] = ()


def _time_value(i: int) -> Callable[[SliceHeader], str]:
    return lambda h: h.times[i] if h.times else ""


def _orderers(first: SliceHeader) -> list[tuple[str, Callable[[SliceHeader], str], int]]:
    """(name, value of a plane, index in TIME_ATTRIBUTES or -1), in the order tried."""
    out: list[tuple[str, Callable[[SliceHeader], str], int]] = []
    for i, (per_frame, classic) in enumerate(TIME_ATTRIBUTES):
        out.append((classic if first.frame is None else per_frame, _time_value(i), i))
    out.append(("RTIA timer (0021,105E)", lambda h: h.vendor_time, -1))
    out.append(("InstanceNumber", lambda h: "" if h.instance_number is None else str(h.instance_number), -1))
    return out


def _separates(groups: list[list[SliceHeader]], value: Callable[[SliceHeader], str]) -> bool:
    return all(all(value(h) for h in g) and len({value(h) for h in g}) == len(g) for g in groups)


def _instance(h: SliceHeader) -> str:
    return "" if h.instance_number is None else str(h.instance_number)


def _tie_broken(groups: list[list[SliceHeader]]) -> bool:
    """Whether AcquisitionTime ties between planes at some position and InstanceNumber tells them apart."""
    ties = any(len({h.times[_ACQUISITION_TIME] for h in g}) < len(g) for g in groups)
    return ties and _separates(groups, _instance)


def time_points(groups: list[list[SliceHeader]]) -> TimePoints | None:
    """The time points of planes grouped by position (``groups``), or None where they form no time series."""
    sizes = {len(g) for g in groups}
    n = max(sizes)
    if n < 2:
        return None
    first = groups[0][0]
    if len(sizes) > 1:
        return _incomplete(groups, n, first)
    for name, value, index in _orderers(first):
        if not _separates(groups, value):
            continue
        flags: tuple[str, ...] = ()
        if index == _ACQUISITION_NUMBER and first.times and _tie_broken(groups):
            value, flags = _instance, ("ties_ordered_by_instance_number",)
        elif name == "InstanceNumber":
            flags = ("order_from_instance_number",)
        points: list[list[SliceHeader]] = [[] for _ in range(n)]
        for g in groups:
            for t, h in enumerate(sorted(g, key=lambda h: sort_number(value(h)))):
                points[t].append(h)
        return TimePoints(points, name, len(groups), flags)
    return None


def _incomplete(groups: list[list[SliceHeader]], n: int, first: SliceHeader) -> TimePoints | None:
    if not first.times:
        return None
    for name, value, index in _orderers(first):
        if index not in _VOLUME_WIDE or not _separates(groups, value):
            continue
        values = sorted({value(h) for g in groups for h in g}, key=sort_number)
        if len(values) != n:
            continue
        points: list[list[SliceHeader]] = [[] for _ in range(n)]
        for g in groups:
            for h in g:
                points[values.index(value(h))].append(h)
        return TimePoints(points, name, len(groups))
    return None
