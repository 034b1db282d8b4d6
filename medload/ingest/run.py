"""``ingest``: sources → header pass → series → geometry → decode and write in tasks → publish → report.

Headers are read and pixels decoded in supervised worker processes (see :mod:`medload.ingest.isolation`
and :mod:`medload.ingest.stages`), so an input that crashes, exhausts or hangs a decoder is quarantined
and the run goes on. Series are written by tasks into shards of their own, which this process -- the
store's one writer -- publishes (:mod:`medload.ingest.shard_tasks`). The tasks run either on this
machine's cores (default: all; :mod:`medload.ingest.local_engine`) or, with ``scheduler``, on a Dask
cluster (:mod:`medload.ingest.dask_engine`).
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from medload import windows as win
from medload.config import IngestConfig
from medload.deid import KeyFile, Pseudonymizer
from medload.errors import ConfigError, InputProblem, MedloadError, NoDicomError
from medload.ingest.discover import DiscoveryProblem, SourceRef, discover, expand_archive, problem_sha256
from medload.ingest.geometry import plan_geometry
from medload.ingest.label_writer import LabelAssigner
from medload.ingest.labels import LabelInput, label_inputs_from_path
from medload.ingest.local_engine import LocalEngine
from medload.ingest.memory_need import fit_workers, short_of_memory
from medload.ingest.report import IngestReport, SeriesOutcome
from medload.ingest.series import SeriesCandidate, group_series
from medload.ingest.stages import SeriesPlan
from medload.storage.codec import get_codec
from medload.storage.manifest import STORE_LAYOUT, backup_path, manifest_path, read_manifest
from medload.storage.records import RejectRecord
from medload.storage.space import disk_full_is_error
from medload.storage.store import open_store
from medload.storage.store_key import load_store_key
from medload.storage.writer import StoreWriter

if TYPE_CHECKING:
    from medload.ingest.dask_engine import DaskEngine

__all__ = ["ingest", "open_writer"]

log = logging.getLogger(__name__)


class _OutcomeFields(TypedDict):
    """The :class:`SeriesOutcome` fields every outcome of one candidate shares."""

    key: str
    modality: str
    planes: int


def ingest(sources: str | Path | Sequence[str | Path], store: str | Path, *, config: IngestConfig | None = None,
           key_file: str | Path | KeyFile | None = None, progress: bool = False, labels: Sequence[str | Path] = (),
           roi_map: dict[str, list[str]] | None = None, force: Sequence[str] = (),
           force_only: bool = False, scheduler: str | None = None, empty_ok: bool = False,
           pseudonymizer: Pseudonymizer | None = None) -> IngestReport:
    """Ingest DICOM files, folders and zip/tar archives into the store at ``store``.

    Bad inputs never stop the run: they are quarantined in the store's ``rejects`` with a reason, and
    counted in the returned report. Re-running on the same sources adds nothing. A full disk stops it
    with :class:`~medload.errors.DiskFullError` (its ``stage`` says where): the series committed until
    then are kept, and the same call once there is space writes the rest.

    Labels: DICOM SEG and RTSTRUCT among the sources pair with the series they reference; ``labels``
    adds folders of masks or SEG/RTSTRUCT files, or mapping files (see :mod:`medload.ingest.labels`);
    ``roi_map`` (``{"liver": ["Liver", "LIVER_1"]}``) gives RTSTRUCT ROIs consistent class ids.

    ``force`` names stored series (hex keys, or unique prefixes of at least 8 digits; an unknown one is an
    error) to write again from ``sources``: the new copy replaces the stored one (status ``replaced``,
    see :mod:`medload.storage.live`), and so do its labels, which must come with it (``labels``, or
    SEG/RTSTRUCT among the sources) or are dropped. A forced series none of whose files is among the
    sources is ``not_found``. ``force_only`` writes nothing but the forced series (``medload repair``).

    ``scheduler`` runs the header pass and decoding as tasks on a Dask cluster: ``"local"`` or
    ``"local:N"`` (a LocalCluster of N workers, default one per core), ``"tcp://HOST:PORT"`` /
    ``"tls://HOST:PORT"`` (a running scheduler), ``"slurm"`` or ``"slurm:JOBS"`` (dask-jobqueue); see
    :mod:`medload.ingest.cluster`. The store is the same as without it, bar the grouping of series
    into shards. Not with ``force``.

    The pseudonymisation key is ``key_file`` (see :func:`medload.deid.load_key`), or a
    ``pseudonymizer`` already made from it by a caller that ingests in parts (PACS ingest, batch by
    batch), so the key is loaded and checked once.

    Sources without any DICOM input (and no ``labels``, no ``force``) raise
    :class:`~medload.errors.NoDicomError`, naming what they hold; a store the call created for them is
    removed again, an existing one is left as it was. ``empty_ok`` makes such sources an empty run instead
    (a PACS retrieval whose instances were all refused).

    Examples:
        >>> report = ingest("sample_data/philips_ct_head/dicom", "stores/first")
        >>> report.counts["ingested"], ingest("sample_data/philips_ct_head/dicom", "stores/first").counts["present"]
        (1, 1)
    """
    cfg = config or IngestConfig()
    asked = tuple(w.name for w in win.parse_list(",".join(cfg.windows)))
    cfg = replace(cfg, windows=_as_the_store_names(Path(store), asked))
    if scheduler is None or scheduler.startswith("local"):  # workers of this machine: as many as fit in its memory
        cfg = fit_workers(cfg)
    listed = [sources] if isinstance(sources, (str, Path)) else list(sources)
    missing = [str(s) for s in listed if not Path(s).exists()]
    if missing:
        raise ConfigError(f"source not found: {', '.join(missing)} (give existing files, folders or archives)")
    if force and not (Path(store) / "store.json").is_file():
        raise ConfigError(f"--force writes stored series again, but {store} is not a store: check the path")
    if force and scheduler is not None:
        raise ConfigError("--force replaces a few series: run it without --scheduler")
    started = time.perf_counter()
    if pseudonymizer is not None and key_file is not None:
        raise ConfigError("give the key (key_file) or a Pseudonymizer made from it, not both")
    # the store is checked before a key is created for it
    pseudo = pseudonymizer or Pseudonymizer(load_store_key(key_file, store))
    report = IngestReport(store=str(store))
    label_inputs: list[LabelInput] = []
    label_files: list[SourceRef] = []
    for path in labels:  # a bad mapping file stops the run before a store or a cluster is made
        masks, dicom = label_inputs_from_path(path, pseudo)
        label_inputs += masks
        label_files += dicom
    with _engine(scheduler, cfg, pseudo, Path(store), bool(force)) as engine, open_writer(Path(store), cfg, pseudo) as writer:
        forced = set(writer.force(force))
        staging = writer.root / "staging"
        for old in staging.glob("spool-*"):
            shutil.rmtree(old, ignore_errors=True)
        with disk_full_is_error(staging, "spool", "creating the spool folder for archive members"):
            spool = Path(tempfile.mkdtemp(prefix="spool-", dir=staging))
        try:
            refs = _discover(sources, spool, report) + label_files  # files unread: the header pass sniffs them
            if not (refs or label_inputs or force or empty_ok):
                raise _no_dicom(listed, report, writer.root)
            if (short := short_of_memory(len(refs))) is not None:
                log.warning("%s", short)
            archives: list[tuple[SourceRef, str]] = []
            headers = engine.headers(refs, report, progress, label_inputs, archives)
            del refs  # the headers came back with their own copies (~200 B a file: 200 MB per million files)
            if archives:  # found by the header pass: their members are read now
                members = _expand(archives, spool, report)
                headers += engine.headers(members, report, progress, label_inputs)
            if not (report.files or label_files or label_inputs or force or empty_ok):
                raise _no_dicom(listed, report, writer.root)  # the files found were none of them DICOM
            candidates = group_series(headers, time_series=cfg.time_series,
                                      duplicate_tolerance=cfg.duplicate_tolerance_mm)
            del headers  # the candidates hold them
            plans = _plan(candidates, writer, cfg, report, forced, force_only)
            assigner = None
            if label_inputs:
                stored = {r.key_bytes: r for r in open_store(writer.root).series()} if writer.manifest.shards else {}
                assigner = LabelAssigner(label_inputs, candidates, stored, writer, pseudo, roi_map,
                                         get_codec(writer.manifest.codec), report, roots=[*labels, *listed],
                                         min_kept=cfg.label_min_kept)
            with _out_of_the_collectors_way():
                engine.write(plans, writer, report, progress, assigner)
            with disk_full_is_error(writer.root, "commit", "writing labels and quarantine records"):
                if assigner is not None:
                    assigner.write_stored()
                writer.resolve_rejects(*_stored(candidates, report))
                writer.put_rejects(report.rejects)
        finally:
            shutil.rmtree(spool, ignore_errors=True)
    report.mark_replaced(writer.replaced)
    report.seconds = time.perf_counter() - started
    log.info("ingest of %d files took %.1f s (%.0f files/s)", report.files, report.seconds, report.files_per_second)
    return report


@contextmanager
def open_writer(root: Path, cfg: IngestConfig, pseudo: Pseudonymizer) -> Iterator[StoreWriter]:
    """The store's writer for an ingest into ``root`` with these settings, the one way every ingest (files,
    archives, a PACS) opens it: creating the store, or checking that its key, codec and windows match; a
    full disk is a :class:`~medload.errors.DiskFullError`. Closing it publishes what was committed, also
    when the run stops on an error.
    A store it created is removed again when the sources hold no DICOM (:class:`NoDicomError`)."""
    existed, new = root.exists(), not (manifest_path(root).exists() or backup_path(root).exists())
    with disk_full_is_error(root, "publish", "opening the store for writing (store.json, and publishing what an "
                                             "interrupted ingest left)"):
        writer = StoreWriter(root, codec=cfg.codec, windows=cfg.windows, key_fingerprint=pseudo.fingerprint,
                             shard_bytes=cfg.shard_bytes, share=cfg.share)
    discard = False
    try:
        yield writer
    except NoDicomError:
        discard = new
        raise
    finally:
        try:
            if discard:
                _unmake(root)
        finally:
            with disk_full_is_error(root, "publish", "publishing the staging shard"):
                writer.close()
        if discard and not existed:
            with suppress(OSError):  # someone else's store began there meanwhile: it stays
                root.rmdir()


def _unmake(root: Path) -> None:
    """Remove the files of the empty store this run created, while its writer holds the lock (``writer.lock``
    goes too: the lock stays held until the writer closes). Only empty folders are removed: anything else
    stays, and a leftover empty store is a valid one."""
    for name in sorted(STORE_LAYOUT):
        path = root / name
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            elif path.exists() or path.is_symlink():
                path.unlink()
        except OSError as exc:
            log.warning("could not remove %s of the store created for sources without DICOM: %s", path, exc)


def _no_dicom(sources: list, report: IngestReport, root: Path) -> NoDicomError:
    """The error for sources without DICOM: what they hold (counts, an example of each status)."""
    found = []
    for status in ("ignored", "rejected", "skipped"):
        records = report.quarantined(status)
        if records:
            found.append(f"{len(records)} {status}, e.g. {records[0].source} ({records[0].reason})")
    return NoDicomError(f"no DICOM found in {', '.join(map(str, sources))}: {'; '.join(found) or 'no files'}. "
                        f"Give the files, folders or zip/tar archives that hold the DICOM series (nothing was "
                        f"written to {root})")


def _engine(scheduler: str | None, cfg: IngestConfig, pseudo: Pseudonymizer, store: Path,
            forced: bool) -> LocalEngine | DaskEngine:
    if scheduler is None:  # one worker, or --force: this process writes (one shard, the replacements recorded)
        return LocalEngine(cfg, pseudo, in_process=forced or cfg.worker_count == 1)
    from medload.ingest.dask_engine import DaskEngine

    return DaskEngine(scheduler, cfg, pseudo, store)


# ---- stages --------------------------------------------------------------------------------------
@contextmanager
def _out_of_the_collectors_way() -> Iterator[None]:
    """Every object alive now -- above all the headers, candidates and plans, one set per file, held to the
    end -- frozen (:func:`gc.freeze`) while the series are written, unfrozen after: else each collection the
    writing stage triggers (parsing the records of every task shard it adopts) walks them all again, which
    was a fifth of the ingest process's CPU at 2,048 files and grows with the files. Objects a caller of
    :func:`ingest` froze itself are left to it."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _discover(sources: str | os.PathLike | Sequence[str | os.PathLike], spool: Path, report: IngestReport) -> list[SourceRef]:
    """The inputs under ``sources``: every regular file, unread, for the header pass to sniff (it takes those
    that are not DICOM out of ``report.files`` again: :func:`~medload.ingest.stages.header_pass`)."""
    refs = _kept(discover(sources, spool_dir=spool, sniff=False), report)
    report.files = len(refs)
    report.bytes = sum(r.size for r in refs)
    return refs


