"""Plausibility of decoded CT pixels: values no CT scanner writes, and slices that break from their
neighbours.

Corrupt pixel data often still decodes: a damaged disk block, bytes from another file, a zeroed
slice. Two checks catch what they can, for CT only (other modalities have no physical scale). What
happens to a series that fails one is ``IngestConfig.plausibility``: rejected (default: a corrupt
volume in a training store is worse than a missing one, and ``medload rejects`` names it), flagged,
or not checked.

Values (per slice). The Hounsfield scale puts air at -1000 HU by definition. Scanners reconstruct
-1024..3071 HU on the standard 12-bit scale, where dense metal saturates, and -10240..30710 HU on
Siemens' extended CT scale (ten times the standard range, for metal implants). Values outside
:data:`HU_RANGE` are implausible -- unless they take at most two distinct values on the slice: a
fill for pixels outside the reconstructed field of view that the file does not declare as
PixelPaddingValue (0028,0120) (-32768 is common) and a saturation value. Corrupt bytes give many.

Neighbours (per series). Anatomy is continuous along a stack, so a slice resembles its neighbours
about as much as they resemble each other across it. Slice k is an outlier when its mean absolute
difference to each neighbour exceeds both :data:`NEIGHBOUR_RATIO` times the difference between those
neighbours and :data:`NEIGHBOUR_FLOOR_HU` (the first and last slice are compared with the next step
inward). Differences are taken on a ~32 x 32 subsample of each slice. Measured on the real CT in
``tests/scans`` and ``sample_data``: the Philips head (28 x 5 mm) has ratios up to 0.66 and mean
differences up to 144 HU, the GE slices 1.01 and 30 HU, and MONAI's 4 slices with gaps up to 202 mm
1.34 and 1166 HU: the ratio 3 leaves more than twice that margin, and a slice must differ from *both*
neighbours, so a step in the anatomy (breathing, the end of an organ) never trips it. In the synthetic
32 x 32 series of :mod:`medload.synthetic.corpus`, a slice of random bytes differs from its
neighbours by ~1700 HU (17-31 times their difference), a zeroed slice by 324-337 HU (3.4-5.7 times).
What these checks cannot see: a few wrong pixels, bits above BitsStored (masked away), a slice of
another similar scan, two corrupt slices side by side.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["HU_RANGE", "NEIGHBOUR_RATIO", "NEIGHBOUR_FLOOR_HU", "thumbnail", "value_problem", "outlier_slice",
           "series_problem"]

#: Widest range of values CT scanners reconstruct (extended CT scale), HU.
HU_RANGE = (-10240, 30710)
#: A slice is an outlier when it differs from both neighbours this many times more than they differ
#: from each other ...
NEIGHBOUR_RATIO = 3.0
#: ... and by at least this mean absolute difference (HU), so that noise-only stacks never trip it.
NEIGHBOUR_FLOOR_HU = 200.0
_THUMB = 32


def thumbnail(values: np.ndarray) -> np.ndarray:
    """A ~32 x 32 subsample of a (rows, columns) plane: what :func:`outlier_slice` compares."""
    step = max(1, min(values.shape) // _THUMB)
    return np.ascontiguousarray(values[::step, ::step])


def value_problem(values: np.ndarray) -> str | None:
    """Why a CT plane's values (HU) are implausible, or None (see the module docstring)."""
    lo, hi = HU_RANGE
    if values.min() >= lo and values.max() <= hi:
        return None
    outside = values[(values < lo) | (values > hi)]
    distinct = np.unique(outside)
    if len(distinct) <= 2:
        return None
    return (f"{len(outside)} pixels hold {len(distinct)} different values outside {lo}..{hi} HU (from "
            f"{distinct[0]:g} to {distinct[-1]:g}), which no CT scanner reconstructs: corrupt pixel data")


def outlier_slice(thumbs: Sequence[np.ndarray]) -> tuple[int, float, float] | None:
    """The first slice that breaks from its neighbours: (index, its mean absolute difference to them in
    HU, theirs to each other), or None. Needs 3 slices or more."""
    n = len(thumbs)
    if n < 3:
        return None
    stack = np.stack(thumbs).astype(np.float32)
    step = np.abs(np.diff(stack, axis=0)).mean(axis=(1, 2))       # step[k]: slice k to k + 1
    across = np.abs(stack[2:] - stack[:-2]).mean(axis=(1, 2))     # across[k]: slice k to k + 2
    for k in range(n):
        if k == 0:
            near, ref = step[0], step[1]
        elif k == n - 1:
            near, ref = step[n - 2], step[n - 3]
        else:
            near, ref = min(step[k - 1], step[k]), across[k - 1]
        if near > max(NEIGHBOUR_RATIO * ref, NEIGHBOUR_FLOOR_HU):
            return k, float(near), float(ref)
    return None


def series_problem(notes: Sequence[str | None], thumbs: Sequence[np.ndarray | None]) -> tuple[int, str] | None:
    """The first slice of a series whose values (``notes`` from :func:`value_problem`, one per slice)
    or whose difference from its neighbours (``thumbs``, None where unchecked) no real CT shows, and why."""
    for z, note in enumerate(notes):
        if note is not None:
            return z, note
    checked = [t for t in thumbs if t is not None]
    if not thumbs or len(checked) < len(thumbs):  # unchecked (a series has thumbnails for all slices or none)
        return None
    outlier = outlier_slice(checked)
    if outlier is None:
        return None
    z, near, ref = outlier
    return z, (f"differs from its neighbours by {near:.0f} HU on average where they differ from each other by "
               f"{ref:.0f} HU: corrupt pixel data, or a slice of another scan")
