"""``ingest``: sources → header pass → series → geometry → decode in workers → one writer → report.

Headers are read and pixels decoded in supervised worker processes (default: all cores; see
:mod:`medload.ingest.isolation`), so an input that crashes, exhausts or hangs a decoder is quarantined
and the run goes on; this process is the only writer. Work is submitted in series order and consumed
in that order through a bounded window, so memory stays bounded and every series is written in one
transaction as soon as its last chunk arrives. Worker processes are started before any LMDB
environment is opened (py-lmdb's rule for ``fork``).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from medload import windows as win
from medload.config import IngestConfig
from medload.errors import ConfigError, InputProblem
from medload.ingest import plausibility
from medload.ingest.deid import Pseudonymizer, load_key
from medload.ingest.discover import DiscoveryProblem, SourceRef, discover, problem_sha256
from medload.ingest.geometry import Geometry, plan_geometry
from medload.ingest.headers import SliceHeader
from medload.ingest.isolation import IsolatedPool, Job, Lost
from medload.ingest.label_writer import LabelAssigner
from medload.ingest.labels import LabelInput, label_inputs_from_path
from medload.ingest.report import IngestReport, SeriesOutcome
from medload.ingest.ring import SliceRing
from medload.ingest.series import SeriesCandidate, group_series
from medload.ingest.worker import (DecodeChunk, EncodedSlice, Failure, decode_chunk, header_batch, init_worker,
                                   source_sha256)
from medload.progress import progress_bar
from medload.labels.grid import SeriesGrid
from medload.storage.codec import get_codec
from medload.storage.digest import series_digest
from medload.storage.records import RejectRecord, SeriesRecord
from medload.storage.store import open_store
from medload.storage.writer import SeriesTransaction, StoreWriter

__all__ = ["ingest"]

log = logging.getLogger(__name__)

_HEADER_BATCH = 32
_CHUNK_BYTES = 8 << 20
_MAX_RING_SLOT = 64 << 20  # a chunk larger than this (one huge plane) goes through the pipe instead


def ingest(sources: str | Path | Sequence[str | Path], store: str | Path, *, config: IngestConfig | None = None,
           key_file: str | Path | None = None, progress: bool = False, labels: Sequence[str | Path] = (),
           roi_map: dict[str, list[str]] | None = None, force: Sequence[str] = (),
           force_only: bool = False) -> IngestReport:
    """Ingest DICOM files, folders and zip/tar archives into the store at ``store``.

    Bad inputs never stop the run: they are quarantined in the store's ``rejects`` with a reason, and
    counted in the returned report. Re-running on the same sources adds nothing.

    Labels: DICOM SEG and RTSTRUCT among the sources pair with the series they reference; ``labels``
    adds folders of masks or SEG/RTSTRUCT files, or mapping files (see :mod:`medload.ingest.labels`);
    ``roi_map`` (``{"liver": ["Liver", "LIVER_1"]}``) gives RTSTRUCT ROIs consistent class ids.

    ``force`` names stored series (hex keys, or unique prefixes of at least 8 digits; an unknown one is an
    error) to write again from ``sources``: the new copy replaces the stored one (status ``replaced``,
    see :mod:`medload.storage.live`), and so do its labels, which must come with it (``labels``, or
    SEG/RTSTRUCT among the sources) or are dropped. A forced series none of whose files is among the
    sources is ``not_found``. ``force_only`` writes nothing but the forced series (``medload repair``).

    Example:
        >>> report = ingest("sample_data/philips_ct_head/dicom", "stores/sample")  # doctest: +SKIP
        >>> report.counts["ingested"]
        1
    """
    cfg = config or IngestConfig()
    cfg = replace(cfg, windows=tuple(w.name for w in win.parse_list(",".join(cfg.windows))))
    listed = [sources] if isinstance(sources, (str, Path)) else list(sources)
    missing = [str(s) for s in listed if not Path(s).exists()]
    if missing:
        raise ConfigError(f"source not found: {', '.join(missing)} (give existing files, folders or archives)")
    if force and not (Path(store) / "store.json").is_file():
        raise ConfigError(f"--force writes stored series again, but {store} is not a store: check the path")
    started = time.perf_counter()
    key = load_key(key_file)
    pseudo = Pseudonymizer(key)
    report = IngestReport(store=str(store))
    with IsolatedPool(cfg.worker_count, init_worker, (key, cfg), memory=cfg.worker_memory,
                      timeout=cfg.decode_timeout) as pool, StoreWriter(Path(store), codec=cfg.codec, windows=cfg.windows,
                                                  key_fingerprint=pseudo.fingerprint,
                                                  shard_bytes=cfg.shard_bytes) as writer:
        forced = set(writer.force(force))
        staging = writer.root / "staging"
        for old in staging.glob("spool-*"):
            shutil.rmtree(old, ignore_errors=True)
        spool = Path(tempfile.mkdtemp(prefix="spool-", dir=staging))
        try:
            label_inputs, label_files = [], []
            for path in labels:
                masks, dicom = label_inputs_from_path(path, pseudo)
                label_inputs += masks
                label_files += dicom
            refs = _discover(sources, spool, report) + label_files
            headers = _header_pass(pool, refs, report, progress, label_inputs)
            candidates = group_series(headers)
            plans = _plan(candidates, writer, cfg, report, forced, force_only)
            assigner = None
            if label_inputs:
                stored = {r.key_bytes: r for r in open_store(writer.root).series()} if writer.manifest.shards else {}
                assigner = LabelAssigner(label_inputs, candidates, stored, writer, pseudo, roi_map,
                                         get_codec(writer.manifest.codec), report)
            _decode_and_write(pool, writer, plans, cfg, report, progress, assigner)
            if assigner is not None:
                assigner.write_stored()
            writer.put_rejects(report.rejects)
        finally:
            shutil.rmtree(spool, ignore_errors=True)
    report.mark_replaced(writer.replaced)
    report.seconds = time.perf_counter() - started
    log.info("ingest of %d files took %.1f s (%.0f files/s)", report.files, report.seconds, report.files_per_second)
    return report


# ---- execution -----------------------------------------------------------------------------------
def _ordered(pool: IsolatedPool, fn: Callable, chunks: list[DecodeChunk], window: int,
             ring: SliceRing | None) -> Iterator[tuple[DecodeChunk, object]]:
    """(chunk, result) in chunk order, at most ``window`` chunks in flight, each holding a ring slot
    until the caller has consumed its result."""
    pending: deque[tuple[DecodeChunk, Job]] = deque()
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
        if chunk.ring is not None:
            ring.release(chunk.ring)


# ---- stages --------------------------------------------------------------------------------------
def _discover(sources, spool: Path, report: IngestReport) -> list[SourceRef]:
    refs = []
    for item in discover(sources, spool_dir=spool):
        if isinstance(item, DiscoveryProblem):
            report.rejects.append(RejectRecord("skipped" if item.skipped else "rejected", "discover", item.reason,
                                               item.display, problem_sha256(item)))
        else:
            refs.append(item)
    report.files = len(refs)
    report.bytes = sum(r.size for r in refs)
    return refs


def _header_pass(pool: IsolatedPool, refs: list[SourceRef], report: IngestReport, progress: bool,
                 label_inputs: list[LabelInput]) -> list[SliceHeader]:
    """Image planes of every input; SEG/RTSTRUCT objects are added to ``label_inputs``. An input that
    brings its worker down is quarantined and the rest of its batch read again."""
    jobs = deque((pool.submit(header_batch, refs[i : i + _HEADER_BATCH]), refs[i : i + _HEADER_BATCH])
                 for i in range(0, len(refs), _HEADER_BATCH))
    headers: list[SliceHeader] = []
    with progress_bar("reading headers", len(refs), enabled=progress) as advance:
        while jobs:
            job, batch = jobs.popleft()
            results = pool.wait(job)
            if isinstance(results, Lost):
                culprit, rest = batch[results.index], batch[: results.index] + batch[results.index + 1 :]
                report.rejects.append(RejectRecord("rejected", "header", results.reason, culprit.display,
                                                   source_sha256(culprit)))
                if rest:
                    jobs.append((pool.submit(header_batch, rest), rest))
                advance(1)
                continue
            for res in results:
                if isinstance(res, Failure):
                    report.rejects.append(RejectRecord("skipped" if res.skipped else "rejected", res.stage,
                                                       res.reason, res.source, res.sha256))
                elif isinstance(res, LabelInput):
                    label_inputs.append(res)
                else:
                    headers.extend(res)
            advance(len(results))
    return headers


class _Plan:
    """A candidate accepted for writing, with its geometry; ``failure`` is set if decoding fails."""

    def __init__(self, cand: SeriesCandidate, geom: Geometry) -> None:
        self.cand, self.geom = cand, geom
        self.failure: Failure | None = None


def _plan(candidates: list[SeriesCandidate], writer: StoreWriter, cfg: IngestConfig, report: IngestReport,
          forced: set[bytes], force_only: bool) -> list[_Plan]:
    """The candidates to write: those not stored yet, and the ``forced`` ones (only those with ``force_only``)."""
    plans = []
    for cand in candidates:
        if force_only and cand.key not in forced:
            continue
        outcome = dict(key=cand.key.hex(), modality=cand.first.modality, planes=len(cand.headers))
        if cand.skip_reason:
            report.series.append(SeriesOutcome(status="skipped", reason=cand.skip_reason, **outcome))
            report.rejects.append(_series_record(cand, "skipped", "series", cand.skip_reason))
            continue
        stored = writer.series_fingerprints.get(cand.key)
        if stored is not None and cand.key not in forced:
            if stored == cand.fingerprint:
                report.series.append(SeriesOutcome(status="present", **outcome))
            else:
                report.series.append(SeriesOutcome(status="conflict", reason=(
                    "already stored from different source instances; the stored series is left unchanged"), **outcome))
            continue
        try:
            geom = plan_geometry(cand.headers, cfg)
        except InputProblem as exc:
            report.series.append(SeriesOutcome(status="rejected", reason=exc.reason, **outcome))
            report.rejects.append(_series_record(cand, "rejected", exc.stage, exc.reason))
            continue
        plans.append(_Plan(cand, geom))
    for key in sorted(forced - {c.key for c in candidates}):
        report.series.append(SeriesOutcome(key.hex(), "not_found", "", 0, reason=(
            "forced, but none of its files is among the sources: the stored copy is left unchanged")))
    return plans


def _series_record(cand: SeriesCandidate, status: str, stage: str, reason: str) -> RejectRecord:
    """Quarantine record of a whole candidate volume, listing its files."""
    sources = tuple(sorted({h.ref.display for h in cand.headers}))
    return RejectRecord(status, stage, reason, f"series {cand.key.hex()[:12]} ({len(cand.headers)} planes)",
                        series=cand.key.hex(), sources=sources)


def _chunks(plans: list[_Plan]) -> Iterator[DecodeChunk]:
    for index, plan in enumerate(plans):
        h = plan.cand.first
        per_chunk = max(1, _CHUNK_BYTES // max(1, h.rows * h.cols * 2))
        slots = plan.geom.slots
        for z0 in range(0, len(slots), per_chunk):
            yield DecodeChunk(index, z0, slots[z0 : z0 + per_chunk], h.modality, plan.cand.value_dtype)


class _SeriesInProgress:
    def __init__(self, plan: _Plan, txn: SeriesTransaction) -> None:
        self.plan, self.txn = plan, txn
        self.digests: list[bytes] = []
        self.sources: list[str] = []
        self.padding = 0
        self.thumbs: list = []
        self.notes: list[str | None] = []


def _decode_and_write(pool: IsolatedPool, writer: StoreWriter, plans: list[_Plan], cfg: IngestConfig,
                      report: IngestReport, progress: bool, labels: LabelAssigner | None) -> None:
    chunks = list(_chunks(plans))
    if not chunks:
        return
    window = 4 * cfg.worker_count + 8  # chunks in flight: enough to keep workers busy through a commit's fsync
    ring = SliceRing.create(min(window, len(chunks)), min(_MAX_RING_SLOT, max(_chunk_bound(c, cfg) for c in chunks)))
    current: _SeriesInProgress | None = None
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
                if current is None or current.plan is not plan:
                    current = _SeriesInProgress(plan, writer.begin_series(plan.cand.key, _estimate(plan, cfg)))
                _put(current, result, ring)
                if chunk.z0 + len(chunk.slots) == len(plan.geom.slots):
                    _finish_series(current, cfg, labels, report)
                    current = None
    finally:
        if current is not None:
            current.txn.abort()
        if ring is not None:
            ring.close()


def _reject(report: IngestReport, plan: _Plan, failure: Failure) -> None:
    plan.failure = failure
    _record_outcome(report, plan, "rejected", f"{failure.reason} ({failure.source})")
    report.rejects.append(RejectRecord("rejected", failure.stage, failure.reason, failure.source, failure.sha256,
                                       series=plan.cand.key.hex()))


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


def _estimate(plan: _Plan, cfg: IngestConfig) -> int:
    h = plan.cand.first
    per_value = h.rows * h.cols * 4 + 8192
    return len(plan.geom.slots) * per_value * (1 + len(cfg.windows))


def _put(state: _SeriesInProgress, slices: list[EncodedSlice], ring: SliceRing | None) -> None:
    """Hand the chunk's values to the transaction (LMDB copies them, so the ring slot can be reused)."""
    def value(v):
        return v if isinstance(v, bytes) else ring.view(v)

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
        positions=tuple(tuple(float(v) for v in p) for p in geom.positions),
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
        flags=tuple(geom.flags + _header_flags(h) + flags),
        padding_voxels=state.padding,
        frame_of_reference=h.frame_of_reference,
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


def _record_outcome(report: IngestReport, plan: _Plan, status: str, reason: str | None) -> None:
    h = plan.cand.first
    shape = (len(plan.geom.slots), h.rows, h.cols)
    report.series.append(SeriesOutcome(plan.cand.key.hex(), status, h.modality, len(plan.cand.headers), shape, reason))
