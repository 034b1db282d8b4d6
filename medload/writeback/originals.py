"""Find the original DICOM series of a stored volume in a PACS, without the store ever holding its UIDs.

The store keeps only keyed pseudonyms (:mod:`medload.deid`). To reference the originals:

1. Search the PACS for series (QIDO-RS or C-FIND; the user's matching keys, and Modality (0008,0060) of
   the stored series) and keep the one whose SeriesInstanceUID (0020,000E) has the stored ``series``
   pseudonym under the store's key (:meth:`~medload.deid.Pseudonymizer.uid`); its
   StudyInstanceUID (0020,000D) must have the stored ``study`` pseudonym too.
2. Retrieve its instances into a private temporary folder and read their headers exactly as ingest does
   (:func:`~medload.ingest.headers.read_headers`, :func:`~medload.ingest.series.group_series`,
   :func:`~medload.ingest.geometry.plan_geometry`): the candidate volume whose key is the stored key
   (splits of one series have keys of their own) gives, for every stored slice z, the instance there.
3. Refuse (:class:`WritebackError`, with the reason) unless that volume is the stored one: the same
   source instances (the record's ``source_fingerprint``), shape, orientation, slice positions and affine
   (within :data:`~medload.labels.masks.GRID_TOLERANCE_MM`).

The headers (without Pixel Data) of the instances, in z order, are what a DICOM SEG needs to reference
them: SOPInstanceUIDs, geometry, and the patient and study modules it copies. The retrieved files are
deleted before this returns; only counts and pseudonyms reach messages.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pydicom
from pydicom import Dataset

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import InputProblem, MedloadError
from medload.ingest.discover import SourceRef
from medload.ingest.geometry import plan_geometry
from medload.ingest.headers import SliceHeader, read_headers
from medload.ingest.series import group_series
from medload.labels.masks import GRID_TOLERANCE_MM
from medload.pacs.dicomweb import SeriesRef
from medload.pacs.ingest import Spool
from medload.storage.records import SeriesRecord
from medload.writeback.pacs import PacsConnection

__all__ = ["WritebackError", "SourceSeries", "find_source_series"]

log = logging.getLogger(__name__)


class WritebackError(MedloadError):
    """A result cannot be written back as asked: the originals of the stored series are not in the PACS, or
    they no longer form the stored voxel grid."""


@dataclass(frozen=True)
class SourceSeries:
    """The original instances of a stored volume: ``headers[z]`` is the header (no Pixel Data) of the
    instance at stored slice z. It holds raw identifiers, so it never reaches a message (not even ``repr``)."""

    ref: SeriesRef = field(repr=False)
    headers: tuple[Dataset, ...] = field(repr=False)


def find_source_series(pacs: PacsConnection, record: SeriesRecord, pseudo: Pseudonymizer, *,
                       query: dict[str, str] | None = None, config: IngestConfig | None = None) -> SourceSeries:
    """The originals of ``record`` in ``pacs``; see the module docstring. ``query`` narrows the series search
    (QIDO-RS/C-FIND matching keys, e.g. ``{"StudyDate": "20150101-20151231"}``: on a large PACS give the
    query the store was ingested with); ``config`` is the ingest's (its time-series, duplicate and tilt
    settings decide how the series splits into volumes)."""
    cfg = config or IngestConfig()
    ref = _find_series(pacs, record, pseudo, {"Modality": record.modality, **(query or {})})
    try:
        instances = pacs.search_instances(ref)
    except InputProblem as exc:
        raise WritebackError(f"{pacs.base}: series {record.key[:12]} was found but its instances cannot be listed: "
                             f"{exc.reason}") from None
    with tempfile.TemporaryDirectory(prefix="medload-writeback-") as tmp, \
            Spool(Path(tmp) / "spool", pseudo, len(instances)) as spool:
        failed = pacs.retrieve([(ref, instances)], spool, lambda n: None).get(ref.series, [])
        if failed:
            raise WritebackError(f"{pacs.base}: {len(failed)} of {len(instances)} instance(s) of series "
                                 f"{record.key[:12]} could not be retrieved (e.g. {failed[0][1]}): retry later")
        headers = _volume_headers(spool.path, record, pseudo, cfg)
        return SourceSeries(ref, tuple(_dataset(h, pseudo) for h in headers))


def _find_series(pacs: PacsConnection, record: SeriesRecord, pseudo: Pseudonymizer, query: dict[str, str]) -> SeriesRef:
    found = pacs.search_series(query)
    matches = [ref for ref in found if pseudo.uid("series", ref.series) == record.series]
    log.info("%s: %d series searched, %d with the pseudonym of series %s", pacs.base, len(found), len(matches),
             record.key[:12])
    if not matches:
        raise WritebackError(
            f"{pacs.base} has no series whose SeriesInstanceUID has the pseudonym of stored series {record.key[:12]} "
            f"({len(found)} series searched, query {_query_text(query)}): check that the store was ingested from "
            "this PACS with this key, that the series is still there, and that --query does not exclude it")
    ref = matches[0]
    if pseudo.uid("study", ref.study) != record.study:
        raise WritebackError(f"{pacs.base}: the series of stored series {record.key[:12]} now belongs to another study "
                             "than the one it was ingested from: ingest it again before writing results back")
    return ref


def _query_text(query: dict[str, str]) -> str:
    return "&".join(f"{k}={v}" for k, v in query.items())


def _volume_headers(folder: Path, record: SeriesRecord, pseudo: Pseudonymizer, cfg: IngestConfig) -> list[SliceHeader]:
    """The header of the plane at each stored slice (the first of duplicates, as ingest keeps), after
    checking that the series still yields the stored volume."""
    planes: list[SliceHeader] = []
    for path in sorted(folder.iterdir()):
        try:
            found = read_headers(SourceRef(str(path), None, path.stat().st_size), pseudo, cfg)
        except InputProblem:
            continue  # ingest quarantined it too; the fingerprint check below tells if it mattered
        if isinstance(found, list):
            planes += found
    short = record.key[:12]
    volume = next((c for c in group_series(planes, time_series=cfg.time_series,
                                           duplicate_tolerance=cfg.duplicate_tolerance_mm)
                   if c.key == record.key_bytes), None)
    if volume is None:
        raise WritebackError(f"the PACS's copy of series {short} no longer yields the stored volume (its "
                             f"{len(planes)} image plane(s) split into other volumes): ingest it again before writing "
                             "results back")
    if volume.fingerprint != record.source_fingerprint:
        raise WritebackError(f"the PACS holds other instances in series {short} than were ingested ({len(volume.headers)} "
                             f"plane(s) now, {record.shape[0]} slice(s) stored): ingest it again (medload ingest "
                             "--force) before writing results back")
    try:
        geometry = plan_geometry(volume.headers, cfg)
    except InputProblem as exc:
        raise WritebackError(f"the PACS's copy of series {short} does not form a volume: {exc.reason}") from None
    _check_grid(geometry.slots, geometry.affine_ras, geometry.positions, record)
    multiframe = [s[0] for s in geometry.slots if s[0].frame is not None]
    if multiframe:
        raise WritebackError(f"series {short} is a multi-frame (Enhanced) object: writing SEGs for multi-frame "
                             "source images is not supported yet")
    return [slot[0] for slot in geometry.slots]


def _check_grid(slots: list, affine_ras: np.ndarray, positions: np.ndarray, record: SeriesRecord) -> None:
    """WritebackError unless the volume the PACS's headers form is the stored grid."""
    first = slots[0][0]
    shape = (len(slots), first.rows, first.cols)
    problems = []
    if shape != tuple(record.shape):
        problems.append(f"shape {shape}, stored {tuple(record.shape)}")
    if not np.allclose(first.orientation, record.orientation, rtol=0, atol=1e-6):
        problems.append("another ImageOrientationPatient")
    if shape == tuple(record.shape):
        shift = float(np.abs(positions - np.asarray(record.positions)).max())
        if shift > GRID_TOLERANCE_MM:
            problems.append(f"slice positions up to {shift:.3f} mm from the stored ones")
        if not np.allclose(affine_ras, np.asarray(record.affine), rtol=0, atol=GRID_TOLERANCE_MM):
            problems.append("another affine (pixel spacing or slice step)")
    if problems:
        raise WritebackError(f"the PACS's series {record.key[:12]} does not match the stored grid ({'; '.join(problems)}):"
                             " a SEG made on the stored grid would land on other voxels there; ingest it again "
                             "(medload ingest --force) and predict on the new copy")


def _dataset(h: SliceHeader, pseudo: Pseudonymizer) -> Dataset:
    """The header of the instance behind ``h``, read before its file is deleted."""
    ds = pydicom.dcmread(h.ref.path, stop_before_pixels=True)
    if pseudo.uid("instance", str(ds.SOPInstanceUID)) != h.instance:
        raise WritebackError("a retrieved file changed while it was read: retry")
    return ds
