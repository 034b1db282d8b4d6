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
  ``label`` a mask or label-object path, relative to the mapping file's folder (or absolute).

Every identifier is pseudonymised at once (like image headers), so raw UIDs never travel further. File
names carry UIDs too (a mask named after its SeriesInstanceUID, a SEG after its SOPInstanceUID): a label
input is named in records, reports and messages by :func:`label_source_name` -- its path relative to the
folder it was found in, every UID in it replaced by ``uid-`` and a keyed pseudonym -- never by its path.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pydicom

from medload.deid import Pseudonymizer
from medload.errors import ConfigError, InputProblem
from medload.ingest import tags
from medload.ingest.discover import SourceRef, read_source
from medload.labels import LabelVolume, SeriesGrid, mask_to_grid, rtstruct_to_grid, seg_to_grid

__all__ = ["LabelInput", "LABEL_SOP_CLASSES", "label_input_from_dataset", "label_inputs_from_path", "place_label",
           "label_fingerprint", "label_source_name", "pseudonymous", "UID_IN_NAME"]

#: DICOM objects that carry labels
LABEL_SOP_CLASSES = {
    "1.2.840.10008.5.1.4.1.1.66.4": "seg",        # Segmentation Storage
    "1.2.840.10008.5.1.4.1.1.481.3": "rtstruct",  # RT Structure Set Storage
}
#: a DICOM UID (digits and dots, PS3.5 9.1) with at least four components, in a file name or a message; UIDs
#: under the standard's own root 1.2.840.10008 (SOP classes, transfer syntaxes) identify no one and stay
UID_IN_NAME = re.compile(r"(?<![\d.])(?!1\.2\.840\.10008\.)\d+(?:\.\d+){3,}")
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
        """The input's path as found (may hold UIDs: never stored or printed; see :func:`label_source_name`)."""
        return self.ref.display


def pseudonymous(text: str, pseudo: Pseudonymizer) -> str:
    """``text`` with every UID in it (:data:`UID_IN_NAME`) replaced by ``uid-`` and its keyed pseudonym as a
    SeriesInstanceUID: a mask named after its series shows the ``series`` field of that series' record."""
    return UID_IN_NAME.sub(lambda m: "uid-" + pseudo.uid("series", m.group()), text)


def label_source_name(ref: SourceRef, roots: Sequence[str | Path], pseudo: Pseudonymizer) -> str:
    """The name of a label input in label and quarantine records, reports and messages: its path relative
    to the deepest of ``roots`` (``--labels`` folders, the folders of mapping files and single files, ingest
    sources) that holds it, else its file name; ``!member`` for an archive member; every UID in it
    pseudonymised (:func:`pseudonymous`). ``masks/1.2.826.0.1.3680043.2.1125.5.nii.gz`` found under
    ``--labels /data/labels`` is ``masks/uid-<32 hex digits>.nii.gz``."""
    if ref.origin is not None:
        file, _, member = ref.origin.partition("!")
    else:
        file, member = ref.path, ref.member or ""
    where = os.path.abspath(file)
    folders = [os.path.abspath(r) for r in roots]
    folders = [r if os.path.isdir(r) else os.path.dirname(r) for r in folders]
    base = max((r for r in folders if os.path.commonpath([where, r]) == r), key=len, default=None)
    name = os.path.relpath(where, base) if base is not None else os.path.basename(where)
    return pseudonymous(name + (f"!{member}" if member else ""), pseudo)


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
    """The rows of a mapping file; a relative ``label`` path is resolved against the mapping file's folder."""
    csv_file = path.suffix.lower() != ".json"
    try:
        if csv_file:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        else:
            rows = json.loads(path.read_text())
        pairs = [(str(row["series"]), str(row["label"])) for row in rows]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(pseudonymous(f"{path}: a label mapping needs rows with 'series' and 'label' ({exc})",
                                       pseudo)) from None
    out = []
    folder = path.parent.absolute()
    for n, (series, label) in enumerate(pairs):
        row = f"line {n + 2}" if csv_file else f"item {n + 1}"
        given = Path(label)
        target = given if given.is_absolute() else folder / given
        if not target.is_file():
            how = "as given" if given.is_absolute() else f"relative to the mapping file's folder {folder}"
            raise ConfigError(pseudonymous(f"{path}, {row}: label file {label} not found (looked for {target}, {how}; "
                                           "a relative path in a mapping file is relative to the mapping file)", pseudo))
        try:
            kind = _mask_kind(target) or _dicom_label_kind(target)
        except ConfigError as exc:
            raise ConfigError(pseudonymous(f"{path}, {row}: {exc}", pseudo)) from None
        out.append(_by_identity(_file_ref(target), kind, series, pseudo))
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
        raise ConfigError(pseudonymous(f"labels path {path} does not exist", pseudo))
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


def place_label(inp: LabelInput, grid: SeriesGrid, pseudo: Pseudonymizer, roi_map: dict | None,
                name: str | None = None) -> LabelVolume:
    """The label input on ``grid``, called ``name`` (default: :func:`label_source_name` with no roots) in the
    result and in messages; raises :class:`InputProblem` (stage ``labels``) when it does not fit."""
    name = name or label_source_name(inp.ref, (), pseudo)
    if inp.kind in ("nifti", "nrrd", "mha"):
        return mask_to_grid(inp.ref.path, grid, source=name)
    try:
        ds = pydicom.dcmread(_as_file(inp.ref))
    except Exception as exc:  # a damaged label file is a quarantine record, never a crash
        reason = str(exc).replace(inp.ref.path, name)
        raise InputProblem("labels", f"unreadable label object: {type(exc).__name__}: {reason}") from None
    if inp.kind == "seg":
        return seg_to_grid(ds, grid, uid_pseudonym=lambda uid: pseudo.uid("instance", uid), source=name)
    return rtstruct_to_grid(ds, grid, roi_map=roi_map, source=name)


def _as_file(ref: SourceRef) -> str | io.BytesIO:
    return ref.path if ref.member is None else io.BytesIO(read_source(ref))
