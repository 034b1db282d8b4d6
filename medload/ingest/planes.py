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

from pydicom.dataset import Dataset

from medload.errors import InputProblem
from medload.ingest import tags

__all__ = ["plane_fields", "frame_plane_fields", "has_functional_groups", "stack_fields", "TIME_ATTRIBUTES"]

#: What places a plane in time, most specific first; each entry is (per-frame keyword, classic keyword).
TIME_ATTRIBUTES = (
    ("TemporalPositionIndex", "TemporalPositionIdentifier"),
    ("NominalCardiacTriggerDelayTime", "TriggerTime"),
    ("FrameAcquisitionNumber", "AcquisitionNumber"),
    ("FrameAcquisitionDateTime", "AcquisitionTime"),
)
_CLOCKS = {"FrameAcquisitionDateTime": True, "AcquisitionTime": False}  # keyword -> is a DT (else a TM)

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
        **stack_fields(ds),
    )


def _time_of_day(value: str, is_datetime: bool) -> str:
    """Seconds since midnight of a TM (HHMMSS.FFFFFF) or of the time part of a DT (YYYYMMDDHHMMSS.FFFFFF
    with an optional &ZZXX offset): orders time points without the date, which is never kept (see
    :mod:`medload.ingest.deid`). "" when malformed."""
    if is_datetime:
        value = (value[:-5] if len(value) > 5 and value[-5] in "+-" else value)[8:]
    whole, _, fraction = value.partition(".")
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
        keyword = per_frame if per_frame in ds else classic
        value = tags.text(ds, keyword) or ""
        if value and keyword in _CLOCKS:
            value = _time_of_day(value, _CLOCKS[keyword])
        times.append(value)
    b_value = tags.text(ds, "DiffusionBValue") or ""
    direction = tags.text(ds, "DiffusionGradientOrientation") or ""
    return dict(
        frame_type=tags.strings(ds, "FrameType") + tags.strings(ds, "ComplexImageComponent"),
        echo_time=tags.text(ds, "EffectiveEchoTime") or tags.text(ds, "EchoTime") or "",
        diffusion=f"{b_value}|{direction}" if b_value or direction else "",
        times=tuple(times),
    )


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
