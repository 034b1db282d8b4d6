"""DICOM Segmentation (SEG) objects placed onto the voxel grid of their series.

Frames are decoded with pydicom (one at a time, ``iter_array``; 1-bit frames unpacked even when they are
not byte-aligned) and placed by our own code, since highdicom's look-ups by source image need the raw
SOPInstanceUIDs while our grid only holds their pseudonyms, and its volumes live on the SEG's own grid.
A TILED_FULL SEG (DimensionOrganizationType (0020,9311), no per-frame functional groups) has its frames'
segments and positions computed by highdicom (``iter_tiled_full_frame_data``), then placed the same way;
the tests cross-check the placement against highdicom's own volume.

Each frame is placed by its own geometry, never by its rank (frames are *not* split evenly over
segments): its segment is ReferencedSegmentNumber (0062,000B) of its SegmentIdentificationSequence,
its plane is ImagePositionPatient (0020,0032) in PlanePositionSequence, ImageOrientationPatient
(0020,0037) in PlaneOrientationSequence and PixelSpacing (0028,0030) in PixelMeasuresSequence (per-frame
or shared functional groups). A frame lying on a grid slice (within :data:`SLICE_TOLERANCE` of a slice)
with the grid's in-plane geometry is copied; a frame on a grid slice with another in-plane origin,
spacing, size or in-plane rotation is resampled by nearest neighbour (``resampled=True``). A frame with
no position is placed through DerivationImageSequence > SourceImageSequence > ReferencedSOPInstanceUID
(0008,1155), pseudonymised and looked up in ``grid.instances``. A frame beyond the series' first or
last slice, and frame pixels outside the grid's in-plane field of view, lie outside the grid: their
foreground is cut off and counted in the result's ``coverage`` (a frame between two slices is refused).

Class id = SegmentNumber (0062,0004). Where segments overlap, the higher segment number wins (the
number of such voxels is noted). FRACTIONAL frames are foreground where value >= 0.5 *
MaximumFractionalValue (0062,000E). Segment codes are exposed as ``notes`` lines
``"segment 1: Liver (type SRT T-62000 'Liver'; category SRT T-D0050 'Tissue')"`` and, structured, by
:func:`read_segments`. Messages never quote UIDs (they would undo the pseudonymisation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pydicom
from pydicom.pixels import get_decoder

from medload.labels.grid import LabelProblem, LabelVolume, SeriesGrid, cut_note

__all__ = ["seg_to_grid", "read_segments", "SegmentInfo", "SEG_SOP_CLASSES", "SLICE_TOLERANCE"]

SEG_SOP_CLASSES = {
    "1.2.840.10008.5.1.4.1.1.66.4": "Segmentation Storage",
    "1.2.840.10008.5.1.4.1.1.66.7": "Label Map Segmentation Storage",
}
SLICE_TOLERANCE = 0.1
"""How far (in voxels) a frame's corners may lie from a grid slice, and from grid voxel centres to copy."""


@dataclass(frozen=True)
class SegmentInfo:
    """One item of SegmentSequence (0062,0002); codes as ``"SCHEME VALUE 'meaning'"``."""

    number: int
    label: str
    property_type: str
    category: str

    def describe(self) -> str:
        return f"segment {self.number}: {self.label} (type {self.property_type}; category {self.category})"


def _code(item, keyword: str) -> str:
    seq = item.get(keyword)
    if not seq:
        return "?"
    c = seq[0]
    value = c.get("CodeValue") or c.get("LongCodeValue") or c.get("URNCodeValue") or "?"
    return f"{c.get('CodingSchemeDesignator', '?')} {value} '{c.get('CodeMeaning', '')}'"


def read_segments(ds: pydicom.Dataset) -> dict[int, SegmentInfo]:
    """Segments of a SEG by SegmentNumber (0062,0004), with label and property codes."""
    out = {}
    for item in ds.get("SegmentSequence", []):
        number = int(item.SegmentNumber)
        ptype = _code(item, "SegmentedPropertyTypeCodeSequence")
        label = str(item.get("SegmentLabel", "") or "").strip() or ptype.partition("'")[2].rstrip("'") \
            or f"segment_{number}"
        out[number] = SegmentInfo(number, label, ptype, _code(item, "SegmentedPropertyCategoryCodeSequence"))
    return out


