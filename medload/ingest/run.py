"""``ingest``: sources → header pass → series → geometry → decode in workers → one writer → report.

Decoding runs in worker processes (default: all cores) and returns encoded store values; this process
is the only writer. Work is submitted in series order and consumed in that order through a bounded
window, so memory stays bounded and every series is written in one transaction as soon as its last
chunk arrives. Worker processes are started before any LMDB environment is opened (py-lmdb's rule
for ``fork``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from medload import windows as win
from medload.config import IngestConfig
from medload.errors import ConfigError, InputProblem
from medload.ingest.deid import Pseudonymizer, load_key
from medload.ingest.discover import DiscoveryProblem, SourceRef, discover
from medload.ingest.geometry import Geometry, plan_geometry
from medload.ingest.headers import SliceHeader
from medload.ingest.label_writer import LabelAssigner
from medload.ingest.labels import LabelInput, label_inputs_from_path
from medload.ingest.report import IngestReport, SeriesOutcome
from medload.ingest.ring import SliceRing
from medload.ingest.series import SeriesCandidate, group_series
from medload.ingest.worker import DecodeChunk, EncodedSlice, Failure, decode_chunk, header_batch, init_worker
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


def ingest(sources: str | Path | Sequence[str | Path], store: str | Path, *, config: IngestConfig | None = None,
           key_file: str | Path | None = None, progress: bool = False, labels: Sequence[str | Path] = (),
           roi_map: dict[str, list[str]] | None = None) -> IngestReport:
    """Ingest DICOM files, folders and zip/tar archives into the store at ``store``.

    Bad inputs never stop the run: they are quarantined in the store's ``rejects`` with a reason, and
    counted in the returned report. Re-running on the same sources adds nothing.

    Labels: DICOM SEG and RTSTRUCT among the sources pair with the series they reference; ``labels``
    adds folders of masks or SEG/RTSTRUCT files, or mapping files (see :mod:`medload.ingest.labels`);
    ``roi_map`` (``{"liver": ["Liver", "LIVER_1"]}``) gives RTSTRUCT ROIs consistent class ids.

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
    started = time.perf_counter()
    key = load_key(key_file)
    pseudo = Pseudonymizer(key)
    report = IngestReport(store=str(store))
    with _executor(cfg, key) as pool, StoreWriter(Path(store), codec=cfg.codec, windows=cfg.windows,
                                                  key_fingerprint=pseudo.fingerprint,
                                                  shard_bytes=cfg.shard_bytes) as writer:
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
            plans = _plan(candidates, writer, cfg, report)
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
    report.seconds = time.perf_counter() - started
    log.info("ingest of %d files took %.1f s (%.0f files/s)", report.files, report.seconds, report.files_per_second)
    return report


