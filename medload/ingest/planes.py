"""Geometry and rescale of image planes: single-frame images and frames of Enhanced objects.

A single-frame image carries ImagePositionPatient (0020,0032), ImageOrientationPatient (0020,0037),
PixelSpacing (0028,0030) and RescaleSlope/Intercept (0028,1053/1052) at the top level. An Enhanced
(multi-frame) CT/MR/PET object keeps them in functional group macros: per-frame values in
PerFrameFunctionalGroupsSequence (5200,9230) override shared ones in SharedFunctionalGroupsSequence
(5200,9229) -- PlanePositionSequence (0020,9113), PlaneOrientationSequence (0020,9116),
PixelMeasuresSequence (0028,9110), PixelValueTransformationSequence (0028,9145), FrameContentSequence
(0020,9111) for StackID and the temporal position, and the macros of what tells stacks at the same
positions apart (:mod:`medload.ingest.splits`): the frame type (MRImageFrameTypeSequence (0018,9226),
CTImageFrameTypeSequence (0018,9329), PETFrameTypeSequence (0018,9751)), MREchoSequence (0018,9114),
MRDiffusionSequence (0018,9117) and CardiacSynchronizationSequence (0018,9118). Top-level attributes
are the last fallback.
"""

from __future__ import annotations

import re
from datetime import date

from pydicom.datadict import keyword_for_tag
from pydicom.dataset import Dataset
from pydicom.tag import Tag

from medload.errors import InputProblem
from medload.ingest import tags
from medload.ingest.vendor import vendor_values

__all__ = ["plane_fields", "frame_plane_fields", "has_functional_groups", "stack_fields", "TIME_ATTRIBUTES"]

#: What places a plane in time, most specific first; each entry is (per-frame keyword, classic keyword).
TIME_ATTRIBUTES = (
    ("TemporalPositionIndex", "TemporalPositionIdentifier"),
    ("NominalCardiacTriggerDelayTime", "TriggerTime"),
    ("FrameAcquisitionNumber", "AcquisitionNumber"),
    ("FrameAcquisitionDateTime", "AcquisitionTime"),
)
_CLOCKS = ("FrameAcquisitionDateTime", "AcquisitionTime")  # read as seconds by _clock_seconds

_FRAME_TYPE = (("MRImageFrameTypeSequence",), ("CTImageFrameTypeSequence",), ("PETFrameTypeSequence",))
_CONTENT = (("FrameContentSequence",),)
#: keyword -> where a functional group holds it: paths of nested sequences, tried in order
_MACROS: dict[str, tuple[tuple[str, ...], ...]] = {
    "ImagePositionPatient": (("PlanePositionSequence",),),
    "ImageOrientationPatient": (("PlaneOrientationSequence",),),
    "PixelSpacing": (("PixelMeasuresSequence",),),
    "SliceThickness": (("PixelMeasuresSequence",),),
    "SpacingBetweenSlices": (("PixelMeasuresSequence",),),
    "RescaleSlope": (("PixelValueTransformationSequence",),),
    "RescaleIntercept": (("PixelValueTransformationSequence",),),
    "StackID": _CONTENT,
    "FrameType": _FRAME_TYPE,
    "ComplexImageComponent": _FRAME_TYPE,
    "EffectiveEchoTime": (("MREchoSequence",),),
    "DiffusionBValue": (("MRDiffusionSequence",),),
    "DiffusionGradientOrientation": (("MRDiffusionSequence", "DiffusionGradientDirectionSequence"),),
    "TemporalPositionIndex": _CONTENT,
    "FrameAcquisitionNumber": _CONTENT,
    "FrameAcquisitionDateTime": _CONTENT,
    "NominalCardiacTriggerDelayTime": (("CardiacSynchronizationSequence",),),
    "DimensionIndexValues": _CONTENT,
    "DimensionIndexSequence": (),   # top level only: what each DimensionIndexValues value indexes
    "InstanceNumber": (),
}
#: dimensions that :mod:`medload.ingest.splits` reads from their own attributes (or that are positions)
_KNOWN_DIMENSIONS = frozenset({
    "StackID", "InStackPositionNumber", "ImagePositionPatient", "TemporalPositionIndex", "FrameType",
    "ComplexImageComponent", "EffectiveEchoTime", "DiffusionBValue", "DiffusionGradientOrientation",
    "NominalCardiacTriggerDelayTime", "FrameAcquisitionNumber", "FrameAcquisitionDateTime", "TriggerTime",
})


def has_functional_groups(ds: Dataset) -> bool:
    return tags.present(ds, "PerFrameFunctionalGroupsSequence") or tags.present(ds, "SharedFunctionalGroupsSequence")


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
        instance_number=_instance_number(ds),
        **stack_fields(ds),
    )


def _instance_number(ds: Dataset) -> int | None:
    """InstanceNumber (0020,0013), only a last resort to order time points: malformed is absent, not a reason
    to refuse the image."""
    try:
        return tags.integer(ds, "InstanceNumber", default=None)
    except InputProblem:
        return None


