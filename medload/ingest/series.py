"""Grouping image planes into series, splitting them into stackable volumes, and classifying them.

Planes are grouped by SeriesInstanceUID (0020,000E) -- through its pseudonym -- and split where they
cannot share one voxel grid or are not volume data:

- orientation: ImageOrientationPatient (0020,0037) clustered within 1e-3 (rounding noise is not a split)
- matrix: Rows (0028,0010) x Columns (0028,0011), and PixelSpacing (0028,0030)
- EchoNumbers (0018,0086) of multi-echo MR, StackID (0020,9056) of Enhanced objects
- kind from ImageType (0008,0008): LOCALIZER and DERIVED\\SECONDARY parts are skipped with a reason;
- complete stacks at the same positions (magnitude/phase, echo times, diffusion, time points), told
  apart by their headers (:mod:`medload.ingest.splits`): each gets a flag naming its split
  (``phase``, ``echo_2``, ``t_07``), and the time points of one time series share ``time_series``
  (or, under the ``time_series="reject"`` policy, the whole candidate is rejected); an incomplete time
  point is rejected on its own (:mod:`medload.ingest.timepoints`).

Every split part gets its own 16-byte key from the series pseudonym and a descriptor of the split
values, so keys do not depend on file names, file order or which other parts are present. A part
that is not split by shared positions keeps the descriptor (and key) it had before such splits existed.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from medload.ingest.headers import SliceHeader
from medload.ingest.pixels import fits_int16
from medload.ingest.splits import StackSplit, split_stacks
from medload.storage.keys import series_key

__all__ = ["SeriesCandidate", "group_series"]

_ORIENTATION_TOLERANCE = 1e-3


@dataclass
class SeriesCandidate:
    """Planes that may form one volume, with their key and, for non-volumes, why they are skipped
    (``skip_reason``) or refused by a policy (``reject_reason``). ``split`` names the stack of a
    candidate split at shared positions (``"phase"``, ``"echo_2/t_03"``); the time points of one time
    series share ``time_series`` (the key the unsplit candidate would have) and have ``time_point`` 1..N."""

    key: bytes
    descriptor: str
    headers: list[SliceHeader]
    skip_reason: str | None = None
    flags: list[str] = field(default_factory=list)
    reject_reason: str | None = None
    split: str = ""
    time_series: str = ""
    time_point: int = 0
    diffusion: str = ""   # "b-value|direction" of a stack split by diffusion (medload.ingest.diffusion)

    @property
    def first(self) -> SliceHeader:
        return self.headers[0]

    @property
    def value_dtype(self) -> str:
        """How the volume is stored: ``int16`` or ``float32`` (exact for every 16-bit integer).

        ``int16`` when every plane's rescale is integral and either the modality is CT (HU beyond
        int16 are implausible; a slice that has them is refused, never wrapped) or the header proves
        every value fits (for a Modality LUT Sequence, its entries); otherwise ``float32`` -- e.g. PET with fractional slopes, or 16-bit MR whose
        values may reach 65535.
        """
        if not all(float(h.slope).is_integer() and float(h.intercept).is_integer() for h in self.headers):
            return "float32"
        if any(h.modality_lut is not None for h in self.headers):  # a table's range is known: no CT shortcut
            return "int16" if all(fits_int16(h, h.modality) for h in self.headers) else "float32"
        if self.first.modality == "CT" or all(fits_int16(h, h.modality) for h in self.headers):
            return "int16"
        return "float32"

    @property
    def fingerprint(self) -> str:
        """Identity of the source planes (pseudonymised SOP instances and frames), order-independent."""
        h = hashlib.blake2b(digest_size=16, person=b"medload-source")
        for inst, frame in sorted((h_.instance, -1 if h_.frame is None else h_.frame) for h_ in self.headers):
            h.update(f"{inst}:{frame};".encode())
        return h.hexdigest()


def _kind(image_type: tuple[str, ...]) -> tuple[str, str | None]:
    text = "\\".join(image_type)
    if "LOCALIZER" in image_type:
        return "localizer", f"localizer (ImageType {text})"
    if len(image_type) >= 2 and image_type[0] == "DERIVED" and image_type[1] == "SECONDARY":
        return "secondary", f"derived secondary image (ImageType {text})"
    return "image", None


def _orientation_labels(orientations: Iterable[tuple[float, ...]]) -> dict[tuple[float, ...], str]:
    """Cluster orientations within tolerance; label each by its cluster's rounded first member.

    Orientations are visited in sorted order, so the labels do not depend on file order.
    """
    labels: dict[tuple[float, ...], str] = {}
    reps: list[tuple[tuple[float, ...], str]] = []
    for o in sorted(set(orientations)):
        for rep, label in reps:
            if max(abs(a - b) for a, b in zip(o, rep)) <= _ORIENTATION_TOLERANCE:
                labels[o] = label
                break
        else:
            label = ",".join(f"{v:.3f}" for v in o).replace("-0.000", "0.000")
            reps.append((o, label))
            labels[o] = label
    return labels


def _stack_candidates(series: str, descriptor: str, part: list[SliceHeader], time_series: str,
                      tolerance: float) -> list[SeriesCandidate]:
    """The candidates of one part: itself, its stacks sharing positions, or a time-series rejection."""
    key = series_key(series, descriptor)
    stacks = split_stacks(part, tolerance)
    if len(stacks) == 1 and not stacks[0].labels:
        return [SeriesCandidate(key, descriptor, part)]
    timed = [s for s in stacks if s.time_points]
    if timed and time_series == "reject":
        first = timed[0]
        reason = (f"time series of {first.time_points} points ({first.time_attribute} differs between the "
                  f"{first.time_points} planes at each of {len(first.headers)} positions); policy: reject "
                  "(use --time-series split to store one volume per time point)")
        return [SeriesCandidate(key, descriptor, part, reject_reason=reason)]
    return [_split_candidate(series, descriptor, key, s) for s in stacks]


def _split_candidate(series: str, descriptor: str, key: bytes, stack: StackSplit) -> SeriesCandidate:
    split = "/".join(stack.labels)
    sub = f"{descriptor}|split:{split}"
    return SeriesCandidate(series_key(series, sub), sub, stack.headers, flags=list(stack.labels + stack.flags),
                           reject_reason=stack.reject_reason or None, split=split,
                           time_series=key.hex() if stack.time_point else "", time_point=stack.time_point,
                           diffusion=stack.diffusion)


def group_series(headers: Iterable[SliceHeader], *, time_series: str = "split",
                 duplicate_tolerance: float = 0.01) -> list[SeriesCandidate]:
    """Split planes into candidate volumes, sorted by key; skipped parts carry ``skip_reason``.

    ``time_series`` is the policy for stacks at the same positions over time: ``"split"`` into one
    candidate per time point, or ``"reject"`` the whole part (``reject_reason``); planes within
    ``duplicate_tolerance`` mm along the normal share a position."""
    by_series: dict[str, list[SliceHeader]] = defaultdict(list)
    for h in headers:
        by_series[h.series].append(h)
    out = []
    for series, members in by_series.items():
        labels = _orientation_labels(h.orientation for h in members)
        parts: dict[tuple, list[SliceHeader]] = defaultdict(list)
        reasons: dict[tuple, str | None] = {}
        for h in members:
            kind, reason = _kind(h.image_type)
            split = (kind, f"{h.rows}x{h.cols}", labels[h.orientation],
                     f"{h.pixel_spacing[0]:.4f},{h.pixel_spacing[1]:.4f}", h.echo, h.stack)
            parts[split].append(h)
            reasons[split] = reason
        for split, part in parts.items():
            descriptor = "|".join(split)
            if reasons[split] is not None:
                out.append(SeriesCandidate(series_key(series, descriptor), descriptor, part, reasons[split]))
            else:
                out += _stack_candidates(series, descriptor, part, time_series, duplicate_tolerance)
    out.sort(key=lambda c: c.key)
    return out
