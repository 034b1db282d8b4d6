"""Label inputs of an ingest: which label object goes with which series, and putting it on its grid.

Label inputs come three ways (``medload ingest SRC STORE --labels PATH``):

- **DICOM SEG and RTSTRUCT** found among the sources or under ``--labels``: paired with the series
  they reference -- ReferencedSeriesSequence (0008,1115) of a SEG, RTReferencedSeriesSequence
  (3006,0014) of an RTSTRUCT -- or, when they name none, with the only volume of their
  FrameOfReferenceUID (0020,0052);
- **NIfTI / NRRD masks** in a ``--labels`` folder, named after the SeriesInstanceUID or a series key
  prefix (``1.2.840....nii.gz``, ``3f2a9c.nrrd``);
- **a mapping file** (``--labels map.csv`` with columns ``series,label`` or ``map.json``, a list of
  ``{"series": ..., "label": ...}``): ``series`` is a SeriesInstanceUID or a series key prefix,
  ``label`` a mask or label-object path (relative to the mapping file).

Every identifier is pseudonymised at once (like image headers), so raw UIDs never travel further.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pydicom

from medload.errors import ConfigError, InputProblem
from medload.ingest import tags
from medload.ingest.deid import Pseudonymizer
from medload.ingest.discover import SourceRef, read_source
from medload.labels import LabelVolume, SeriesGrid, mask_to_grid, rtstruct_to_grid, seg_to_grid

__all__ = ["LabelInput", "LABEL_SOP_CLASSES", "label_input_from_dataset", "label_inputs_from_path", "place_label",
           "label_fingerprint"]

#: DICOM objects that carry labels
LABEL_SOP_CLASSES = {
    "1.2.840.10008.5.1.4.1.1.66.4": "seg",        # Segmentation Storage
    "1.2.840.10008.5.1.4.1.1.481.3": "rtstruct",  # RT Structure Set Storage
}
_MASK_SUFFIXES = {".nii": "nifti", ".nii.gz": "nifti", ".nrrd": "nrrd", ".nhdr": "nrrd", ".mha": "mha", ".mhd": "mha"}


@dataclass(frozen=True)
class LabelInput:
    """A label object or mask, and what it says (or is told) about its series.

    ``series`` holds pseudonyms of the SeriesInstanceUIDs it references or is mapped to,
    ``key_prefix`` a store key prefix it is mapped to, ``frame_of_reference`` the pseudonym of its
    FrameOfReferenceUID (DICOM objects only).
    """

    ref: SourceRef
    kind: str
    series: tuple[str, ...] = ()
    key_prefix: str | None = None
    frame_of_reference: str | None = None

    @property
    def display(self) -> str:
        return self.ref.display


def _mask_kind(path: Path) -> str | None:
    name = path.name.lower()
    return next((kind for suffix, kind in _MASK_SUFFIXES.items() if name.endswith(suffix)), None)


def _stem(path: Path) -> str:
    name = path.name
    for suffix in sorted(_MASK_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def label_input_from_dataset(ds: pydicom.Dataset, ref: SourceRef, sop_class: str, pseudo: Pseudonymizer) -> LabelInput:
    """The LabelInput of a SEG or RTSTRUCT header (referenced series and frame of reference)."""
    uids: list[str] = []
    for item in ds.get("ReferencedSeriesSequence", []) or []:
        uids.append(tags.text(item, "SeriesInstanceUID") or "")
    frames = []
    for frame in ds.get("ReferencedFrameOfReferenceSequence", []) or []:
        frames.append(tags.text(frame, "FrameOfReferenceUID") or "")
        for study in frame.get("RTReferencedStudySequence", []) or []:
            for series in study.get("RTReferencedSeriesSequence", []) or []:
                uids.append(tags.text(series, "SeriesInstanceUID") or "")
    frame_of_reference = tags.text(ds, "FrameOfReferenceUID") or next((f for f in frames if f), None)
    return LabelInput(
        ref=ref, kind=LABEL_SOP_CLASSES[sop_class],
        series=tuple(sorted({pseudo.uid("series", u) for u in uids if u})),
        frame_of_reference=None if frame_of_reference is None else pseudo.uid("frame_of_reference", frame_of_reference),
    )


def _by_identity(ref: SourceRef, kind: str, series: str, pseudo: Pseudonymizer) -> LabelInput:
    """A mask mapped to ``series``: a series key prefix (hex) or a SeriesInstanceUID."""
    text = series.strip()
    if text and all(c in "0123456789abcdef" for c in text.lower()) and "." not in text:
        return LabelInput(ref, kind, key_prefix=text.lower())
    return LabelInput(ref, kind, series=(pseudo.uid("series", text),))


def _file_ref(path: Path) -> SourceRef:
    return SourceRef(str(path.absolute()), None, path.stat().st_size)


def _mapping(path: Path, pseudo: Pseudonymizer) -> list[LabelInput]:
    try:
        if path.suffix.lower() == ".json":
            rows = json.loads(path.read_text())
        else:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        pairs = [(str(row["series"]), str(row["label"])) for row in rows]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: a label mapping needs rows with 'series' and 'label' ({exc})") from None
    out = []
    for series, label in pairs:
        target = (path.parent / label) if not Path(label).is_absolute() else Path(label)
        if not target.is_file():
            raise ConfigError(f"{path}: label file {label} not found")
        out.append(_by_identity(_file_ref(target), _mask_kind(target) or _dicom_label_kind(target), series, pseudo))
    return out


def _dicom_label_kind(path: Path) -> str:
    try:
        sop_class = str(pydicom.dcmread(path, stop_before_pixels=True).get("SOPClassUID", ""))
    except Exception as exc:  # pydicom raises many types
        raise ConfigError(f"label file {path} is neither a NIfTI/NRRD mask nor readable DICOM ({exc})") from None
    if sop_class not in LABEL_SOP_CLASSES:
        raise ConfigError(f"label file {path} is DICOM but not a SEG or RTSTRUCT (SOP class {sop_class})")
    return LABEL_SOP_CLASSES[sop_class]


def label_inputs_from_path(path: str | Path, pseudo: Pseudonymizer) -> tuple[list[LabelInput], list[SourceRef]]:
    """From a ``--labels`` argument: mapped masks, masks named after their series, and the DICOM
    files to pass through the header pass (SEG/RTSTRUCT among them pair by their references)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"labels path {path} does not exist")
    if path.is_file() and path.suffix.lower() in (".csv", ".json"):
        return _mapping(path, pseudo), []
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    masks, dicom = [], []
    for f in files:
        kind = _mask_kind(f)
        if kind is None:
            dicom.append(_file_ref(f))
        else:
            masks.append(_by_identity(_file_ref(f), kind, _stem(f), pseudo))
    return masks, dicom


