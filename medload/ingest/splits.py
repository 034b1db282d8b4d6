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
3. **diffusion** -- DiffusionBValue (0018,9087) and DiffusionGradientOrientation (0018,9089), else a
   vendor's private b-value and gradient (:mod:`medload.ingest.vendor`): ``b<value>``, or
   ``b<value>_dir<k>`` where several directions share a b-value, k in acquisition order
   (:mod:`medload.ingest.diffusion`);
4. **dimension** -- DimensionIndexValues (0020,9157) of a dimension the DimensionIndexSequence names and
   nothing above reads (a vendor's private one, e.g. Philips pCASL label/control):
   ``<dimension>_<index>``;
5. **time** -- the standard time attributes, else a vendor's timer, else InstanceNumber (flagged), as
   :mod:`medload.ingest.timepoints` says; time point t is the t-th by that value at each position:
   ``t_<tt>`` of N. An incomplete time point (a series stopped during it) is its own part, rejected.

Planes still sharing a position after that are duplicates for :mod:`medload.ingest.geometry` and the
decoder: kept once when identical, else "conflicting duplicates". A candidate without repeated
positions, or whose repeats nothing tells apart, is not split (its key does not change).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from medload.ingest.diffusion import diffusion_labels
from medload.ingest.headers import SliceHeader
from medload.ingest.timepoints import sort_number, time_points

__all__ = ["StackSplit", "split_stacks"]

_TYPE_WORDS = {"M": "magnitude", "MAGNITUDE": "magnitude", "P": "phase", "PHASE": "phase", "PHASE_MAP": "phase",
               "R": "real", "REAL": "real", "I": "imaginary", "IMAGINARY": "imaginary", "FIELD_MAP": "field_map",
               "B0": "field_map", "B0_MAP": "field_map", "B0MAP": "field_map"}


@dataclass
class StackSplit:
    """One stack of a candidate: the labels naming its split (empty when the candidate is not split)
    and, for a time point, its 1-based index among ``time_points`` (found by ``time_attribute``); more
    ``flags`` for its record, and why it is rejected (an incomplete time point)."""

    labels: tuple[str, ...]
    headers: list[SliceHeader]
    time_point: int = 0
    time_points: int = 0
    time_attribute: str = ""
    flags: tuple[str, ...] = ()
    reject_reason: str = ""
    diffusion: str = ""    # the "b-value|direction" of a stack split by diffusion


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
    return {v: f"echo_{k}" for k, v in enumerate(sorted(values, key=sort_number), 1)}


def _dimension_labels(values: list[tuple[tuple[str, str], ...]]) -> dict[Hashable, str]:
    """``<dimension>_<index>`` of the dimensions whose index differs (a private one as ``dim_gggg_eeee``)."""
    differ = [i for i in range(len(values[0])) if len({v[i] for v in values}) > 1]

    def name(dimension: str) -> str:
        return _slug(dimension) if dimension[:1].isalpha() else f"dim_{_slug(dimension)}"

    return {v: "_".join(f"{name(v[i][0])}_{_slug(v[i][1])}" for i in differ) for v in values}


_Parts = dict[Hashable, list[SliceHeader]]


def _values(parts: _Parts) -> list:
    return list(parts)


#: (what tells stacks apart, its value of a plane, the labels of its values), in the order tried
_CATEGORICAL: tuple[tuple[Callable[[SliceHeader], Hashable], Callable[[_Parts], dict[Hashable, str]]], ...] = (
    (_type_of, lambda parts: _type_labels(_values(parts))),
    (lambda h: h.echo_time, lambda parts: _echo_labels(_values(parts))),
    (lambda h: h.diffusion, diffusion_labels),
    (lambda h: h.dimensions, lambda parts: _dimension_labels(_values(parts))),
)
_DIFFUSION = 2


def _split_by(headers: list[SliceHeader], value_of: Callable[[SliceHeader], Hashable],
              tolerance: float) -> dict[Hashable, list[SliceHeader]] | None:
    """The planes by ``value_of``, if it differs between planes at one position; else None."""
    if not any(len({value_of(h) for h in g}) > 1 for g in _position_groups(headers, tolerance)):
        return None
    parts: dict[Hashable, list[SliceHeader]] = defaultdict(list)
    for h in headers:
        parts[value_of(h)].append(h)
    return parts


def split_stacks(headers: list[SliceHeader], tolerance: float) -> list[StackSplit]:
    """The stacks of one candidate (planes within ``tolerance`` mm along the normal share a position);
    one unlabelled stack when it is not split."""
    parts = [StackSplit((), headers)]
    if all(len(g) == 1 for g in _position_groups(headers, tolerance)):
        return parts
    for step, (value_of, labeller) in enumerate(_CATEGORICAL):
        found = []
        for part in parts:
            by_value = _split_by(part.headers, value_of, tolerance)
            if by_value is None:
                found.append(part)
                continue
            labels = labeller(by_value)
            found += [StackSplit(part.labels + (labels[v],), members,
                                 diffusion=str(v) if step == _DIFFUSION else part.diffusion)
                      for v, members in by_value.items()]
        parts = found
    out = []
    for part in parts:
        series = time_points(_position_groups(part.headers, tolerance))
        if series is None:
            out.append(part)
            continue
        n, width = len(series.points), max(2, len(str(len(series.points))))
        for t, members in enumerate(series.points, 1):
            reason = "" if len(members) == series.positions else (
                f"time point {t} has {len(members)} of {series.positions} slices (incomplete time series, "
                f"time points told apart by {series.attribute}): rejected, the complete ones are stored")
            out.append(StackSplit(part.labels + (f"t_{t:0{width}d}",), members, t, n, series.attribute,
                                  series.flags, reason, part.diffusion))
    return out
