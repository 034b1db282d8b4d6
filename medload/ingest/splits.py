"""Splitting a candidate volume where complete stacks share positions: magnitude and phase, echoes,
diffusion weightings, time points.

A candidate (the planes of one series with one orientation, matrix and pixel spacing, see
:mod:`medload.ingest.series`) whose positions repeat may hold several stacks acquired at the same
positions. What tells them apart is read from the headers, in this order; each attribute splits only
the parts whose planes at one position still differ by it:

1. **type** -- ImageType (0008,0008) of single-frame images, FrameType (0008,9007) and
   ComplexImageComponent (0008,9208) of Enhanced frames: named ``magnitude``, ``phase``, ``real``,
   ``imaginary`` or ``field_map`` from the values that differ (``M``, ``P_SE``, ``SW_M``, ``FIELD_MAP``...),
   else by those values themselves;
2. **echo** -- EffectiveEchoTime (0018,9082) of MREchoSequence, else EchoTime (0018,0081): ``echo_<k>``,
   the k-th shortest;
3. **diffusion** -- DiffusionBValue (0018,9087) and DiffusionGradientOrientation (0018,9089):
   ``b<value>``, or ``b<value>_dir<k>`` where several directions share a b-value;
4. **time** -- the first of :data:`~medload.ingest.planes.TIME_ATTRIBUTES` (temporal position, trigger
   time, acquisition number, acquisition time) whose values differ between all planes at each
   position, where every position holds the same number N of planes: time point t is the t-th by
   that value at each position (so per-slice acquisition times of a 2-D sequence are no obstacle):
   ``t_<tt>`` of N.

Planes still sharing a position after that are duplicates for :mod:`medload.ingest.geometry` and the
decoder: kept once when identical, else "conflicting duplicates". A candidate without repeated
positions, or whose repeats nothing tells apart, is not split (its key does not change).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import numpy as np

from medload.ingest.headers import SliceHeader
from medload.ingest.planes import TIME_ATTRIBUTES

__all__ = ["StackSplit", "split_stacks"]

_TYPE_WORDS = {"M": "magnitude", "MAGNITUDE": "magnitude", "P": "phase", "PHASE": "phase", "PHASE_MAP": "phase",
               "R": "real", "REAL": "real", "I": "imaginary", "IMAGINARY": "imaginary", "FIELD_MAP": "field_map",
               "B0": "field_map", "B0_MAP": "field_map", "B0MAP": "field_map"}


@dataclass
class StackSplit:
    """One stack of a candidate: the labels naming its split (empty when the candidate is not split)
    and, for a time point, its 1-based index among ``time_points`` (found by ``time_attribute``)."""

    labels: tuple[str, ...]
    headers: list[SliceHeader]
    time_point: int = 0
    time_points: int = 0
    time_attribute: str = ""


def _position_groups(headers: list[SliceHeader], tolerance: float) -> list[list[SliceHeader]]:
    """Planes grouped by depth along the slice normal (within ``tolerance`` mm of a group's first)."""
    iop = np.asarray(headers[0].orientation, dtype=np.float64)
    normal = np.cross(iop[:3], iop[3:])
    depths = np.asarray([h.position for h in headers], dtype=np.float64) @ normal
    groups: list[list[SliceHeader]] = []
    start = -np.inf
    for i in np.argsort(depths, kind="stable"):
        if groups and depths[i] - start <= tolerance:
            groups[-1].append(headers[i])
        else:
            groups.append([headers[i]])
            start = depths[i]
    return groups


def _number(text: str) -> tuple:
    """Sort key of a header value: numbers by value, then anything else as text."""
    try:
        return (0, Decimal(text), "")
    except InvalidOperation:
        return (1, Decimal(0), text)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def _type_of(h: SliceHeader) -> tuple[str, ...]:
    return h.frame_type or h.image_type


def _type_labels(values: list[tuple[str, ...]]) -> dict[Hashable, str]:
    width = max(len(v) for v in values)
    padded = [v + ("",) * (width - len(v)) for v in values]
    differ = [i for i in range(width) if len({v[i] for v in padded}) > 1]
    tokens = {v: [p[i] for i in differ if p[i]] for v, p in zip(values, padded)}

    def word(token: str) -> str | None:
        return _TYPE_WORDS.get(token) or next((_TYPE_WORDS[t] for t in token.split("_") if t in _TYPE_WORDS), None)

    named: dict[Hashable, str] = {v: "_".join(sorted({w for t in ts if (w := word(t))})) for v, ts in tokens.items()}
    if all(named.values()) and len(set(named.values())) == len(named):
        return named
    raw: dict[Hashable, str] = {v: "_".join(_slug(t) for t in ts) or "type" for v, ts in tokens.items()}
    if len(set(raw.values())) == len(raw):
        return raw
    return {v: f"type_{k}" for k, v in enumerate(sorted(values), 1)}


def _echo_labels(values: list[str]) -> dict[Hashable, str]:
    return {v: f"echo_{k}" for k, v in enumerate(sorted(values, key=_number), 1)}


def _b_text(b: str) -> str:
    try:
        return f"b{Decimal(b).normalize():f}"
    except InvalidOperation:
        return f"b{_slug(b)}" if b else "dwi"


def _diffusion_labels(values: list[str]) -> dict[Hashable, str]:
    pairs = {v: v.partition("|")[::2] for v in values}
    directions: dict[str, list[str]] = defaultdict(list)
    for b, d in pairs.values():
        directions[b].append(d)
    out: dict[Hashable, str] = {}
    for v, (b, d) in pairs.items():
        ranked = sorted(directions[b], key=lambda text: [_number(x) for x in text.split("\\")])
        out[v] = _b_text(b) + (f"_dir{ranked.index(d) + 1:02d}" if len(ranked) > 1 else "")
    return out


#: (what tells stacks apart, its value of a plane, the labels of its values), in the order tried
_CATEGORICAL: tuple[tuple[Callable[[SliceHeader], Hashable], Callable[[list], dict[Hashable, str]]], ...] = (
    (_type_of, _type_labels),
    (lambda h: h.echo_time, _echo_labels),
    (lambda h: h.diffusion, _diffusion_labels),
)


def _split_by(headers: list[SliceHeader], value_of: Callable[[SliceHeader], Hashable],
              tolerance: float) -> dict[Hashable, list[SliceHeader]] | None:
    """The planes by ``value_of``, if it differs between planes at one position; else None."""
    if not any(len({value_of(h) for h in g}) > 1 for g in _position_groups(headers, tolerance)):
        return None
    parts: dict[Hashable, list[SliceHeader]] = defaultdict(list)
    for h in headers:
        parts[value_of(h)].append(h)
    return parts


def _time_points(headers: list[SliceHeader], tolerance: float) -> tuple[list[list[SliceHeader]], str] | None:
    """The planes of each time point and the attribute that orders them, if the repeated positions
    form a time series (see the module docstring); else None."""
    groups = _position_groups(headers, tolerance)
    sizes = {len(g) for g in groups}
    if len(sizes) != 1 or (n := sizes.pop()) < 2 or not headers[0].times:
        return None
    for i, keywords in enumerate(TIME_ATTRIBUTES):
        values = [[h.times[i] for h in g] for g in groups]
        if all(all(v) and len(set(v)) == n for v in values):
            points: list[list[SliceHeader]] = [[] for _ in range(n)]
            for g in groups:
                for t, h in enumerate(sorted(g, key=lambda h: _number(h.times[i]))):
                    points[t].append(h)
            per_frame, classic = keywords
            return points, classic if headers[0].frame is None else per_frame
    return None


def split_stacks(headers: list[SliceHeader], tolerance: float) -> list[StackSplit]:
    """The stacks of one candidate (planes within ``tolerance`` mm along the normal share a position);
    one unlabelled stack when it is not split."""
    parts = [StackSplit((), headers)]
    if all(len(g) == 1 for g in _position_groups(headers, tolerance)):
        return parts
    for value_of, labeller in _CATEGORICAL:
        found = []
        for part in parts:
            by_value = _split_by(part.headers, value_of, tolerance)
            if by_value is None:
                found.append(part)
                continue
            labels = labeller(list(by_value))
            found += [StackSplit(part.labels + (labels[v],), members) for v, members in by_value.items()]
        parts = found
    out = []
    for part in parts:
        series = _time_points(part.headers, tolerance)
        if series is None:
            out.append(part)
            continue
        points, attribute = series
        width = max(2, len(str(len(points))))
        out += [StackSplit(part.labels + (f"t_{t:0{width}d}",), members, t, len(points), attribute)
                for t, members in enumerate(points, 1)]
    return out
