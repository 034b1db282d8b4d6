"""Pairing label inputs with series, placing them on their grid, and writing them.

A label for a series ingested in the same run is written in the series' own transaction (slices,
labels, records and index entries together); a label for a series stored earlier gets a transaction
of its own in the current shard. A label input is tried on each series it may belong to (a
SeriesInstanceUID can hold several volumes: orientations, matrix sizes) and lands on the first whose
grid it fits; one that fits none, or references no series, is quarantined with the reason.

A series keeps one label map. Where several label objects fit one series (two RTSTRUCTs of different
readers, a SEG beside an RTSTRUCT), the choice is deterministic and independent of file names and
order: a DICOM SEG before an RTSTRUCT (voxels as drawn, not rasterised contours) before a NIfTI/NRRD
mask, and among those of one kind the smallest content hash (:func:`~medload.ingest.labels.label_fingerprint`).
The others are reported as ``skipped`` (status ``skipped`` in the report and in ``rejects --all``),
naming the label that was kept -- they are valid, not rejected.

A label is placed by the physical position of its foreground; what lands outside the series grid is cut
off. A label with less than ``min_kept`` (``IngestConfig.label_min_kept``) of its foreground inside a
series does not fit it -- the label of another series or patient -- and is rejected with the figure
when it fits none; one kept above it but not whole is stored with the fraction (``LabelRecord.kept``).
Label inputs go by :func:`~medload.ingest.labels.label_source_name` in records, reports and messages,
never by their paths (a mask named after its SeriesInstanceUID would carry the UID).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from medload.deid import Pseudonymizer
from medload.errors import InputProblem
from medload.ingest.labels import LabelInput, label_fingerprint, label_source_name, place_label, pseudonymous
from medload.ingest.report import IngestReport, LabelOutcome
from medload.ingest.series import SeriesCandidate
from medload.ingest.worker import FATAL
from medload.labels.grid import LabelVolume, SeriesGrid
from medload.storage.codec import SliceCodec, encode_value
from medload.storage.digest import series_digest, slice_digest
from medload.storage.records import LabelRecord, RejectRecord, SeriesRecord, percent
from medload.storage.writer import SeriesTransaction, StoreWriter

__all__ = ["LabelAssigner"]

log = logging.getLogger(__name__)

#: kinds of label input by preference where several fit one series
_KIND_ORDER = {"seg": 0, "rtstruct": 1, "nifti": 2, "nrrd": 2, "mha": 2}
#: what a placed label's foreground is, and what it is counted in (see LabelVolume.coverage)
_FOREGROUND = {"mask": ("mask", "voxels"), "seg": ("SEG", "frame pixels"), "rtstruct": ("RTSTRUCT", "voxels")}


class LabelAssigner:
    """Which label goes to which series, for one ingest run. ``roots`` are the folders (and files) label
    inputs were found under, for their names (:func:`~medload.ingest.labels.label_source_name`);
    ``min_kept`` the least fraction of a label's foreground that must lie inside its series."""

    def __init__(self, inputs: Iterable[LabelInput], candidates: list[SeriesCandidate],
                 stored: dict[bytes, SeriesRecord], writer: StoreWriter, pseudo: Pseudonymizer,
                 roi_map: dict | None, codec: SliceCodec, report: IngestReport, *,
                 roots: Sequence[str | Path] = (), min_kept: float = 0.5) -> None:
        self.writer, self.pseudo, self.roi_map, self.codec, self.report = writer, pseudo, roi_map, codec, report
        self.stored, self.min_kept = stored, min_kept
        inputs = list(inputs)
        #: the name of each input in records, reports and messages
        self.names = {inp: label_source_name(inp.ref, roots, pseudo) for inp in inputs}
        volumes = [c for c in candidates if not c.skip_reason]
        #: per label input, the keys of the series it may belong to, in the order they are tried
        self.pending: dict[LabelInput, list[bytes]] = {}
        for inp in sorted(inputs, key=self._preference):
            keys = self._targets(inp, volumes)
            if keys:
                self.pending[inp] = keys
            else:
                self._reject(inp, None, "references no series of this ingest or the store "
                                        "(check its ReferencedSeriesSequence, or map it with --labels map.csv)")
        self.last_error: dict[LabelInput, str] = {}

    def _preference(self, inp: LabelInput) -> tuple:
        """Which of several label inputs for one series is kept: SEG, RTSTRUCT, masks; then content hash."""
        try:
            content = label_fingerprint(inp, self.roi_map)
        except InputProblem:
            content = ""  # unreadable: it fails when placed, and is quarantined then
        return _KIND_ORDER.get(inp.kind, len(_KIND_ORDER)), content, inp.display

    def _targets(self, inp: LabelInput, volumes: list[SeriesCandidate]) -> list[bytes]:
        everything = list(dict.fromkeys([c.key for c in volumes] + sorted(self.stored)))
        if inp.key_prefix:
            return [k for k in everything if k.hex().startswith(inp.key_prefix)]
        series_of = {c.key: c.first.series for c in volumes} | {k: r.series for k, r in self.stored.items()}
        keys = [k for k in everything if series_of[k] in inp.series]
        if keys or not inp.frame_of_reference:
            return keys
        frame_of = {c.key: c.first.frame_of_reference for c in volumes} | {
            k: r.frame_of_reference for k, r in self.stored.items()}
        same_frame = [k for k in everything if frame_of[k] == inp.frame_of_reference]
        return same_frame if len(same_frame) == 1 else []

    # ---- placing ---------------------------------------------------------------------------------
    def label_for(self, key: bytes, grid: SeriesGrid) -> tuple[LabelInput, LabelVolume] | None:
        """The first pending label input that fits series ``key`` (on ``grid``), or None."""
        for inp, keys in list(self.pending.items()):
            if key not in keys:
                continue
            try:
                volume = place_label(inp, grid, self.pseudo, self.roi_map, self.names[inp])
                if volume.kept < self.min_kept:
                    raise InputProblem("labels", self._mostly_outside(key, volume))
            except FATAL:
                raise
            except BaseException as exc:  # noqa: BLE001 -- a label that breaks a decoder is quarantined, never fatal
                reason = exc.reason if isinstance(exc, InputProblem) else f"{type(exc).__name__}: {exc}"
                self.last_error[inp] = pseudonymous(reason, self.pseudo)  # a decoder's message may quote a UID
                keys.remove(key)
                if not keys:
                    self._finish_unplaced(inp)
                continue
            del self.pending[inp]
            for other, other_keys in list(self.pending.items()):  # one label per series
                if key in other_keys:
                    other_keys.remove(key)
                    if not other_keys:
                        self._skip(other, key, inp)
            return inp, volume
        return None

    def _mostly_outside(self, key: bytes, volume: LabelVolume) -> str:
        what, unit = _FOREGROUND.get(volume.kind, ("label", "voxels"))
        inside, total = volume.coverage
        return (f"{percent(volume.kept)} of the {what}'s foreground lies inside series {key.hex()[:12]} ({inside} of "
                f"{total} {unit}; the rest lies outside it): wrong series? A label with less than "
                f"{percent(self.min_kept)} of its foreground inside its series is rejected (label_min_kept)")

    def put(self, txn: SeriesTransaction, key: bytes, inp: LabelInput, volume: LabelVolume) -> LabelRecord:
        """Put the label slices in ``txn``; return the record to commit with them."""
        dtype = volume.data.dtype
        digests = []
        for z, plane in enumerate(volume.data):
            txn.put_label_slice(z, encode_value(plane, self.codec))
            digests.append(slice_digest(plane))
        notes = tuple(pseudonymous(n, self.pseudo) for n in volume.notes)
        record = LabelRecord(
            key=key.hex(), dtype=str(dtype), classes={str(c): n for c, n in sorted(volume.classes.items())},
            foreground=tuple(tuple(int(v) for v in row) for row in volume.foreground_counts()),
            kind=volume.kind, source=self.names[inp], source_fingerprint=label_fingerprint(inp, self.roi_map),
            digest=series_digest(digests, volume.data.shape, str(dtype)), resampled=volume.resampled,
            notes=notes, kept=volume.kept,
        )
        self.report.labels.append(LabelOutcome(key.hex(), self.names[inp], "ingested", volume.kind,
                                               tuple(volume.classes.values()), "; ".join(notes) or None, volume.kept))
        return record

    def write_stored(self) -> None:
        """Labels of series stored before this run, each in a transaction of its own."""
        for key in sorted(self.stored):
            if not any(key in keys for keys in self.pending.values()):
                continue
            rec = self.stored[key]
            if key in self.writer.label_fingerprints:
                self._settle_existing(key)
                continue
            found = self.label_for(key, SeriesGrid.from_record(rec))
            if found is None:
                continue
            inp, volume = found
            txn = self.writer.begin_labels(key, int(np.prod(volume.data.shape)) * 2)
            try:
                label = self.put(txn, key, inp, volume)
            except BaseException:
                txn.abort()
                raise
            txn.commit(label=label)
        for inp in list(self.pending):
            self._finish_unplaced(inp)

    def _settle_existing(self, key: bytes) -> None:
        """Label inputs for a series that already has a stored label: the same one, or a conflict."""
        for inp, keys in list(self.pending.items()):
            if key not in keys:
                continue
            keys.remove(key)
            if label_fingerprint(inp, self.roi_map) == self.writer.label_fingerprints[key]:
                del self.pending[inp]
                self.report.labels.append(LabelOutcome(key.hex(), self.names[inp], "present", inp.kind, (), None))
            elif not keys:
                del self.pending[inp]
                self.report.labels.append(LabelOutcome(
                    key.hex(), self.names[inp], "conflict", inp.kind, (),
                    "the series already has a different label; the stored one is left unchanged"))

    # ---- quarantine ------------------------------------------------------------------------------
    def _skip(self, inp: LabelInput, key: bytes, kept: LabelInput) -> None:
        """``inp`` also fits series ``key``, which keeps ``kept``: reported, not rejected."""
        self.pending.pop(inp, None)
        reason = (f"series {key.hex()[:12]} has several label objects and keeps one, {self.names[kept]} "
                  f"({kept.kind}; chosen SEG before RTSTRUCT before masks, then by content hash)")
        self.report.labels.append(LabelOutcome(key.hex(), self.names[inp], "skipped", inp.kind, (), reason))
        self.report.rejects.append(RejectRecord("skipped", "labels", reason, self.names[inp], series=key.hex()))

    def _finish_unplaced(self, inp: LabelInput, reason: str | None = None) -> None:
        self.pending.pop(inp, None)
        self._reject(inp, None, reason or self.last_error.get(inp, "fits none of the series it references"))

    def _reject(self, inp: LabelInput, key: bytes | None, reason: str) -> None:
        self.report.labels.append(LabelOutcome(None if key is None else key.hex(), self.names[inp], "rejected",
                                               inp.kind, (), reason))
        self.report.rejects.append(RejectRecord("rejected", "labels", reason, self.names[inp],
                                                series=None if key is None else key.hex()))
