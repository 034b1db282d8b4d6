"""Metadata records kept in a store: one per series, one per quarantined input. JSON, never pickle."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields

__all__ = ["SeriesRecord", "LabelRecord", "RejectRecord", "kept_fraction", "percent"]

_RECORD_FORMAT = 1


@dataclass(frozen=True)
class SeriesRecord:
    """What the store knows about one volume.

    Geometry follows NIfTI/MONAI: ``affine`` maps a voxel index ``(column, row, slice, 1)`` to RAS
    millimetres and ``spacing`` is ``(column, row, slice)`` spacing in mm, in the same axis order. The
    array :meth:`medload.Store.read` returns is ``(slice, row, column)`` = ``shape``;
    ``store.read(key).transpose(2, 1, 0)`` is the NIfTI-ordered array that ``affine`` describes.
    Identifiers are keyed pseudonyms, never the DICOM values. ``shard`` is filled in when the record
    is read (it says where the series lives; it is not stored, so shards can be regrouped).
    ``split`` names the stack of a series that held several at the same positions (``"phase"``,
    ``"echo_2"``, ``"t_07"``; also among ``flags``), and the time points of one time series share
    ``time_series`` (an id) and number themselves by ``time_point`` (1..N; 0 outside a time series).
    A stack split by diffusion keeps its ``b_value`` and, where the headers give it in the patient frame,
    its unit ``gradient`` (LPS) and ``gradient_image`` (along the voxel axes: column, row, slice), the
    values of FSL's ``.bval``/``.bvec`` (:func:`medload.storage.nifti.export_nifti` writes them).

    Examples:
        >>> rec = store.record(store.series()[0].key[:6])                # a unique key prefix is enough
        >>> rec.shape, rec.spacing, rec.manufacturer, rec.kernel
        ((28, 512, 512), (0.451171875, 0.451171875, 5.0), 'Philips', 'UB')
    """

    key: str
    shape: tuple[int, int, int]
    dtype: str
    spacing: tuple[float, float, float]
    affine: tuple[tuple[float, ...], ...]
    modality: str
    digest: str
    orientation: tuple[float, ...]
    positions: tuple[tuple[float, float, float], ...]
    patient: str
    study: str
    series: str
    source_fingerprint: str
    sources: tuple[str, ...]
    shard: str = ""
    space: str = "RAS"
    manufacturer: str | None = None
    model: str | None = None
    kernel: str | None = None
    body_part: str | None = None
    image_type: tuple[str, ...] = ()
    slice_thickness: float | None = None
    scanner_windows: tuple[tuple[float, float], ...] = ()
    windows: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    padding_voxels: int = 0
    frame_of_reference: str = ""
    split: str = ""
    time_series: str = ""
    time_point: int = 0
    b_value: float | None = None
    gradient: tuple[float, float, float] | None = None
    gradient_image: tuple[float, float, float] | None = None
    format: int = _RECORD_FORMAT

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        """The stored form (without ``shard``)."""
        return _stored_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> SeriesRecord:
        doc = json.loads(data)
        known = {f.name for f in fields(cls)}
        doc = {k: _tuples(v) for k, v in doc.items() if k in known}
        return cls(**doc)

    @property
    def key_bytes(self) -> bytes:
        return bytes.fromhex(self.key)


def kept_fraction(inside: int, total: int) -> float:
    """``inside / total`` rounded down to 4 decimals (a :attr:`LabelRecord.kept`), so that only a label kept
    whole says 1.0; 1.0 when ``total`` is 0 (an empty label loses nothing)."""
    return math.floor(inside / total * 10_000) / 10_000 if total else 1.0


def percent(fraction: float) -> str:
    """``0.0315`` -> ``"3.1%"``, ``0.8`` -> ``"80%"``: rounded down to 0.1%, so a cut label never shows 100%."""
    return f"{math.floor(fraction * 1000) / 10:g}%"


@dataclass(frozen=True)
class LabelRecord:
    """The label map of a series: stored under the series' slice keys in the ``labels`` sub-database
    of ``shard`` (the series' own shard, or a later one when labels came after the images).

    ``classes`` maps class id (as text, JSON keys) to name; ``foreground[z][c]`` counts the voxels of
    the c-th class (in ascending id order) on slice z -- what the foreground-balanced sampler uses.
    ``source_fingerprint`` identifies the label input, so re-ingesting it adds nothing. ``source`` names
    it by its path relative to the folder it was found in, with every UID in it pseudonymised (never a
    raw path: see :func:`medload.ingest.labels.label_source_name`). ``kept`` is the fraction of the
    input's foreground that lies inside the series grid (1.0: all of it; less: the rest lay outside the
    series and was cut off); ``None`` in records written before medload measured it.
    """

    key: str
    dtype: str
    classes: dict[str, str]
    foreground: tuple[tuple[int, ...], ...]
    kind: str
    source: str
    source_fingerprint: str
    digest: str
    resampled: bool = False
    notes: tuple[str, ...] = ()
    kept: float | None = None
    shard: str = ""
    format: int = _RECORD_FORMAT

    def to_json(self) -> bytes:
        """The stored form (without ``shard``)."""
        return _stored_json(self)

    @classmethod
    def from_json(cls, data: bytes) -> LabelRecord:
        doc = json.loads(data)
        known = {f.name for f in fields(cls)}
        return cls(**{k: (v if k == "classes" else _tuples(v)) for k, v in doc.items() if k in known})

    @property
    def class_ids(self) -> list[int]:
        return sorted(int(c) for c in self.classes)


@dataclass(frozen=True)
class RejectRecord:
    """An input that was not ingested, and why.

    ``status`` is ``"rejected"`` (broken, or refused by a correctness policy), ``"skipped"`` (valid
    DICOM that is not a volume: localizer, secondary capture, report...), ``"ignored"`` (not DICOM at
    all: text, JSON, NIfTI, PNG...; see :mod:`medload.ingest.sniff`), or ``"resolved"``: a later
    ingest stored its source, superseding its earlier records (:mod:`medload.storage.rejects`; never
    listed by :meth:`~medload.storage.store.Store.rejects`). ``stage`` says where it was
    decided (``retrieve`` for a DICOMweb source, ``discover``, ``header``, ``series``, ``geometry``, ``decode``,
    ``plausibility``). ``sha256`` is that of the input's bytes where medload could read them (not for
    links, nor for archive members refused unread, nor for zero-filled files over 1 MiB, not read in full).

    Examples:
        >>> r = store.rejects()[0]
        >>> r.status, r.stage, r.reason
        ('skipped', 'header', 'Secondary Capture Image Storage (1.2.840.10008.5.1.4.1.1.7) is not a CT/MR/PET volume image')
    """

    status: str
    stage: str
    reason: str
    source: str
    sha256: str | None = None
    series: str | None = None
    sources: tuple[str, ...] = field(default=())

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RejectRecord:
        return cls(**{k: _tuples(v) for k, v in json.loads(data).items()})

    @property
    def record_key(self) -> bytes:
        """A stable key: the same input with the same verdict is recorded once, however often it is seen."""
        ident = json.dumps([self.status, self.stage, self.source, self.sha256, self.series, self.reason])
        return hashlib.blake2b(ident.encode(), digest_size=16, person=b"medload-reject").digest()


#: Fields added after records were first written, left out at their default: a record they do not
#: concern keeps the bytes it had before they existed.
_LATER_FIELDS = {"split": "", "time_series": "", "time_point": 0, "b_value": None, "gradient": None,
                 "gradient_image": None}


def _stored_json(record: SeriesRecord | LabelRecord) -> bytes:
    """Compact, key-sorted JSON of a record's fields but ``shard`` (where the reader found it)."""
    doc = asdict(record)
    del doc["shard"]
    for name, default in _LATER_FIELDS.items():
        if doc.get(name, default) == default:
            doc.pop(name, None)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