def _group(frame, shared, keyword: str):
    """First item of a functional group macro, per-frame first, then shared."""
    for g in (frame, shared):
        if g is not None and g.get(keyword):
            return g.get(keyword)[0]
    return None


def _refs(frame, shared) -> list[str]:
    uids = []
    for g in (frame, shared):
        for deriv in (g.get("DerivationImageSequence", []) if g is not None else []):
            uids += [str(s.ReferencedSOPInstanceUID) for s in deriv.get("SourceImageSequence", [])
                     if "ReferencedSOPInstanceUID" in s]
    return uids


@dataclass
class _Frame:
    number: int                 # 1-based, as in DICOM
    segment: int | None
    ipp: np.ndarray | None
    axes: np.ndarray | None     # (3, 2): column step, row step in LPS mm
    rows: int
    cols: int
    refs: list[str]


def _tiled_full_frames(ds, n: int) -> list[_Frame]:
    """Frames of a TILED_FULL SEG, which has no per-frame functional groups: highdicom derives each
    frame's segment and position from the total pixel matrix (frames ordered by segment, focal plane,
    tile row, tile column; PS3.3 C.7.6.17.3), in the orientation of ImageOrientationSlide (0048,0102)."""
    from highdicom.spatial import iter_tiled_full_frame_data

    try:
        placed = list(iter_tiled_full_frame_data(ds))
        iop = np.asarray(ds.ImageOrientationSlide, float)
        spacing = ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].PixelSpacing
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as err:
        raise LabelProblem(f"TILED_FULL SEG lacks what places its frames (TotalPixelMatrixOriginSequence, "
                           f"ImageOrientationSlide, shared PixelMeasuresSequence): {err}") from None
    if len(placed) != n:
        raise LabelProblem(f"TILED_FULL SEG has {n} frames, its total pixel matrix and segments need {len(placed)}")
    axes = np.stack([iop[:3] * float(spacing[1]), iop[3:] * float(spacing[0])], axis=1)
    return [_Frame(k + 1, segment, np.array([x, y, z]), axes, int(ds.Rows), int(ds.Columns), [])
            for k, (segment, _plane, _column, _row, x, y, z) in enumerate(placed)]


def _frames(ds) -> list[_Frame]:
    n = int(ds.get("NumberOfFrames", 1) or 1)
    per_frame = ds.get("PerFrameFunctionalGroupsSequence")
    if per_frame is None and str(ds.get("DimensionOrganizationType", "")).upper() == "TILED_FULL":
        return _tiled_full_frames(ds, n)
    if per_frame is None or len(per_frame) != n:
        raise LabelProblem(f"SEG has {n} frames but {0 if per_frame is None else len(per_frame)} "
                           "PerFrameFunctionalGroupsSequence items")
    shared = (ds.get("SharedFunctionalGroupsSequence") or [None])[0]
    frames = []
    for k, fg in enumerate(per_frame):
        pos, ori, meas = (_group(fg, shared, kw) for kw in
                          ("PlanePositionSequence", "PlaneOrientationSequence", "PixelMeasuresSequence"))
        ident = _group(fg, shared, "SegmentIdentificationSequence")
        ipp = np.asarray(pos.ImagePositionPatient, float) if pos is not None and "ImagePositionPatient" in pos \
            else None
        axes = None
        iop = ori.get("ImageOrientationPatient") if ori is not None else ds.get("ImageOrientationPatient")
        spacing = meas.get("PixelSpacing") if meas is not None else ds.get("PixelSpacing")
        if iop is not None and spacing is not None:
            iop = np.asarray(iop, float)
            axes = np.stack([iop[:3] * float(spacing[1]), iop[3:] * float(spacing[0])], axis=1)
        frames.append(_Frame(k + 1, int(ident.ReferencedSegmentNumber) if ident is not None else None, ipp, axes,
                             int(ds.Rows), int(ds.Columns), _refs(fg, shared)))
    return frames


