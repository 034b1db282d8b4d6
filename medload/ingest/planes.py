"""Geometry and rescale of image planes: single-frame images and frames of Enhanced objects.

A single-frame image carries ImagePositionPatient (0020,0032), ImageOrientationPatient (0020,0037),
PixelSpacing (0028,0030) and RescaleSlope/Intercept (0028,1053/1052) at the top level. An Enhanced
(multi-frame) CT/MR/PET object keeps them in functional group macros: per-frame values in
PerFrameFunctionalGroupsSequence (5200,9230) override shared ones in SharedFunctionalGroupsSequence
(5200,9229) -- PlanePositionSequence (0020,9113), PlaneOrientationSequence (0020,9116),
PixelMeasuresSequence (0028,9110), PixelValueTransformationSequence (0028,9145), FrameContentSequence
(0020,9111) for StackID. Top-level attributes are the last fallback.
"""

from __future__ import annotations

from pydicom.dataset import Dataset

from medload.errors import InputProblem
from medload.ingest import tags

__all__ = ["plane_fields", "frame_plane_fields", "has_functional_groups"]

_MACROS = {
    "ImagePositionPatient": "PlanePositionSequence",
    "ImageOrientationPatient": "PlaneOrientationSequence",
    "PixelSpacing": "PixelMeasuresSequence",
    "SliceThickness": "PixelMeasuresSequence",
    "SpacingBetweenSlices": "PixelMeasuresSequence",
    "RescaleSlope": "PixelValueTransformationSequence",
    "RescaleIntercept": "PixelValueTransformationSequence",
    "StackID": "FrameContentSequence",
}


def has_functional_groups(ds: Dataset) -> bool:
    return "PerFrameFunctionalGroupsSequence" in ds or "SharedFunctionalGroupsSequence" in ds


def plane_fields(ds: Dataset) -> dict:
    """Geometry and rescale fields of one plane, read from top-level attributes of ``ds``."""
    slope = tags.decimal(ds, "RescaleSlope")
    intercept = tags.decimal(ds, "RescaleIntercept")
    return dict(
        orientation=tags.vector(ds, "ImageOrientationPatient", 6),
        position=tags.vector(ds, "ImagePositionPatient", 3),
        pixel_spacing=tags.vector(ds, "PixelSpacing", 2),
        slice_thickness=tags.decimal(ds, "SliceThickness"),
        spacing_between_slices=tags.decimal(ds, "SpacingBetweenSlices"),
        slope=1.0 if slope is None else slope,
        intercept=0.0 if intercept is None else intercept,
        has_rescale=slope is not None or intercept is not None,
        stack=tags.text(ds, "StackID") or "",
    )


def _item(group: Dataset | None, macro: str) -> Dataset | None:
    seq = group.get(macro) if group is not None else None
    return seq[0] if seq else None


def _flat_frame(shared: Dataset | None, per_frame: Dataset | None, top: Dataset) -> Dataset:
    """A flat dataset with, for each attribute we use, the per-frame, else shared, else top-level value."""
    flat = Dataset()
    for keyword, macro in _MACROS.items():
        for source in (_item(per_frame, macro), _item(shared, macro), top):
            if source is not None and keyword in source:
                flat[keyword] = source[keyword]
                break
    return flat


def frame_plane_fields(ds: Dataset, frames: int) -> list[dict]:
    """:func:`plane_fields` of every frame of an Enhanced object, in frame order."""
    shared_seq = ds.get("SharedFunctionalGroupsSequence")
    shared = shared_seq[0] if shared_seq else None
    per_frame_seq = ds.get("PerFrameFunctionalGroupsSequence") or []
    if per_frame_seq and len(per_frame_seq) != frames:
        raise InputProblem("header", f"PerFrameFunctionalGroupsSequence has {len(per_frame_seq)} items for "
                                     f"NumberOfFrames {frames}")
    out = []
    for i in range(frames):
        flat = _flat_frame(shared, per_frame_seq[i] if per_frame_seq else None, ds)
        try:
            out.append(plane_fields(flat))
        except InputProblem as exc:
            raise InputProblem("header", f"frame {i + 1}: {exc.reason}") from None
    return out
