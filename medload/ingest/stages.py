"""The stages of ingest that run wherever the decoding processes are: the header pass, and decoding
and writing series.

Both take an :class:`~medload.ingest.isolation.IsolatedPool`, so every input is read and decoded in a
supervised process; both run in the ``medload ingest`` process (:mod:`medload.ingest.run`) and, for an
ingest on Dask, inside each task (:mod:`medload.ingest.dask_engine`). Decoding is submitted in series
order and consumed in that order through a bounded window, so memory stays bounded and every series is
written in one transaction as soon as its last chunk arrives.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace

from medload.config import IngestConfig
from medload.errors import MedloadError
from medload.ingest import plausibility
from medload.ingest.diffusion import diffusion_record
from medload.ingest.discover import DiscoveryProblem, SourceRef, problem_sha256
from medload.ingest.geometry import Geometry
from medload.ingest.headers import SliceHeader
from medload.ingest.isolation import IsolatedPool, Job, Lost
from medload.ingest.label_writer import LabelAssigner
from medload.ingest.labels import LabelInput
from medload.ingest.report import IngestReport, SeriesOutcome
from medload.ingest.ring import RingSupply, SliceRing, Span
from medload.ingest.series import SeriesCandidate
from medload.ingest.shared_values import SharedValues
from medload.ingest.worker import (
    Archive,
    DecodeChunk,
    EncodedSlice,
    Failure,
    decode_chunk,
    header_batch,
    sniffing_header_batch,
    source_sha256,
)
from medload.labels.grid import SeriesGrid
from medload.progress import progress_bar
from medload.storage.digest import series_digest
from medload.storage.records import RejectRecord, SeriesRecord
from medload.storage.space import disk_full_is_error
from medload.storage.task_shard import TaskShardWriter
from medload.storage.writer import SeriesTransaction, StoreWriter

__all__ = ["SeriesPlan", "header_pass", "decode_and_write"]

log = logging.getLogger(__name__)

# files per header-pass batch: at least 8 batches per worker (the last ones even out the workers' ends), from
# 32 to 128 files: each batch costs the ingest process a message each way and a poll (at 32, about a quarter
# of its CPU in the header pass: docs/benchmarks.md), and a file that brings its worker down costs re-reading
# the rest of its batch
_HEADER_BATCH = (32, 128)
_CHUNK_BYTES = 8 << 20
_CHUNKS_QUEUED = 8  # decode chunks one worker may hold (IsolatedPool.queued)
_MAX_RING_SLOT = 64 << 20  # a chunk larger than this (one huge plane) goes through the pipe instead


def header_pass(pool: IsolatedPool, refs: list[SourceRef], report: IngestReport, progress: bool,
                label_inputs: list[LabelInput], archives: list[tuple[SourceRef, str]] | None = None) -> list[SliceHeader]:
    """Image planes of every input; SEG/RTSTRUCT objects are added to ``label_inputs``. An input that
    brings its worker down is quarantined and the rest of its batch read again.

    ``archives``: the inputs were discovered without sniffing them (``discover(sniff=False)``): each plain
    file is sniffed first; one that is not DICOM is quarantined as discovery would have, and taken out of
    ``report.files`` and ``report.bytes``, and an archive goes to ``archives`` with its kind (for the caller
    to expand, :func:`~medload.ingest.discover.expand_archive`)."""
    low, high = _HEADER_BATCH
    size = max(low, min(high, len(refs) // (8 * pool.size)))
    task = header_batch if archives is None else sniffing_header_batch
    jobs = deque((pool.submit(task, refs[i : i + size]), refs[i : i + size]) for i in range(0, len(refs), size))
    headers: list[SliceHeader] = []
    shared = SharedValues()
    with progress_bar("reading headers", len(refs), enabled=progress) as advance:
        while jobs:
            job, batch = jobs.popleft()
            results = pool.wait(job)
            if isinstance(results, Lost):
                culprit, rest = batch[results.index], batch[: results.index] + batch[results.index + 1 :]
                report.rejects.append(RejectRecord("rejected", "header", results.reason, culprit.display,
                                                   source_sha256(culprit)))
                if rest:
                    jobs.append((pool.submit(task, rest), rest))
                advance(1)
                continue
            for ref, res in zip(batch, results):
                if isinstance(res, Failure):
                    report.rejects.append(RejectRecord("skipped" if res.skipped else "rejected", res.stage,
                                                       res.reason, res.source, res.sha256))
                elif isinstance(res, LabelInput):
                    label_inputs.append(res)
                elif isinstance(res, (DiscoveryProblem, Archive)):
                    report.files -= 1
                    report.bytes -= ref.size
                    if isinstance(res, DiscoveryProblem):
                        report.rejects.append(RejectRecord(res.status, "discover", res.reason, res.display,
                                                           problem_sha256(res)))
                    elif archives is not None:
                        archives.append((ref, res.kind))
                else:
                    headers.extend(shared.share(h) for h in res)
            advance(len(results))
    return headers


class SeriesPlan:
    """A candidate accepted for writing, with its geometry; ``failure`` is set if decoding fails."""

    def __init__(self, cand: SeriesCandidate, geom: Geometry) -> None:
        self.cand, self.geom = cand, geom
        self.failure: Failure | None = None


def _ordered(pool: IsolatedPool, fn: Callable[[DecodeChunk], list[EncodedSlice] | Failure], chunks: list[DecodeChunk],
             window: int, ring: SliceRing | None) -> Iterator[tuple[DecodeChunk, list[EncodedSlice] | Failure | Lost]]:
    """(chunk, result) in chunk order, at most ``window`` chunks in flight, each holding a ring slot
    until the caller has consumed its result."""
    pending: deque[tuple[DecodeChunk, Job[list[EncodedSlice] | Failure]]] = deque()
    todo = iter(chunks)
    while True:
        while len(pending) < window and (chunk := next(todo, None)) is not None:
            if ring is not None:
                chunk = replace(chunk, ring=ring.acquire())
            pending.append((chunk, pool.submit(fn, chunk)))
        if not pending:
            return
        chunk, job = pending.popleft()
        yield chunk, pool.wait(job)
        if ring is not None and chunk.ring is not None:  # chunks hold a slot only when there is a ring
            ring.release(chunk.ring)


def _chunks(plans: list[SeriesPlan]) -> Iterator[DecodeChunk]:
    for index, plan in enumerate(plans):
        h = plan.cand.first
        per_chunk = max(1, _CHUNK_BYTES // max(1, h.rows * h.cols * 2))
        slots = plan.geom.slots
        for z0 in range(0, len(slots), per_chunk):
            yield DecodeChunk(index, z0, slots[z0 : z0 + per_chunk], h.modality, plan.cand.value_dtype)


class _SeriesInProgress:
    def __init__(self, plan: SeriesPlan, txn: SeriesTransaction) -> None:
        self.plan, self.txn = plan, txn
        self.digests: list[bytes] = []
        self.sources: list[str] = []
        self.padding = 0
        self.thumbs: list = []
        self.notes: list[str | None] = []


def decode_and_write(pool: IsolatedPool, writer: StoreWriter | TaskShardWriter, plans: list[SeriesPlan],
                     cfg: IngestConfig, report: IngestReport, progress: bool, labels: LabelAssigner | None,
                     rings: RingSupply | None = None) -> None:
    """Decode the planned series in ``pool`` and write each in one transaction of ``writer``; outcomes and
    quarantine records go to ``report``, labels that fit a series (``labels``) into its transaction. The
    shared-memory ring the values come through is taken from ``rings`` (default: a new one for this call)."""
    chunks = list(_chunks(plans))
    if not chunks:
        return
    window = 4 * pool.size + 8  # chunks in flight: enough to keep workers busy through a commit's fsync
    rings = rings or RingSupply()
    ring = rings.take(min(window, len(chunks)), min(_MAX_RING_SLOT, max(_chunk_bound(c, cfg) for c in chunks)))
    current: _SeriesInProgress | None = None
    # each worker holds up to 8 chunks (about 70 ms of 512 x 512 slices) so it decodes on while this process
    # commits a series (20-80 ms with its fsync here); with 2 it stalled at every commit (docs/benchmarks.md)
    queued, pool.queued = pool.queued, _CHUNKS_QUEUED
    try:
        with progress_bar("decoding and writing slices", sum(len(c.slots) for c in chunks), enabled=progress) as advance:
            for chunk, result in _ordered(pool, decode_chunk, chunks, window, ring):
                plan = plans[chunk.series_index]
                advance(len(chunk.slots))
                if plan.failure is not None:
                    continue
                if isinstance(result, Lost):
                    h = chunk.planes[result.index]
                    result = Failure(h.ref.display, "decode", result.reason, False, source_sha256(h.ref))
                if isinstance(result, Failure):
                    if current is not None and current.plan is plan:
                        current.txn.abort()
                        current = None
                    _reject(report, plan, result)
                    continue
                with _disk_full_is_error(writer, plan):
                    if current is None or current.plan is not plan:
                        current = _SeriesInProgress(plan, writer.begin_series(plan.cand.key, _estimate(plan, cfg)))
                    _put(current, result, ring)
                    if chunk.z0 + len(chunk.slots) == len(plan.geom.slots):
                        _finish_series(current, cfg, labels, report)
                        current = None
    finally:
        pool.queued = queued
        if current is not None:
            current.txn.abort()
        rings.give_back(ring)


def _disk_full_is_error(writer: StoreWriter | TaskShardWriter, plan: SeriesPlan) -> AbstractContextManager[None]:
    """A full disk while a series is written is one DiskFullError naming it (its transaction is rolled back)."""
    where = writer.root if isinstance(writer, StoreWriter) else writer.path
    return disk_full_is_error(where, "commit", f"writing series {plan.cand.key.hex()[:12]} into a staging shard")


def _reject(report: IngestReport, plan: SeriesPlan, failure: Failure) -> None:
    plan.failure = failure
    _record_outcome(report, plan, "rejected", f"{failure.reason} ({failure.source})")
    report.rejects.append(RejectRecord("rejected", failure.stage, failure.reason, failure.source, failure.sha256,
                                       series=plan.cand.key.hex(),
                                       sources=tuple(sorted({h.ref.display for h in plan.cand.headers}))))


def _finish_series(state: _SeriesInProgress, cfg: IngestConfig, labels: LabelAssigner | None,
                   report: IngestReport) -> None:
    """Commit a fully decoded series -- unless its pixels are implausible and the policy rejects them."""
    plan = state.plan
    flags: list[str] = []
    found = plausibility.series_problem(state.notes, state.thumbs)
    if found is not None:
        z, reason = found
        if cfg.plausibility == "reject":
            state.txn.abort()
            ref = plan.geom.slots[z][0].ref
            _reject(report, plan, Failure(ref.display, "plausibility", f"slice {z}: {reason}", False,
                                          source_sha256(ref)))
            return
        log.warning("series %s, slice %d: %s (kept, flagged: plausibility policy 'flag')",
                    plan.cand.key.hex()[:12], z, reason)
        flags.append(f"implausible_slice_{z}")
    _commit(state, cfg, labels, flags)
    report.slices_written += len(plan.geom.slots)
    _record_outcome(report, plan, "ingested", None)


def _chunk_bound(chunk: DecodeChunk, cfg: IngestConfig) -> int:
    """Most bytes a chunk's encoded values can take (the codec adds at most 64 bytes to a value)."""
    h = chunk.slots[0][0]
    pixels = h.rows * h.cols
    itemsize = 2 if chunk.dtype == "int16" else 4
    return len(chunk.slots) * ((pixels * itemsize + 64) + len(cfg.windows) * (pixels + 64))