class _Placer:
    """Finds the grid slice of a frame and the nearest-neighbour map of its pixels onto that slice."""

    def __init__(self, grid: SeriesGrid) -> None:
        self.grid = grid
        self.inv = np.linalg.inv(grid.affine_lps)

    def place(self, f: _Frame) -> tuple[int | None, tuple | None]:
        """``(slice, None)`` to copy the frame, ``(slice, (rows, cols, valid))`` to resample it, ``(None,
        None)`` when it lies beyond the series' first or last slice (outside the grid: nothing of it is
        placed). Raises ValueError with the reason when the frame lies on no slice otherwise."""
        d, h, w = self.grid.shape
        if f.axes is None:
            raise ValueError("it has a position but no PlaneOrientationSequence/PixelMeasuresSequence")
        corners = np.array([[0, 0], [f.cols - 1, 0], [0, f.rows - 1], [f.cols - 1, f.rows - 1]], float)
        idx = self.grid.to_index(f.ipp + corners @ f.axes.T)
        z = idx[:, 2]
        k = int(np.rint(z.mean()))
        if z.max() - z.min() > 2 * SLICE_TOLERANCE:
            raise ValueError(f"it is not parallel to the series slices (its corners span slices "
                             f"{z.min():.2f} to {z.max():.2f}); oblique SEG planes are not resampled")
        if not -0.5 <= z.mean() < d - 0.5:
            return None, None
        if np.abs(z - k).max() > SLICE_TOLERANCE:
            raise ValueError(f"it lands at slice index {z.mean():.2f}, not on one of the {d} slices")
        target = np.array([[0, 0], [w - 1, 0], [0, h - 1], [w - 1, h - 1]], float)
        if (f.rows, f.cols) == (h, w) and np.abs(idx[:, :2] - target).max() <= SLICE_TOLERANCE:
            return k, None
        # grid voxel (j, i, k) -> LPS -> frame (column a, row b) by least squares on the frame's axes
        m = np.linalg.pinv(f.axes)                                   # (2, 3)
        a = self.grid.affine_lps
        base = m @ (a[:3, 2] * k + a[:3, 3] - f.ipp)
        dj, di = m @ a[:3, 0], m @ a[:3, 1]
        jj, ii = np.meshgrid(np.arange(w), np.arange(h))
        fa = np.floor(base[0] + jj * dj[0] + ii * di[0] + 0.5).astype(np.int64)
        fb = np.floor(base[1] + jj * dj[1] + ii * di[1] + 0.5).astype(np.int64)
        valid = (fa >= 0) & (fa < f.cols) & (fb >= 0) & (fb < f.rows)
        return k, (fb[valid], fa[valid], valid)

    def outside(self, f: _Frame, values: np.ndarray) -> int:
        """Foreground pixels of a frame whose centres fall outside the grid's field of view."""
        if f.ipp is None or f.axes is None:  # place() resamples only frames with both
            raise LabelProblem(f"SEG frame {f.number} has no ImagePositionPatient or no plane orientation and "
                               "spacing: it cannot be placed on the series grid")
        b, a = np.nonzero(values)
        if not len(a):
            return 0
        idx = self.grid.to_index(f.ipp + np.c_[a, b] @ f.axes.T)
        h, w = self.grid.shape[1:]
        inside = (idx[:, 0] >= -0.5) & (idx[:, 0] < w - 0.5) & (idx[:, 1] >= -0.5) & (idx[:, 1] < h - 0.5)
        return int((~inside).sum())


