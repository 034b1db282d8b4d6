"""``ingest`` from a DICOMweb server (PS3.18): search, skip what the store holds, retrieve, ingest.

1. One QIDO-RS series search with the user's matching keys.
2. Resume: a series whose keyed pseudonym of SeriesInstanceUID (0020,000E) -- computed exactly as the
   header pass does, :meth:`~medload.ingest.deid.Pseudonymizer.uid` -- is in a stored record is not
   retrieved again (reported ``present``). Series with nothing stored (new, skipped, rejected, or cut
   off by a kill) are retrieved.
3. Series are taken in batches of about ``spool_instances`` instances (a larger series is one batch).
   A batch's instances are retrieved by ``connections`` threads, each streaming one instance into its own
   0600 file ``<store>/staging/dicomweb/<instance pseudonym>.dcm``; then the batch goes through the same
   :func:`medload.ingest.ingest` as files do, and its files are deleted. Disk use is therefore bounded by
   one batch (``max(spool_instances, largest series)`` instances), memory by ``connections`` chunks.
   The retrieval threads have all ended before ``ingest`` forks its decoding workers.
4. An instance the server cannot deliver (after retries of transient errors) is quarantined with stage
   ``retrieve``; its whole series is then rejected as incomplete and its other files are deleted before
   ingest, so no series is ever stored short of an instance.

Messages and quarantine records name instances by URL with the UIDs replaced by their keyed pseudonyms
(``.../studies/<p>/series/<p>/instances/<p>``) plus SeriesNumber and InstanceNumber, never by raw UIDs.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from medload import windows as win
from medload.config import IngestConfig
from medload.errors import ConfigError, InputProblem, StoreError, StoreLockedError
from medload.ingest.deid import Pseudonymizer, load_key
from medload.ingest.report import IngestReport, SeriesOutcome
from medload.ingest.run import ingest
from medload.pacs.dicomweb import DicomWebClient, InstanceRef, RetryPolicy, SeriesRef, parse_query
from medload.pacs.endpoint import load_credentials, parse_endpoint, tls_context
from medload.progress import progress_bar
from medload.storage.records import RejectRecord
from medload.storage.store import open_store
from medload.storage.writer import StoreWriter

__all__ = ["RetrieveOptions", "ingest_dicomweb"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetrieveOptions:
    """How instances are retrieved: ``connections`` in flight, about ``spool_instances`` on disk at once,
    each at most ``max_instance_bytes``; ``timeout`` seconds without data fails an attempt."""

    connections: int = 8
    spool_instances: int = 1000
    max_instance_bytes: int = 2 << 30
    timeout: float = 60.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if min(self.connections, self.spool_instances, self.max_instance_bytes) < 1 or self.timeout <= 0:
            raise ConfigError(f"connections ({self.connections}), spool instances ({self.spool_instances}), the "
                              "instance size cap and the timeout must be positive")


def ingest_dicomweb(url: str, store: str | Path, *, query: str = "", credentials: str | Path | None = None,
                    ca_bundle: str | Path | None = None, config: IngestConfig | None = None,
                    key_file: str | Path | None = None, progress: bool = False,
                    options: RetrieveOptions = RetrieveOptions()) -> IngestReport:
    """Ingest the series a DICOMweb server finds for ``query`` into ``store``; see the module docstring.

    Example:
        >>> report = ingest_dicomweb("dicomweb://pacs:8042/dicom-web", "stores/ct",
        ...                          query="Modality=CT&StudyDate=20150101-20151231",
        ...                          credentials="~/.config/medload/pacs.cred")      # doctest: +SKIP
    """
    endpoint = parse_endpoint(url)
    if ca_bundle is not None and not endpoint.secure:
        raise ConfigError("--ca-bundle applies to dicomwebs:// (TLS) sources only")
    search = parse_query(query)
    creds = load_credentials(None if credentials is None else Path(credentials).expanduser())
    verify = tls_context(None if ca_bundle is None else Path(ca_bundle).expanduser())
    cfg = config or IngestConfig()
    pseudo = Pseudonymizer(load_key(key_file))
    started = time.perf_counter()
    report = IngestReport(store=str(store))
    with DicomWebClient(endpoint, creds, verify=verify, connections=options.connections, timeout=options.timeout,
                        retry=options.retry) as client:
        found = client.search_series(search)
        _writer(store, cfg, pseudo).close()  # the store's key, codec, windows and lock are checked before any download
        todo = _skip_stored(found, Path(store), pseudo, report)
        log.info("%s: %d series found, %d to retrieve", endpoint.base, len(found), len(todo))
        with _Spool(Path(store) / "staging" / "dicomweb") as spool:
            fetcher = _Fetcher(client, pseudo, spool.path, options, report, progress)
            for complete in fetcher.batches(todo):
                if complete:
                    _merge(report, ingest(spool.path, store, config=cfg, key_file=key_file, progress=progress))
                spool.clear()
    retrieve_rejects = [r for r in report.rejects if r.stage == "retrieve"]  # ingest() stored the others
    if retrieve_rejects:
        with _writer(store, cfg, pseudo) as writer:
            writer.put_rejects(retrieve_rejects)
    report.seconds = time.perf_counter() - started
    log.info("retrieved and ingested %d instances (%.1f MB) in %.1f s (%.0f instances/s)", report.files,
             report.bytes / 1e6, report.seconds, report.files_per_second)
    return report


def _writer(store: str | Path, cfg: IngestConfig, pseudo: Pseudonymizer) -> StoreWriter:
    """The store's writer with this run's settings (creates the store, or checks it matches them)."""
    windows = tuple(w.name for w in win.parse_list(",".join(cfg.windows)))
    return StoreWriter(Path(store), codec=cfg.codec, windows=windows, key_fingerprint=pseudo.fingerprint,
                       shard_bytes=cfg.shard_bytes)


def _skip_stored(found: list[SeriesRef], store: Path, pseudo: Pseudonymizer, report: IngestReport) -> list[SeriesRef]:
    """The series not in the store; each stored part of the others is reported ``present``."""
    st = open_store(store, cache=0)
    try:
        stored = defaultdict(list)
        for record in st.series():
            stored[record.series].append(record)
    finally:
        st.close()
    todo = []
    for ref in found:
        records = stored.get(pseudo.uid("series", ref.series))
        if records is None:
            todo.append(ref)
        for r in records or ():
            report.series.append(SeriesOutcome(r.key, "present", r.modality, r.shape[0], r.shape))
    return todo


def _merge(report: IngestReport, part: IngestReport) -> None:
    """Add one batch's ingest report (its files and bytes are counted as retrieved instead)."""
    report.series += part.series
    report.rejects += part.rejects
    report.labels += part.labels
    report.slices_written += part.slices_written