def _estimate(plan: SeriesPlan, cfg: IngestConfig) -> int:
    h = plan.cand.first
    per_value = h.rows * h.cols * 4 + 8192
    return len(plan.geom.slots) * per_value * (1 + len(cfg.windows))


def _put(state: _SeriesInProgress, slices: list[EncodedSlice], ring: SliceRing | None) -> None:
    """Hand the chunk's values to the transaction (LMDB copies them, so the ring slot can be reused)."""
    def value(v: bytes | Span) -> bytes | memoryview:
        if isinstance(v, bytes):
            return v
        if ring is None:
            raise MedloadError(f"slice {state.plan.cand.key.hex()[:12]}: a value in a ring span, and no ring to read it "
                               "from (a bug in medload: please report it)")
        return ring.view(v)

    for s in slices:
        state.txn.put_slice(s.z, value(s.value), {name: value(v) for name, v in s.windows.items()})
        state.digests.append(s.digest)
        state.sources.append(s.source_hash)
        state.padding += s.padding
        state.thumbs.append(s.thumb)
        state.notes.append(s.implausible)


def _commit(state: _SeriesInProgress, cfg: IngestConfig, labels: LabelAssigner | None, flags: list[str]) -> None:
    """Write the series record and index entries -- and its label, when one fits -- and commit."""
    cand, geom = state.plan.cand, state.plan.geom
    h = cand.first
    shape = (len(geom.slots), h.rows, h.cols)
    record = SeriesRecord(
        key=cand.key.hex(),
        shape=shape,
        dtype=cand.value_dtype,
        spacing=geom.spacing,
        affine=tuple(tuple(float(v) for v in row) for row in geom.affine_ras),
        modality=h.modality,
        digest=series_digest(state.digests, shape, cand.value_dtype),
        orientation=tuple(float(v) for v in h.orientation),
        positions=tuple((float(x), float(y), float(z)) for x, y, z in geom.positions),  # (D, 3)
        patient=h.patient,
        study=h.study,
        series=h.series,
        source_fingerprint=cand.fingerprint,
        sources=tuple(state.sources),
        manufacturer=h.manufacturer,
        model=h.model,
        kernel=h.kernel,
        body_part=h.body_part,
        image_type=h.image_type,
        slice_thickness=h.slice_thickness,
        scanner_windows=h.window,
        windows=cfg.windows,
        flags=tuple(cand.flags + geom.flags + _header_flags(h) + flags),
        padding_voxels=state.padding,
        frame_of_reference=h.frame_of_reference,
        split=cand.split,
        time_series=cand.time_series,
        time_point=cand.time_point,
        **(diffusion_record(cand.diffusion, h.gradient_frame, geom.affine_lps) if cand.diffusion else {}),
    )
    label = None
    if labels is not None:
        grid = SeriesGrid(shape, geom.affine_lps, tuple(slot[0].instance for slot in geom.slots))
        found = labels.label_for(cand.key, grid)
        if found is not None:
            label = labels.put(state.txn, cand.key, *found)
    state.txn.commit(record, {"modality": h.modality, "study": h.study, "patient": h.patient,
                              "body_part": h.body_part}, label=label)


def _header_flags(h: SliceHeader) -> list[str]:
    """Flags a reader should know about: MONOCHROME1 display polarity; a Siemens MOSAIC, whose tiles
    are stored as the one 2-D image the file holds (not demosaiced into a volume)."""
    return (["monochrome1"] if h.photometric == "MONOCHROME1" else []) + (["mosaic"] if "MOSAIC" in h.image_type else [])


def _record_outcome(report: IngestReport, plan: SeriesPlan, status: str, reason: str | None) -> None:
    h = plan.cand.first
    shape = (len(plan.geom.slots), h.rows, h.cols)
    report.series.append(SeriesOutcome(plan.cand.key.hex(), status, h.modality, len(plan.cand.headers), shape, reason))
