"""A DICOM SEG re-encoded in the TILED_FULL dimension organization, as large segmentations are written."""

from __future__ import annotations

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.pixels import pack_bits
from pydicom.tag import Tag

from medload.errors import ConfigError

__all__ = ["to_tiled_full"]


def _item(**elements: object) -> Dataset:
    item = Dataset()
    for keyword, value in elements.items():
        setattr(item, keyword, value)
    return item


def to_tiled_full(ds: pydicom.Dataset) -> pydicom.Dataset:
    """The same BINARY SEG, with every frame present (highdicom's ``omit_empty_frames=False``), as a
    TILED_FULL object: no PerFrameFunctionalGroupsSequence; frames ordered by segment, then plane; one
    tile per plane (TotalPixelMatrixRows/Columns = Rows/Columns); TotalPixelMatrixOriginSequence,
    ImageOrientationSlide and SpacingBetweenSlices place the planes (PS3.3 C.7.6.17.3).

    Frame positions start at z = 0 in TILED_FULL (highdicom's reading, which medload uses), so the
    planes must lie at z = 0, s, 2s ... with a constant orientation. Changes ``ds`` in place."""
    per_frame = ds.PerFrameFunctionalGroupsSequence
    planes = sorted({tuple(float(v) for v in f.PlanePositionSequence[0].ImagePositionPatient) for f in per_frame},
                    key=lambda p: p[2])
    segments = [int(s.SegmentNumber) for s in ds.SegmentSequence]
    where = {(int(f.SegmentIdentificationSequence[0].ReferencedSegmentNumber),
              tuple(float(v) for v in f.PlanePositionSequence[0].ImagePositionPatient)): k
             for k, f in enumerate(per_frame)}
    if len(where) != len(planes) * len(segments) or planes[0][2] != 0:
        raise ConfigError("to_tiled_full needs every frame of every segment (omit_empty_frames=False), planes from z = 0")
    steps = np.diff([p[2] for p in planes])
    if len(planes) > 1 and not np.allclose(steps, steps[0]):
        raise ConfigError("to_tiled_full needs evenly spaced planes")
    shared = ds.SharedFunctionalGroupsSequence[0]
    frames = ds.pixel_array.reshape(int(ds.NumberOfFrames), ds.Rows, ds.Columns)
    order = [where[(s, p)] for s in segments for p in planes]
    del ds.PerFrameFunctionalGroupsSequence
    ds.DimensionOrganizationType = "TILED_FULL"
    ds.TotalPixelMatrixRows, ds.TotalPixelMatrixColumns = ds.Rows, ds.Columns
    ds.TotalPixelMatrixFocalPlanes = len(planes)
    ds.ImageOrientationSlide = list(shared.PlaneOrientationSequence[0].ImageOrientationPatient)
    ds.TotalPixelMatrixOriginSequence = [_item(XOffsetInSlideCoordinateSystem=planes[0][0],
                                               YOffsetInSlideCoordinateSystem=planes[0][1])]
    shared.PixelMeasuresSequence[0].SpacingBetweenSlices = float(steps[0]) if len(planes) > 1 else 1.0
    organization = ds.DimensionOrganizationSequence[0].DimensionOrganizationUID
    ds.DimensionIndexSequence = [
        _item(DimensionOrganizationUID=organization, DimensionIndexPointer=Tag(pointer), FunctionalGroupPointer=Tag(group))
        for pointer, group in (("ReferencedSegmentNumber", "SegmentIdentificationSequence"),
                               ("ColumnPositionInTotalImagePixelMatrix", "PlanePositionSlideSequence"),
                               ("RowPositionInTotalImagePixelMatrix", "PlanePositionSlideSequence"))]
    ds.PixelData = pack_bits(frames[order]) if ds.BitsAllocated == 1 else frames[order].tobytes()
    return ds