def _pixels(ds, n: int):
    """The frames of ``ds`` one at a time, decoding problems as LabelProblem."""
    try:
        tsuid = ds.file_meta.TransferSyntaxUID
        count = 0
        for frame, _meta in get_decoder(tsuid).iter_array(ds):
            count += 1
            yield frame
    except Exception as err:  # any decoder failure is a problem of this input, not a bug
        raise LabelProblem(f"cannot decode the SEG's pixel data: {err}") from err
    if count != n:
        raise LabelProblem(f"SEG pixel data holds {count} frames, NumberOfFrames says {n}")


def _frame_values(f: _Frame, frame: np.ndarray, seg_type: str, segments: dict[int, SegmentInfo], top: int,
                  dtype: np.dtype) -> np.ndarray:
    """A frame's pixels as class ids: a LABELMAP's values as they are; a BINARY or FRACTIONAL frame's
    foreground (FRACTIONAL: at least half of MaximumFractionalValue ``top``) as its segment number."""
    if seg_type == "LABELMAP":
        return frame.astype(dtype)
    segment = f.segment if f.segment is not None else (next(iter(segments)) if len(segments) == 1 else None)
    if segment is None:
        raise LabelProblem(f"frame {f.number} has no SegmentIdentificationSequence and the SEG has "
                           f"{len(segments)} segments")
    fg = frame >= 0.5 * top if seg_type == "FRACTIONAL" else frame != 0
    return fg.astype(dtype) * dtype.type(segment)


@dataclass
class _Tally:
    """What placing a SEG's frames met, for its notes and its coverage (foreground pixels in all, and lost
    outside the grid)."""

    total: int = 0
    lost: int = 0
    resampled: int = 0
    by_uid: int = 0
    disagree: int = 0
    beyond: int = 0
    unplaced_empty: int = 0

    def notes(self) -> list[str]:
        """The label's notes; a LabelProblem if every foreground pixel lies outside the grid."""
        if self.lost == self.total > 0:
            raise LabelProblem(f"all {self.total} foreground pixels of the SEG's frames lie outside the series grid "
                               "once placed by their position: is it the SEG of another series?")
        notes = []
        if self.resampled:
            notes.append(f"{self.resampled} frames resampled in-plane (nearest neighbour): their origin, spacing, "
                         "size or in-plane orientation differ from the series")
        if self.beyond:
            notes.append(f"{self.beyond} frames with foreground lie beyond the series' first or last slice")
        if self.lost:
            notes.append(cut_note("SEG", "frame pixels", self.total - self.lost, self.total))
        if self.by_uid:
            notes.append(f"{self.by_uid} frames without a position placed by their referenced source image")
        if self.disagree:
            notes.append(f"{self.disagree} frames placed by position lie on another slice than the source image "
                         "they reference; their position was trusted")
        if self.unplaced_empty:
            notes.append(f"{self.unplaced_empty} empty frames lie on no slice of the series and were ignored")
        return notes


