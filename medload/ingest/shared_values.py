"""One object per distinct value of the header fields that repeat from plane to plane.

The ingest process holds every plane's :class:`~medload.ingest.headers.SliceHeader` from the header pass
until its series is planned: at archive scale, the largest thing it holds (by tracemalloc, 1,145 bytes a
header before this sharing, 892 after, 907 since a header is a named tuple; the process peaks at 1.5 GB per
million files: docs/benchmarks.md). Each header arrives unpickled from a decoding process with objects
of its own, although most of its fields -- the pseudonymised series, study and patient, the orientation,
the pixel spacing, the transfer syntax, the scanner -- are equal for every plane of a series. Sharing one
object per distinct value keeps only what differs (the file, the position, the instance) per header.
"""

from __future__ import annotations

from typing import Any

from medload.ingest.headers import SliceHeader

__all__ = ["SharedValues"]

# the fields whose values repeat and are objects of their own after unpickling (strings, tuples, floats, ints
# past 256); not the small ints, flags and Nones Python shares anyway, nor what differs from plane to plane
# (file, frame, instance, position, pixel offset, size, InstanceNumber, vendor timer, dimension indices)
_SHARED = ("sop_class", "series", "frame_of_reference", "study", "patient", "modality", "image_type", "rows", "cols",
           "photometric", "slope", "intercept", "orientation", "pixel_spacing", "slice_thickness",
           "spacing_between_slices", "transfer_syntax", "echo", "stack", "manufacturer", "model", "kernel", "body_part",
           "window", "frame_type", "echo_time", "diffusion", "times", "modality_lut", "gradient_frame")


class SharedValues:
    """The distinct values seen so far, per field; kept for one ingest's header pass. A value unique to its
    header costs a table entry (about 40 bytes), a repeated one saves its own objects (80-300 bytes)."""

    def __init__(self) -> None:
        self._seen: list[tuple[int, dict[Any, Any]]] = [(SliceHeader._fields.index(name), {}) for name in _SHARED]

    def share(self, header: SliceHeader) -> SliceHeader:
        """``header`` with each repeating field's value replaced by the object already held for an equal value
        of the same type (1 and 1.0 are equal, and stay apart): equal to it, holding fewer objects."""
        values = list(header)
        for i, seen in self._seen:
            value = values[i]
            kept = seen.setdefault(value, value)
            if kept is not value and type(kept) is type(value):
                values[i] = kept
        return tuple.__new__(SliceHeader, values)