# ---- execution -----------------------------------------------------------------------------------
class _InlineExecutor(Executor):
    """``workers=1``: run tasks in this process, with the same interface as the pool."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


def _noop() -> None:
    return None


@contextmanager
def _executor(cfg: IngestConfig, key: bytes) -> Iterator[Executor]:
    n = cfg.worker_count
    if n == 1:
        init_worker(key, cfg, own_process=False)
        yield _InlineExecutor()
        return
    method = "fork" if sys.platform.startswith("linux") else "spawn"
    pool = ProcessPoolExecutor(max_workers=n, mp_context=mp.get_context(method), initializer=init_worker,
                               initargs=(key, cfg))
    try:
        pool.submit(_noop).result()  # with fork, all workers start now: before any LMDB env is open
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _ordered(pool: Executor, fn: Callable, chunks: list[DecodeChunk], window: int,
             ring: SliceRing | None) -> Iterator[tuple[DecodeChunk, object]]:
    """(chunk, result) in chunk order, at most ``window`` chunks in flight, each holding a ring slot
    until the caller has consumed its result."""
    pending: deque[tuple[DecodeChunk, Future]] = deque()
    todo = iter(chunks)
    while True:
        while len(pending) < window and (chunk := next(todo, None)) is not None:
            if ring is not None:
                chunk = replace(chunk, ring=ring.acquire())
            pending.append((chunk, pool.submit(fn, chunk)))
        if not pending:
            return
        chunk, future = pending.popleft()
        yield chunk, future.result()
        if chunk.ring is not None:
            ring.release(chunk.ring)


# ---- stages --------------------------------------------------------------------------------------
def _discover(sources, spool: Path, report: IngestReport) -> list[SourceRef]:
    refs = []
    for item in discover(sources, spool_dir=spool):
        if isinstance(item, DiscoveryProblem):
            report.rejects.append(RejectRecord("skipped" if item.skipped else "rejected", "discover", item.reason,
                                               item.display))
        else:
            refs.append(item)
    report.files = len(refs)
    report.bytes = sum(r.size for r in refs)
    return refs


def _header_pass(pool: Executor, refs: list[SourceRef], report: IngestReport, progress: bool,
                 label_inputs: list[LabelInput]) -> list[SliceHeader]:
    """Image planes of every input; SEG/RTSTRUCT objects are added to ``label_inputs``."""
    batches = [refs[i : i + _HEADER_BATCH] for i in range(0, len(refs), _HEADER_BATCH)]
    headers: list[SliceHeader] = []
    with progress_bar("reading headers", len(refs), enabled=progress) as advance:
        for future in as_completed([pool.submit(header_batch, b) for b in batches]):
            results = future.result()
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


def _plan(candidates: list[SeriesCandidate], writer: StoreWriter, cfg: IngestConfig, report: IngestReport) -> list[_Plan]:
    plans = []
    for cand in candidates:
        outcome = dict(key=cand.key.hex(), modality=cand.first.modality, planes=len(cand.headers))
        if cand.skip_reason:
            report.series.append(SeriesOutcome(status="skipped", reason=cand.skip_reason, **outcome))
            report.rejects.append(_series_record(cand, "skipped", "series", cand.skip_reason))
            continue
        stored = writer.series_fingerprints.get(cand.key)
        if stored is not None:
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


def _decode_and_write(pool: Executor, writer: StoreWriter, plans: list[_Plan], cfg: IngestConfig,
                      report: IngestReport, progress: bool, labels: LabelAssigner | None) -> None:
    chunks = list(_chunks(plans))
    if not chunks:
        return
    window = 4 * cfg.worker_count + 8  # chunks in flight: enough to keep workers busy through a commit's fsync
    ring = None
    if not isinstance(pool, _InlineExecutor):  # in-process work needs no transport
        ring = SliceRing.create(min(window, len(chunks)), max(_chunk_bound(c, cfg) for c in chunks))
    current: _SeriesInProgress | None = None
    try:
        with progress_bar("decoding and writing slices", sum(len(c.slots) for c in chunks), enabled=progress) as advance:
            for chunk, result in _ordered(pool, decode_chunk, chunks, window, ring):
                plan = plans[chunk.series_index]
                advance(len(chunk.slots))
                if plan.failure is not None:
                    continue
                if isinstance(result, Failure):
                    plan.failure = result
                    if current is not None and current.plan is plan:
                        current.txn.abort()
                        current = None
                    _record_outcome(report, plan, "rejected", f"{result.reason} ({result.source})")
                    report.rejects.append(RejectRecord("rejected", result.stage, result.reason, result.source,
                                                       result.sha256, series=plan.cand.key.hex()))
                    continue
                if current is None or current.plan is not plan:
                    current = _SeriesInProgress(plan, writer.begin_series(plan.cand.key, _estimate(plan, cfg)))
                _put(current, result, ring)
                if chunk.z0 + len(chunk.slots) == len(plan.geom.slots):
                    _commit(current, cfg, labels)
                    report.slices_written += len(plan.geom.slots)
                    _record_outcome(report, plan, "ingested", None)
                    current = None
    finally:
        if current is not None:
            current.txn.abort()
        if ring is not None:
            ring.close()


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


def _commit(state: _SeriesInProgress, cfg: IngestConfig, labels: LabelAssigner | None) -> None:
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
        flags=tuple(geom.flags + _header_flags(h)),
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