def label_fingerprint(inp: LabelInput, roi_map: dict | None) -> str:
    """Identity of a label input: its bytes (and the ROI map that named its classes)."""
    h = hashlib.blake2b(read_source(inp.ref), digest_size=16, person=b"medload-label")
    if roi_map and inp.kind == "rtstruct":
        h.update(json.dumps(roi_map, sort_keys=True).encode())
    return h.hexdigest()


def place_label(inp: LabelInput, grid: SeriesGrid, pseudo: Pseudonymizer, roi_map: dict | None) -> LabelVolume:
    """The label input on ``grid``; raises :class:`InputProblem` (stage ``labels``) when it does not fit."""
    if inp.kind in ("nifti", "nrrd", "mha"):
        return mask_to_grid(inp.ref.path, grid)
    try:
        ds = pydicom.dcmread(_as_file(inp.ref))
    except Exception as exc:  # a damaged label file is a quarantine record, never a crash
        raise InputProblem("labels", f"unreadable label object: {type(exc).__name__}: {exc}") from None
    if inp.kind == "seg":
        return seg_to_grid(ds, grid, uid_pseudonym=lambda uid: pseudo.uid("instance", uid), source=inp.display)
    return rtstruct_to_grid(ds, grid, roi_map=roi_map, source=inp.display)


def _as_file(ref: SourceRef):
    return ref.path if ref.member is None else io.BytesIO(read_source(ref))
