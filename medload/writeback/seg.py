"""A label map on a stored series as a DICOM SEG (highdicom) referencing the original instances in the PACS.

The mask is on the stored grid (``mask[z, i, j]`` is voxel ``store.read(key)[z, i, j]``); its class ids
become segments: id k is SegmentNumber (0062,0004) k, so ids must run 1..N (PS3.3 C.8.20.2: segment
numbers start at 1 and increase by 1), and ingesting the SEG back gives the same class ids. Frame z of
the SEG is placed by the Plane Position (Patient) of the original instance at stored slice z, found in the
PACS by :mod:`medload.writeback.originals`, and references it (Source Image Sequence, Referenced Series
Sequence); the SEG joins that instance's study, patient and frame of reference. Frames without
foreground are left out (highdicom's ``omit_empty_frames``). SegmentationType is BINARY, the algorithm
type AUTOMATIC (a model's prediction), with the algorithm's name and version (Segment Description,
PS3.3 C.8.20.2). Given the lineage record of the data the model learned from (:mod:`medload.lineage`),
its digest goes into the algorithm's parameters, Algorithm Parameters (0066,0032) = ``lineage_sha256=<hex>``
in each segment's Segmentation Algorithm Identification Sequence (0062,0007), so the SEG in the PACS
names that data; ``medload lineage check`` then tells whether a store still holds it.

highdicom warns about odd values of the source headers by quoting them (a patient's name, for one), and
its INFO log names the source instances by SOPInstanceUID: its warnings are counted in the log, never
shown, and its logger is kept to CRITICAL.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import highdicom as hd
import numpy as np
from pydicom.sr.codedict import codes
from pydicom.sr.coding import Code

from medload.config import IngestConfig
from medload.deid import KeyFile, Pseudonymizer
from medload.errors import ConfigError
from medload.labels.grid import LabelProblem, SeriesGrid
from medload.labels.masks import mask_to_grid
from medload.lineage.record import LineageRecord, load
from medload.pacs.dicomweb import parse_query
from medload.storage.records import SeriesRecord
from medload.storage.store import Store, open_store
from medload.storage.store_key import load_store_key
from medload.version import __version__
from medload.writeback.originals import find_source_series
from medload.writeback.pacs import PacsConnection, connect

__all__ = ["Segment", "PushResult", "to_seg", "push_seg", "LINEAGE_PARAMETER"]

#: the name of the lineage record's digest among the Algorithm Parameters (0066,0032) of a SEG's segments
LINEAGE_PARAMETER = "lineage_sha256"

log = logging.getLogger(__name__)
logging.getLogger("highdicom").setLevel(logging.CRITICAL)


@dataclass(frozen=True)
class Segment:
    """What one class id is: SegmentLabel (0062,0005) and its coded Segmented Property Category and Type
    (0062,0003 / 0062,000F; default SCT 85756007 "Tissue" for both).

    Example:
        >>> Segment("bone", property_type=codes.SCT.Bone).label
        'bone'
    """

    label: str
    category: Code = codes.SCT.Tissue
    property_type: Code = codes.SCT.Tissue


@dataclass(frozen=True)
class PushResult:
    """A SEG sent to a PACS, named only by pseudonyms: the stored series ``key``, the ``study`` it joined
    (the stored study's pseudonym) and the SEG's own ``series`` and ``instance`` pseudonyms; its
    ``segments`` and ``frames``."""

    key: str
    study: str
    series: str
    instance: str
    segments: tuple[str, ...]
    frames: int


def to_seg(store: Store | str | Path, key: str, mask, labels: Mapping[int, str | Segment] | None = None, *,
           pacs: PacsConnection | str, query: str = "", key_file: str | Path | KeyFile | None = None,
           config: IngestConfig | None = None, algorithm: tuple[str, str] = ("medload", __version__),
           series_description: str = "medload segmentation", series_number: int = 9901,
           lineage: LineageRecord | str | Path | None = None) -> hd.seg.Segmentation:
    """A DICOM SEG of ``mask`` on stored series ``key`` that references the original series in ``pacs``.

    Args:
        store: the store (or its path); ``key`` a series key or a unique prefix.
        mask: ``(D, H, W)`` class ids (0 background) in the order of ``store.read(key)``, or a NIfTI/NRRD
            file on the stored grid (as ``medload export`` writes the series).
        labels: class id -> segment label or :class:`Segment` (default ``class_<id>``), ids 1..N.
        pacs: an open :func:`~medload.writeback.pacs.connect` connection, or its URL (credentials then from
            the MEDLOAD_DICOMWEB_* variables).
        query: QIDO-RS / C-FIND matching keys narrowing the series search (``"StudyDate=2015"``).
        key_file: the store's pseudonymisation key (default as for ingest); config: the ingest's settings.
        algorithm: (name, version) of the algorithm that made the mask.
        lineage: the lineage record (or its file) of the data the model was trained on: its digest goes
            into the algorithm's parameters (:data:`LINEAGE_PARAMETER`).

    Raises:
        WritebackError: the originals are not in the PACS, or no longer form the stored grid.
        ConfigError: the mask is not on the stored grid, or its ids do not fit ``labels``.

    Example:
        >>> seg = to_seg(store, rec.key, store.read(rec.key) > 300, {1: "bone"},
        ...              pacs="dicomweb://pacs:8042/dicom-web")                         # doctest: +SKIP
        >>> seg.save_as("bone.seg.dcm")   # it holds the patient's identifiers: keep it where they may be  # doctest: +SKIP
    """
    parameters = None if lineage is None else {
        LINEAGE_PARAMETER: (lineage if isinstance(lineage, LineageRecord) else load(lineage)).digest}
    with _opened(store) as st:
        record = st.record(key)
        pseudo = _store_pseudonymizer(st, key_file)
        data = _mask_on_grid(mask, record)
        segments = _segments(data, labels)
        if isinstance(pacs, str):
            with connect(pacs) as conn:
                source = find_source_series(conn, record, pseudo, query=parse_query(query), config=config)
        else:
            source = find_source_series(pacs, record, pseudo, query=parse_query(query), config=config)
    family = codes.DCM.ArtificialIntelligence
    descriptions = [hd.seg.SegmentDescription(
        number, s.label, s.category, s.property_type, hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
        hd.AlgorithmIdentificationSequence(algorithm[0], family, algorithm[1], parameters=parameters)) for number, s in segments.items()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seg = hd.seg.Segmentation(
            source_images=list(source.headers), pixel_array=data, segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
            segment_descriptions=descriptions, series_instance_uid=hd.UID(), series_number=series_number,
            sop_instance_uid=hd.UID(), instance_number=1, manufacturer="medload", manufacturer_model_name="medload",
            software_versions=__version__, device_serial_number="0", series_description=series_description)
    if caught:
        log.info("highdicom raised %d warning(s) about the source headers (not shown: they quote header values)",
                 len(caught))
    log.info("SEG of series %s: %d segment(s), %d frame(s) on %d source instance(s)", record.key[:12],
             len(segments), int(seg.NumberOfFrames), len(source.headers))
    return seg


def push_seg(store: Store | str | Path, key: str, mask, labels: Mapping[int, str | Segment] | None = None, *,
             to: str, credentials: str | Path | None = None, ca_bundle: str | Path | None = None,
             calling_aet: str = "MEDLOAD", timeout: float = 60.0, **options) -> PushResult:
    """:func:`to_seg`, then store the SEG in the same PACS (``to``: ``dicomweb://`` by STOW-RS, ``dimse://``
    by C-STORE); ``options`` are :func:`to_seg`'s keyword arguments.

    Example:
        >>> push_seg("stores/ct", "3f2a9c", "bone.nii.gz", {1: "bone"}, to="dicomweb://pacs:8042/dicom-web",
        ...          credentials="~/.config/medload/pacs.cred").frames                  # doctest: +SKIP
        12
    """
    with _opened(store) as st, connect(to, credentials=credentials, ca_bundle=ca_bundle, calling_aet=calling_aet,
                                       timeout=timeout) as pacs:
        record, pseudo = st.record(key), _store_pseudonymizer(st, options.get("key_file"))
        seg = to_seg(st, record.key, mask, labels, pacs=pacs, **options)
        pacs.send([seg])
    result = PushResult(record.key, pseudo.uid("study", str(seg.StudyInstanceUID)),
                        pseudo.uid("series", str(seg.SeriesInstanceUID)), pseudo.uid("instance", str(seg.SOPInstanceUID)),
                        tuple(str(s.SegmentLabel) for s in seg.SegmentSequence), int(seg.NumberOfFrames))
    log.info("sent the SEG of series %s to %s (SEG series %s)", record.key[:12], pacs.base, result.series[:12])
    return result


@contextmanager
def _opened(store: Store | str | Path) -> Iterator[Store]:
    """``store`` itself, or the store at a path, opened (and closed again) for the call."""
    if isinstance(store, Store):
        yield store
        return
    st = open_store(store, cache=0)
    try:
        yield st
    finally:
        st.close()


def _store_pseudonymizer(store: Store, key_file: str | Path | KeyFile | None) -> Pseudonymizer:
    """The pseudonymiser of the store's key; ConfigError for another key (its pseudonyms would match nothing)."""
    return Pseudonymizer(load_store_key(key_file, store.path))


def _mask_on_grid(mask, record: SeriesRecord) -> np.ndarray:
    """``mask`` as ``(D, H, W)`` non-negative integer class ids exactly on the stored grid."""
    if isinstance(mask, (str, Path)):
        try:
            volume = mask_to_grid(mask, SeriesGrid.from_record(record))
        except LabelProblem as exc:
            raise ConfigError(exc.reason) from None
        if volume.resampled:
            raise ConfigError(f"mask {Path(mask).name} is not on the grid of series {record.key[:12]} "
                              f"({volume.notes[0]}): write it with the series' affine (as `medload export` does), "
                              "so that the SEG lands on exactly its voxels")
        return volume.data
    data = np.asarray(mask)
    if data.shape != tuple(record.shape):
        raise ConfigError(f"mask shape {data.shape} is not the shape {tuple(record.shape)} of series {record.key[:12]} "
                          "(slice, row, column: the order of store.read)")
    if data.dtype.kind not in "biu":
        raise ConfigError(f"mask of {data.dtype}: give class ids as integers (threshold probabilities first)")
    if data.size and data.min() < 0:
        raise ConfigError("mask holds negative values: class ids are 0 (background) and 1..N")
    return data.astype(np.uint8 if data.max(initial=0) <= 255 else np.uint16)


def _segments(data: np.ndarray, labels: Mapping[int, str | Segment] | None) -> dict[int, Segment]:
    """Segment per class id 1..N; ConfigError where the ids present or named do not run 1..N."""
    present = sorted(int(v) for v in np.unique(data) if v)
    if labels is None:
        labels = {i: f"class_{i}" for i in range(1, (present[-1] if present else 1) + 1)}
    named = {int(k): v if isinstance(v, Segment) else Segment(str(v)) for k, v in labels.items()}
    if sorted(named) != list(range(1, len(named) + 1)):
        raise ConfigError(f"segment ids {sorted(named)}: name ids 1..N, one per class (DICOM SEG numbers its "
                          "segments from 1 without gaps)")
    unnamed = [v for v in present if v not in named]
    if unnamed:
        raise ConfigError(f"the mask holds class id(s) {unnamed} that labels do not name (named: {sorted(named)})")
    return dict(sorted(named.items()))