def _clock_seconds(ds: Dataset, keyword: str) -> str:
    """Seconds from 0001-01-01 of an acquisition clock, to order time points across midnight: the DT
    FrameAcquisitionDateTime (0018,9074) of a frame with its UTC offset applied; for a classic image
    AcquisitionTime (0008,0032) with AcquisitionDate (0008,0022) (seconds of the day where the date is
    absent), else AcquisitionDateTime (0008,002A). The date is read here only and never kept (see
    :mod:`medload.deid`). "" when absent or malformed."""
    if keyword == "AcquisitionTime":
        time_of_day = _tm_seconds(tags.text(ds, "AcquisitionTime") or "")
        if not time_of_day:
            return _datetime_seconds(tags.text(ds, "AcquisitionDateTime") or "")
        day = _DT.fullmatch(tags.text(ds, "AcquisitionDate") or "")
        if day is None or not day.group(3):
            return time_of_day
        return _datetime_seconds(day.group(1) + day.group(2) + day.group(3) + time_of_day.replace(".", "s.", 1))
    return _datetime_seconds(tags.text(ds, keyword) or "")


#: DT (PS3.5 Table 6.2-1): YYYY[MM[DD[HH[MM[SS[.F{1-6}]]]]]][&ZZXX]; an "s" marks seconds of day (internal)
_DT = re.compile(r"(\d{4})(\d{2})?(\d{2})?(?:(\d{2})(\d{2})?(\d{2})?|(\d+)s)?(\.\d{1,6})?([+-]\d{4})?")


def _datetime_seconds(value: str) -> str:
    m = _DT.fullmatch(value.strip())
    if m is None:
        return ""
    year, month, day, hh, mm, ss, of_day, fraction, offset = m.groups()
    try:
        days = date(int(year), int(month or 1), int(day or 1)).toordinal()
    except ValueError:
        return ""
    seconds = int(of_day) if of_day else int(hh or 0) * 3600 + int(mm or 0) * 60 + int(ss or 0)
    if offset:
        seconds -= (1 if offset[0] == "+" else -1) * (int(offset[1:3]) * 3600 + int(offset[3:5]) * 60)
    return f"{days * 86400 + seconds}{fraction or ''}"


def _tm_seconds(value: str) -> str:
    """Seconds of the day of a TM (HH[MM[SS[.F{1-6}]]]); "" when malformed."""
    whole, _, fraction = value.strip().partition(".")
    if not whole.isdigit() or len(whole) not in (2, 4, 6) or not (fraction or "0").isdigit():
        return ""
    hh, mm, ss = int(whole[0:2]), int(whole[2:4] or 0), int(whole[4:6] or 0)
    return f"{hh * 3600 + mm * 60 + ss}.{fraction or '0'}"


def stack_fields(ds: Dataset) -> dict:
    """What may tell stacks at the same positions apart (see :mod:`medload.ingest.splits`): frame type
    (FrameType (0008,9007) and ComplexImageComponent (0008,9208)), echo time (EffectiveEchoTime
    (0018,9082), else EchoTime (0018,0081)), diffusion (DiffusionBValue (0018,9087) and
    DiffusionGradientOrientation (0018,9089)) and the :data:`TIME_ATTRIBUTES`, as text ("" absent)."""
    times = []
    for per_frame, classic in TIME_ATTRIBUTES:
        keyword = per_frame if tags.present(ds, per_frame) else classic
        times.append(_clock_seconds(ds, keyword) if keyword in _CLOCKS else tags.text(ds, keyword) or "")
    b_value = tags.text(ds, "DiffusionBValue") or ""
    direction = tags.text(ds, "DiffusionGradientOrientation") or ""
    vendor = vendor_values(ds)
    standard = b_value or direction
    return dict(
        frame_type=tags.strings(ds, "FrameType") + tags.strings(ds, "ComplexImageComponent"),
        echo_time=tags.text(ds, "EffectiveEchoTime") or tags.text(ds, "EchoTime") or "",
        diffusion=f"{b_value}|{direction}" if standard else vendor.diffusion,
        gradient_frame="patient" if standard else vendor.gradient_frame,
        times=tuple(times),
        vendor_time=vendor.time,
        dimensions=_dimensions(ds),
    )


def _dimensions(ds: Dataset) -> tuple[tuple[str, str], ...]:
    """(dimension, index) of each DimensionIndexValues (0020,9157) value whose dimension, named by
    DimensionIndexPointer (0020,9165) of the DimensionIndexSequence (0020,9222), is not read from its own
    attribute (:data:`_KNOWN_DIMENSIONS`): e.g. a vendor's private dimension. The dimension is its
    keyword, else its tag as ``gggg,eeee``."""
    try:
        values = tags.strings(ds, "DimensionIndexValues")
    except InputProblem:  # malformed: no dimension to split by, not a reason to refuse the image
        return ()
    pointers = ds.get("DimensionIndexSequence") or []
    if not values or len(values) != len(pointers):
        return ()
    out = []
    for value, item in zip(values, pointers):
        tag = Tag(item.get("DimensionIndexPointer", 0) or 0)
        name = keyword_for_tag(tag) or f"{tag.group:04X},{tag.element:04X}"
        if name not in _KNOWN_DIMENSIONS:
            out.append((name, value))
    return tuple(out)


def _item(group: Dataset | None, path: tuple[str, ...]) -> Dataset | None:
    """The first item at the end of a path of nested sequences in ``group``, or None."""
    for macro in path:
        seq = group.get(macro) if group is not None else None
        group = seq[0] if seq else None
    return group


def _flat_frame(shared: Dataset | None, per_frame: Dataset | None, top: Dataset) -> Dataset:
    """A flat dataset with, for each attribute we use, the per-frame, else shared, else top-level value."""
    flat = Dataset()
    for keyword, paths in _MACROS.items():
        sources = [_item(group, path) for group in (per_frame, shared) for path in paths] + [top]
        for source in sources:
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