def seg_to_grid(ds: pydicom.Dataset, grid: SeriesGrid, *, uid_pseudonym: Callable[[str], str] | None = None,
                source: str = "") -> LabelVolume:
    """Place a DICOM SEG on ``grid`` as one multi-class label map (class id = SegmentNumber).

    Args:
        ds: the SEG dataset (SOPClassUID (0008,0016) Segmentation Storage), with pixel data.
        grid: the series it annotates.
        uid_pseudonym: maps a raw ReferencedSOPInstanceUID to the pseudonym ``grid.instances`` holds;
            ``None`` compares raw UIDs (for grids built from raw UIDs). Only used for frames without
            ImagePositionPatient, and to cross-check frames with both.
        source: what to record as the label's source.

    Raises:
        LabelProblem: not a SEG, unsupported SegmentationType, or a non-empty frame that cannot be placed.
    """
    sop_class = str(ds.get("SOPClassUID", ""))
    if sop_class not in SEG_SOP_CLASSES:
        raise LabelProblem(f"not a DICOM SEG (SOPClassUID {sop_class or 'missing'}): pass a Segmentation Storage "
                           "object, or use mask_to_grid/rtstruct_to_grid for other label sources")
    seg_type = str(ds.get("SegmentationType", "")).upper()
    top = int(ds.get("MaximumFractionalValue", 255) or 255)
    segments = {n: s for n, s in read_segments(ds).items() if n != 0}  # LABELMAP SEGs may list 0: background
    notes = [s.describe() for s in segments.values()]
    if seg_type == "FRACTIONAL":
        notes.append(f"FRACTIONAL ({ds.get('SegmentationFractionalType', '?')}) frames thresholded at "
                     f">= 0.5 x MaximumFractionalValue {top}")
    elif seg_type not in ("BINARY", "LABELMAP"):
        raise LabelProblem(f"SegmentationType {seg_type or 'missing'} is not supported (BINARY, FRACTIONAL, LABELMAP)")
    frames = _frames(ds)
    lookup = {uid: k for k, uid in enumerate(grid.instances)}
    pseudo = uid_pseudonym or (lambda uid: uid)
    placer = _Placer(grid)
    d, h, w = grid.shape
    highest = max([*segments, 1])
    data = np.zeros(grid.shape, dtype=np.uint16 if highest > 255 else np.uint8)
    overlap = None
    t = _Tally()
    for f, frame in zip(frames, _pixels(ds, len(frames))):
        values = _frame_values(f, frame, seg_type, segments, top, data.dtype)
        ref_slices = [lookup[p] for p in map(pseudo, f.refs) if p in lookup]
        foreground = int(np.count_nonzero(values))
        t.total += foreground
        try:
            if f.ipp is not None:
                slice_, sample = placer.place(f)
                if slice_ is None:  # beyond the series' slices: its foreground is outside the grid
                    t.lost += foreground
                    t.beyond += foreground > 0
                    t.unplaced_empty += foreground == 0
                    continue
                k = slice_
                t.disagree += bool(ref_slices) and k not in ref_slices
            elif ref_slices:
                k, sample = ref_slices[0], None
                t.by_uid += 1
                if (f.rows, f.cols) != (h, w):
                    raise ValueError(f"it has no position and is {f.rows}x{f.cols} while the slices are {h}x{w}")
            else:
                hint = "" if uid_pseudonym else " (pass uid_pseudonym if grid.instances holds pseudonyms)"
                raise ValueError("it has no ImagePositionPatient and none of its source images "
                                 f"(DerivationImageSequence) is a slice of this series{hint}")
        except ValueError as why:
            if values.any():
                where = "no position" if f.ipp is None else f"position {np.round(f.ipp, 2).tolist()} (LPS mm)"
                raise LabelProblem(f"SEG frame {f.number} (segment {f.segment}, {where}) cannot be placed on the "
                                   f"series grid: {why}") from None
            t.unplaced_empty += 1
            continue
        if sample is not None:
            t.resampled += 1
            t.lost += placer.outside(f, values)
            on_grid = np.zeros((h, w), dtype=data.dtype)
            on_grid[sample[2]] = values[sample[0], sample[1]]
            values = on_grid
        fg = values != 0
        current = data[k]
        clash = fg & (current != 0) & (current != values)
        if clash.any():
            overlap = np.zeros(grid.shape, dtype=bool) if overlap is None else overlap
            overlap[k] |= clash
        data[k] = np.where(fg, np.maximum(current, values), current)
    if seg_type == "LABELMAP":
        extra = sorted(set(np.unique(data).tolist()) - set(segments) - {0})
        segments.update({v: SegmentInfo(v, f"segment_{v}", "?", "?") for v in extra})
    if overlap is not None:
        notes.append(f"{int(overlap.sum())} voxels claimed by more than one segment: the higher segment number kept")
    notes += t.notes()
    present = set(np.unique(data).tolist())
    notes += [f"segment {n} ({s.label}) has no voxels on this grid" for n, s in segments.items() if n not in present]
    return LabelVolume(data=data, classes={n: s.label for n, s in sorted(segments.items())}, kind="seg",
                       source=source, resampled=t.resampled > 0, notes=notes, coverage=(t.total - t.lost, t.total))