class _Spool:
    """``staging/dicomweb`` of a store (0700), flock-ed so that two DICOMweb ingests of one store do not
    share it; files a killed run left there are deleted on entry."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise StoreLockedError(f"another medload ingest is retrieving into {path.parent.parent} ({path} is "
                                   "locked): wait for it to finish") from None
        self.clear()

    def clear(self) -> None:
        for entry in self.path.iterdir():
            entry.unlink(missing_ok=True)

    def __enter__(self) -> _Spool:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.clear()
        finally:
            os.close(self._fd)


class _Fetcher:
    """Retrieves series batch by batch into the spool, recording what fails."""

    def __init__(self, client: DicomWebClient, pseudo: Pseudonymizer, spool: Path, options: RetrieveOptions,
                 report: IngestReport, progress: bool) -> None:
        self.client, self.pseudo, self.spool, self.options = client, pseudo, spool, options
        self.report, self.progress = report, progress

    def batches(self, todo: list[SeriesRef]) -> Iterator[int]:
        """Retrieve batch after batch into the spool; yield how many series of each arrived complete
        (the caller ingests the spool, then empties it)."""
        batch: list[tuple[SeriesRef, list[InstanceRef]]] = []
        for ref in todo:
            try:
                instances = self.client.search_instances(ref)
            except InputProblem as exc:
                self._reject(ref, 0, exc.reason, ())
                continue
            if not instances:
                self._reject(ref, 0, "the server lists no instance in this series", ())
                continue
            batch.append((ref, instances))
            if sum(len(i) for _, i in batch) >= self.options.spool_instances:
                yield self._retrieve(batch)
                batch = []
        if batch:
            yield self._retrieve(batch)

    def _retrieve(self, batch: list[tuple[SeriesRef, list[InstanceRef]]]) -> int:
        tasks = [(ref, inst) for ref, instances in batch for inst in instances]
        failed: dict[str, list[tuple[InstanceRef, str]]] = defaultdict(list)
        began, size = time.perf_counter(), 0
        with progress_bar("retrieving instances", len(tasks), enabled=self.progress) as advance, \
                ThreadPoolExecutor(self.options.connections, thread_name_prefix="medload-wado") as pool:
            futures = {pool.submit(self._one, ref, inst): (ref, inst) for ref, inst in tasks}
            try:
                for future in as_completed(futures):
                    ref, inst = futures[future]
                    try:
                        size += future.result()
                        self.report.files += 1
                    except InputProblem as exc:
                        failed[ref.series].append((inst, exc.reason))
                    advance(1)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        self.report.bytes += size
        seconds = time.perf_counter() - began
        log.info("retrieved %d instances of %d series (%.1f MB) in %.1f s", len(tasks) - sum(map(len, failed.values())),
                 len(batch), size / 1e6, seconds)
        for ref, instances in batch:
            if ref.series in failed:
                for inst in instances:
                    self._path(inst).unlink(missing_ok=True)
                self._reject_incomplete(ref, instances, failed[ref.series])
        return sum(1 for ref, _ in batch if ref.series not in failed)

    def _one(self, ref: SeriesRef, inst: InstanceRef) -> int:
        """Retrieve one instance into its spool file (removed again if anything fails)."""
        path = self._path(inst)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise InputProblem("retrieve", "the same SOPInstanceUID is listed twice in this batch") from None
        except OSError as exc:
            raise StoreError(f"cannot create a spool file in {self.spool}: {exc.strerror}") from None
        try:
            with open(fd, "w+b") as out:
                return self.client.retrieve_instance(ref, inst, out, self.options.max_instance_bytes)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise StoreError(f"cannot write a spool file in {self.spool}: {exc.strerror}: free space there (one batch "
                             f"of about {self.options.spool_instances} instances is spooled at a time)") from None
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def _path(self, inst: InstanceRef) -> Path:
        return self.spool / f"{self.pseudo.uid('instance', inst.uid)}.dcm"

    def _url(self, ref: SeriesRef, inst: InstanceRef | None = None) -> str:
        """The resource URL with pseudonyms in place of the UIDs."""
        p = self.pseudo
        url = f"{self.client.endpoint.base}/studies/{p.uid('study', ref.study)}/series/{p.uid('series', ref.series)}"
        return url if inst is None else f"{url}/instances/{p.uid('instance', inst.uid)}"

    def _reject_incomplete(self, ref: SeriesRef, instances: list[InstanceRef],
                           failed: list[tuple[InstanceRef, str]]) -> None:
        failed = sorted(failed, key=lambda f: (f[0].number is None, f[0].number or 0, f[0].uid))
        urls = []
        for inst, reason in failed:
            urls.append(self._url(ref, inst))
            where = f"series number {ref.number}, instance number {inst.number}"
            self.report.rejects.append(RejectRecord("rejected", "retrieve", f"{reason} ({where})", urls[-1]))
            log.warning("cannot retrieve %s (%s): %s", urls[-1], where, reason)
        first = failed[0][1] if len(failed) == 1 else f"{len(failed)} failures, e.g. {failed[0][1]}"
        self._reject(ref, len(instances), f"series incomplete: {len(failed)} of {len(instances)} instance(s) could not "
                     f"be retrieved ({first}; missing: {', '.join(u.rsplit('/', 1)[1] for u in urls)}); nothing of "
                     "it is stored, a rerun retries it", tuple(urls))

    def _reject(self, ref: SeriesRef, planes: int, reason: str, sources: tuple[str, ...]) -> None:
        self.report.rejects.append(RejectRecord("rejected", "retrieve", reason, self._url(ref), sources=sources))
        self.report.series.append(SeriesOutcome(self.pseudo.uid("series", ref.series), "rejected", ref.modality,
                                                planes, reason=reason))