def _expand(archives: list[tuple[SourceRef, str]], spool: Path, report: IngestReport) -> list[SourceRef]:
    """The members of the archives the header pass found, counted in ``report``."""
    refs = _kept((item for ref, kind in archives for item in expand_archive(ref.path, kind, spool_dir=spool)), report)
    report.files += len(refs)
    report.bytes += sum(r.size for r in refs)
    return refs


def _kept(found: Iterable[SourceRef | DiscoveryProblem], report: IngestReport) -> list[SourceRef]:
    """The references among ``found``; its problems are quarantined."""
    refs = []
    for item in found:
        if isinstance(item, DiscoveryProblem):
            report.rejects.append(RejectRecord(item.status, "discover", item.reason, item.display,
                                               problem_sha256(item)))
        else:
            refs.append(item)
    return refs


def _plan(candidates: list[SeriesCandidate], writer: StoreWriter, cfg: IngestConfig, report: IngestReport,
          forced: set[bytes], force_only: bool) -> list[SeriesPlan]:
    """The candidates to write: those not stored yet, and the ``forced`` ones (only those with ``force_only``)."""
    plans = []
    for cand in candidates:
        if force_only and cand.key not in forced:
            continue
        outcome = _OutcomeFields(key=cand.key.hex(), modality=cand.first.modality, planes=len(cand.headers))
        if cand.skip_reason:
            report.series.append(SeriesOutcome(status="skipped", reason=cand.skip_reason, **outcome))
            report.rejects.append(_series_record(cand, "skipped", "series", cand.skip_reason))
            continue
        if cand.reject_reason:
            report.series.append(SeriesOutcome(status="rejected", reason=cand.reject_reason, **outcome))
            report.rejects.append(_series_record(cand, "rejected", "series", cand.reject_reason))
            continue
        stored = writer.series_fingerprints.get(cand.key)
        if cand.key in writer.unavailable and cand.key not in forced:
            report.series.append(SeriesOutcome(status="unavailable", reason=(
                f"stored in shard {writer.unavailable[cand.key]}, which cannot be read: `medload repair "
                f"{writer.root} --sources DIR` ingests it again and retires the shard"), **outcome))
            continue
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
        plans.append(SeriesPlan(cand, geom))
    for key in sorted(forced - {c.key for c in candidates}):
        report.series.append(SeriesOutcome(key.hex(), "not_found", "", 0, reason=(
            "forced, but none of its files is among the sources: the stored copy is left unchanged")))
    return plans


