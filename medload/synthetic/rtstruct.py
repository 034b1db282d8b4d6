"""Synthetic RT Structure Sets (RTSTRUCT) drawn on a synthetic series, for label tests.

Polygons are given in continuous ``(column, row)`` voxel index coordinates of a slice (voxel centre
``[i, j]`` is the point ``(j, i)``) and written as ContourData in LPS mm through the geometry of the
series' files: ImagePositionPatient of the slice, ImageOrientationPatient and PixelSpacing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import cast

import numpy as np
import pydicom
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset
from pydicom.uid import RTStructureSetStorage

from medload.errors import ConfigError
from medload.synthetic.dataset import MANUFACTURER, new_dataset, save, synthetic_uid
from medload.synthetic.geometry import ds_values
from medload.synthetic.spec import GeneratedSeries

__all__ = ["make_rtstruct", "square_polygon"]

Polygons = Sequence[np.ndarray]

_COPIED = ("PatientName", "PatientID", "PatientBirthDate", "PatientSex", "StudyInstanceUID", "StudyDate",
           "StudyTime", "AccessionNumber", "StudyID", "StudyDescription", "ReferringPhysicianName")


def square_polygon(row0: int, row1: int, col0: int, col1: int) -> np.ndarray:
    """Corners ``(4, 2)`` in (column, row) index coordinates of the block ``[row0:row1, col0:col1]``:
    on half-integers, so exactly the centres of that block lie inside."""
    return np.array([[col0 - 0.5, row0 - 0.5], [col1 - 0.5, row0 - 0.5],
                     [col1 - 0.5, row1 - 0.5], [col0 - 0.5, row1 - 0.5]], dtype=np.float64)


def _item(**elements: object) -> Dataset:
    item = Dataset()
    for keyword, value in elements.items():
        setattr(item, keyword, value)
    return item


def _slices(series: GeneratedSeries) -> tuple[list[tuple[str, str, int | None]], np.ndarray, Dataset]:
    """Per slice (SOPClassUID, SOPInstanceUID, frame number or None); the in-plane geometry (columns: LPS
    step of the column index, of the row index, unit normal); and the header of the first file."""
    headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in series.paths]
    first = headers[0]
    refs: list[tuple[str, str, int | None]]
    if len(headers) == 1 and int(first.get("NumberOfFrames", 1)) > 1:
        refs = [(first.SOPClassUID, first.SOPInstanceUID, k + 1) for k in range(int(first.NumberOfFrames))]
        plane = first.SharedFunctionalGroupsSequence[0]
        iop = plane.PlaneOrientationSequence[0].ImageOrientationPatient
        spacing = plane.PixelMeasuresSequence[0].PixelSpacing
    else:
        refs = [(h.SOPClassUID, h.SOPInstanceUID, None) for h in headers]
        iop, spacing = first.ImageOrientationPatient, first.PixelSpacing
    iop = np.asarray(iop, dtype=np.float64)
    row_spacing, col_spacing = (float(s) for s in spacing)
    geometry = np.eye(4)
    geometry[:3, 0] = iop[:3] * col_spacing  # increasing column index
    geometry[:3, 1] = iop[3:] * row_spacing  # increasing row index
    geometry[:3, 2] = np.cross(iop[:3], iop[3:])
    return refs, geometry, first


def _to_lps(series: GeneratedSeries, geometry: np.ndarray, k: float, poly: np.ndarray) -> np.ndarray:
    """LPS points of polygon vertices: ``(N, 2)`` on slice ``k``, or ``(N, 3)`` (column, row, slice) per vertex.

    A vertex on an integer slice inside the series is placed with that slice's ImagePositionPatient;
    any other slice position is interpolated (or extrapolated) along the IPPs.
    """
    poly = np.asarray(poly, dtype=np.float64)
    if poly.ndim != 2 or poly.shape[1] not in (2, 3):
        raise ConfigError(f"polygon must be (N, 2) or (N, 3) index coordinates, got shape {poly.shape}")
    z = poly[:, 2] if poly.shape[1] == 3 else np.full(len(poly), float(k))
    ipp = np.asarray(series.ipp, dtype=np.float64)
    step = (ipp[-1] - ipp[0]) / (len(ipp) - 1) if len(ipp) > 1 else geometry[:3, 2] * series.spec.slice_spacing
    origin = np.array([ipp[int(zk)] if zk == int(zk) and 0 <= zk < len(ipp) else ipp[0] + zk * step for zk in z])
    return origin + poly[:, :1] * geometry[:3, 0] + poly[:, 1:2] * geometry[:3, 1]


def make_rtstruct(
    series: GeneratedSeries,
    rois: Mapping[str, Sequence[tuple[float, Polygons]]],
    out_path: Path,
    *,
    contour_types: Mapping[str, str] | None = None,
    label: str = "synthetic",
) -> Path:
    """Write an RTSTRUCT Part 10 file whose contours are drawn on ``series``.

    Args:
        series: what :func:`medload.synthetic.make_series` returned; its files are read for SOP Instance
            UIDs, FrameOfReferenceUID and geometry.
        rois: ROI name -> list of (slice index, polygons). ROI numbers are 1, 2, ... in dict order. A
            polygon is ``(N, 2)`` (column, row) index coordinates on that slice, or ``(N, 3)`` (column,
            row, slice) per vertex (for tilted or off-grid test contours). A non-integer slice index
            gives a contour between slices.
        out_path: the file to write (never overwritten).
        contour_types: ROI name -> ContourGeometricType (3006,0042); default CLOSED_PLANAR, or POINT for
            a one-vertex polygon.
        label: StructureSetLabel (3006,0002).

    Writes the Patient and General Study modules (copied from the series), RT Series (Modality RTSTRUCT),
    Structure Set (ReferencedFrameOfReferenceSequence > RTReferencedStudySequence >
    RTReferencedSeriesSequence > ContourImageSequence listing every slice; StructureSetROISequence),
    ROI Contour (ContourImageSequence of the nearest slice per contour) and RT ROI Observations.
    """
    out_path = Path(out_path)
    refs, geometry, first = _slices(series)
    frame_uid = str(first.FrameOfReferenceUID)
    uid = synthetic_uid("rtstruct", series.series_uid, label, out_path.name, *rois)
    ds = new_dataset(RTStructureSetStorage, uid)
    for keyword in _COPIED:
        if keyword in first:
            setattr(ds, keyword, cast(DataElement, first.data_element(keyword)).value)  # present: checked above
    ds.Modality = "RTSTRUCT"
    ds.SeriesInstanceUID = synthetic_uid("rtstruct-series", uid)
    ds.SeriesNumber = 900
    ds.SeriesDescription = f"RTSTRUCT {label}"[:64]
    ds.InstanceNumber = 1
    ds.Manufacturer = MANUFACTURER
    ds.StructureSetLabel = label[:16]
    ds.StructureSetDate, ds.StructureSetTime = ds.get("StudyDate", ""), "100000"

    def image_ref(k: int) -> Dataset:
        sop_class, sop_uid, frame = refs[k]
        ref = _item(ReferencedSOPClassUID=sop_class, ReferencedSOPInstanceUID=sop_uid)
        if frame is not None:
            ref.ReferencedFrameNumber = frame
        return ref

    ds.ReferencedFrameOfReferenceSequence = [_item(
        FrameOfReferenceUID=frame_uid,
        RTReferencedStudySequence=[_item(
            ReferencedSOPClassUID="1.2.840.10008.3.1.2.3.1",  # Detached Study Management (retired, as TPSs write)
            ReferencedSOPInstanceUID=series.study_uid,
            RTReferencedSeriesSequence=[_item(
                SeriesInstanceUID=series.series_uid,
                ContourImageSequence=[image_ref(k) for k in range(len(refs))],
            )],
        )],
    )]
    types = dict(contour_types or {})
    ds.StructureSetROISequence, ds.ROIContourSequence, ds.RTROIObservationsSequence = [], [], []
    for number, (name, placements) in enumerate(rois.items(), start=1):
        ds.StructureSetROISequence.append(_item(
            ROINumber=number, ReferencedFrameOfReferenceUID=frame_uid, ROIName=name, ROIGenerationAlgorithm="MANUAL"))
        contours = []
        for k, polygons in placements:
            nearest = int(np.clip(np.rint(k), 0, len(refs) - 1))
            for poly in polygons:
                lps = _to_lps(series, geometry, k, poly)
                kind = types.get(name, "POINT" if len(lps) == 1 else "CLOSED_PLANAR")
                contours.append(_item(
                    ContourImageSequence=[image_ref(nearest)], ContourGeometricType=kind,
                    NumberOfContourPoints=len(lps), ContourData=ds_values(lps)))
        roi_contour = _item(ROIDisplayColor=[(37 * number) % 256, (91 * number) % 256, (151 * number) % 256],
                            ReferencedROINumber=number)
        if contours:
            roi_contour.ContourSequence = contours
        ds.ROIContourSequence.append(roi_contour)
        ds.RTROIObservationsSequence.append(_item(
            ObservationNumber=number, ReferencedROINumber=number, RTROIInterpretedType="ORGAN", ROIInterpreter=""))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save(ds, out_path)
    return out_path