def _stored(candidates: list[SeriesCandidate], report: IngestReport) -> tuple[set[str], set[str]]:
    """The sources this run stored (files of the series it wrote, labels) and the keys of those series:
    earlier quarantine records of them are superseded (see :mod:`medload.storage.rejects`)."""
    written = {s.key for s in report.series if s.status in ("ingested", "replaced")}
    files = {h.ref.display for c in candidates if c.key.hex() in written for h in c.headers}
    return files | {o.source for o in report.labels if o.status == "ingested"}, written


def _series_record(cand: SeriesCandidate, status: str, stage: str, reason: str) -> RejectRecord:
    """Quarantine record of a whole candidate volume, listing its files."""
    sources = tuple(sorted({h.ref.display for h in cand.headers}))
    return RejectRecord(status, stage, reason, f"series {cand.key.hex()[:12]} ({len(cand.headers)} planes)",
                        series=cand.key.hex(), sources=sources)


def _as_the_store_names(root: Path, names: tuple[str, ...]) -> tuple[str, ...]:
    """The windows ``names`` as the store at ``root`` spells them: one it holds under an earlier medload's name
    (``"8/32"`` for ``W8/L32``, :func:`medload.windows.stored_name`) keeps that name, so that its planes go
    on into the same sub-databases; a store that cannot be read is the writer's to report."""
    if not manifest_path(root).is_file():
        return names
    try:
        held = read_manifest(root).windows
    except MedloadError:
        return names
    return tuple(win.stored_name(name, held) or name for name in names)
