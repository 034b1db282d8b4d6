"""``ingest`` from a PACS -- DICOMweb (PS3.18) or DIMSE (PS3.4 C-FIND/C-GET): search, skip what the store
holds, retrieve, ingest. Both protocols share everything here; they differ only in their client.

1. One series search with the user's matching keys: QIDO-RS, or a SERIES-level C-FIND
   (:mod:`medload.pacs.dimse`).
2. Resume: a series whose keyed pseudonym of SeriesInstanceUID (0020,000E) -- computed exactly as the
   header pass does, :meth:`~medload.deid.Pseudonymizer.uid` -- is in a stored record is not
   retrieved again (reported ``present``). Series with nothing stored (new, skipped, rejected, or cut
   off by a kill) are retrieved.
3. Series are taken in batches of about ``spool_instances`` instances (a larger series is one batch).
   Each instance of a batch is written into its own 0600 file ``<store>/staging/<dicomweb|dimse>/<instance
   pseudonym>.dcm`` -- over DICOMweb by ``connections`` threads, each streaming one instance (WADO-RS);
   over DIMSE by one C-GET per series -- then the batch goes through the same
   :func:`medload.ingest.ingest` as files do, and its files are deleted. Disk use is therefore bounded by
   one batch (``max(spool_instances, largest series)`` instances). The retrieval threads have all ended
   before ``ingest`` forks its decoding workers.
4. An instance the server cannot deliver (after retries of transient errors; a C-GET with a warning or
   failure status) is quarantined with stage ``retrieve``; its whole series is then rejected as incomplete
   and its other files are deleted before ingest, so no series is ever stored short of an instance.

Messages and quarantine records name instances by URL with the UIDs replaced by their keyed pseudonyms
(``.../studies/<p>/series/<p>/instances/<p>``, after ``http(s)://HOST/ROOT`` or ``dimse://AET@HOST:PORT``)
plus SeriesNumber and InstanceNumber, never by raw UIDs.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from medload.config import IngestConfig
from medload.deid import KeyFile, Pseudonymizer
from medload.errors import ConfigError, DiskFullError, InputProblem, StoreError, StoreLockedError
from medload.ingest.report import IngestReport, SeriesOutcome
from medload.ingest.run import ingest, open_writer
from medload.pacs.dicomweb import DicomWebClient, InstanceRef, RetryPolicy, SeriesRef, parse_query
from medload.pacs.endpoint import check_ae_title, load_credentials, parse_dimse_endpoint, parse_endpoint, tls_context
from medload.progress import progress_bar
from medload.storage.records import RejectRecord
from medload.storage.space import disk_full_is_error
from medload.storage.store import open_store
from medload.storage.store_key import load_store_key

__all__ = ["RetrieveOptions", "ingest_dicomweb", "ingest_dimse", "Spool"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetrieveOptions:
    """How instances are retrieved: ``connections`` in flight (DICOMweb; DIMSE uses one association),
    about ``spool_instances`` on disk at once, each at most ``max_instance_bytes``; ``timeout`` seconds
    without data fails an attempt (DIMSE: an association request or a response); ``retry`` is DICOMweb's
    policy for transient errors (over DIMSE, a rerun retries what failed).

    Examples:
        >>> RetrieveOptions(connections=4, spool_instances=200).spool_instances
        200
    """

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
                    key_file: str | Path | KeyFile | None = None, progress: bool = False,
                    options: RetrieveOptions = RetrieveOptions()) -> IngestReport:
    """Ingest the series a DICOMweb server finds for ``query`` into ``store``; see the module docstring.

    Examples:
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
    pseudo = Pseudonymizer(load_store_key(key_file, store))
    started = time.perf_counter()
    with DicomWebClient(endpoint, creds, verify=verify, connections=options.connections, timeout=options.timeout,
                        retry=options.retry) as client:
        found = client.search_series(search)
        return _ingest_found(WadoRetriever(client, options), found, "dicomweb", store, config or IngestConfig(),
                             pseudo, progress, options, started)


def ingest_dimse(url: str, store: str | Path, *, query: str = "", calling_aet: str = "MEDLOAD",
                 config: IngestConfig | None = None, key_file: str | Path | KeyFile | None = None,
                 progress: bool = False,
                 options: RetrieveOptions = RetrieveOptions()) -> IngestReport:
    """Ingest the series a DICOM application entity finds for ``query`` (C-FIND, Study Root, SERIES level)
    into ``store``, retrieving them by C-GET as ``calling_aet`` (the PACS must know this AE title and let
    it query and retrieve; C-GET needs no inbound port). DIMSE is unencrypted. See the module docstring.

    Examples:
        >>> report = ingest_dimse("dimse://PACS@pacs.example.org:104", "stores/ct",
        ...                       query="Modality=CT&StudyDate=20150101-20151231")  # doctest: +SKIP
    """
    from medload.pacs.dimse import DimseClient  # pynetdicom: the [pacs] extra

    endpoint = parse_dimse_endpoint(url)
    search = parse_query(query)
    calling = check_ae_title(calling_aet, "--calling-aet")
    pseudo = Pseudonymizer(load_store_key(key_file, store))
    started = time.perf_counter()
    with DimseClient(endpoint, calling_aet=calling, timeout=options.timeout,
                     max_instance_bytes=options.max_instance_bytes) as client:
        found = client.search_series(search)
        return _ingest_found(client, found, "dimse", store, config or IngestConfig(), pseudo, progress,
                             options, started)


class _Remote(Protocol):
    """What the fetcher needs of a PACS client: ``base`` names the server in messages (no credentials)."""

    base: str

    def search_instances(self, series: SeriesRef) -> list[InstanceRef]: ...

    def retrieve(self, batch: list[tuple[SeriesRef, list[InstanceRef]]], spool: Spool,
                 advance: Callable[[int], None]) -> dict[str, list[tuple[InstanceRef, str]]]:
        """Write the instances of ``batch`` into ``spool``; those that failed, with why, by SeriesInstanceUID."""


def _ingest_found(remote: _Remote, found: list[SeriesRef], spool_name: str, store: str | Path, cfg: IngestConfig,
                  pseudo: Pseudonymizer, progress: bool, options: RetrieveOptions,
                  started: float) -> IngestReport:
    """Resume, then retrieve and ingest batch after batch, then record the retrieval rejects."""
    report = IngestReport(store=str(store))
    with open_writer(Path(store), cfg, pseudo):  # the store's key, codec, windows and lock, before any download
        pass
    todo = _skip_stored(found, Path(store), pseudo, report)
    log.info("%s: %d series found, %d to retrieve", remote.base, len(found), len(todo))
    with Spool(Path(store) / "staging" / spool_name, pseudo, options.spool_instances) as spool:
        fetcher = _Fetcher(remote, pseudo, spool, report, progress)
        for complete in fetcher.batches(todo):
            if complete:
                _merge(report, ingest(spool.path, store, config=cfg, pseudonymizer=pseudo, progress=progress,
                                      empty_ok=True))  # what a server sent may be no DICOM at all
            spool.clear()
    retrieve_rejects = [r for r in report.rejects if r.stage == "retrieve"]  # ingest() stored the others
    if retrieve_rejects:
        with open_writer(Path(store), cfg, pseudo) as writer, disk_full_is_error(writer.root, "commit",
                                                                                    "writing quarantine records"):
            writer.put_rejects(retrieve_rejects)
    report.seconds = time.perf_counter() - started
    log.info("retrieved and ingested %d instances (%.1f MB) in %.1f s (%.0f instances/s)", report.files,
             report.bytes / 1e6, report.seconds, report.files_per_second)
    return report


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


class Spool:
    """``staging/dicomweb`` (or ``staging/dimse``) of a store (0700), flock-ed so that two ingests from a
    PACS into one store do not share it; files a killed run left there are deleted on entry. Instances
    are written to files named by the keyed pseudonym of their SOPInstanceUID.

    Examples:
        >>> with Spool(Path("stores/ct/staging/dimse"), pseudo, 1000) as spool:    # doctest: +SKIP
        ...     with spool.file(sop_instance_uid) as out:
        ...         out.write(part10_bytes)
    """

    def __init__(self, path: Path, pseudo: Pseudonymizer, batch: int) -> None:
        self.path, self.batch, self._pseudo = path, batch, pseudo
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

    def path_of(self, uid: str) -> Path:
        """The spool file of the instance with SOPInstanceUID ``uid`` (named by its pseudonym)."""
        return self.path / f"{self._pseudo.uid('instance', uid)}.dcm"

    @contextmanager
    def file(self, uid: str) -> Iterator[BinaryIO]:
        """The new 0600 spool file of instance ``uid``, removed again if anything fails while it is written;
        InputProblem if it exists (the instance is listed twice), DiskFullError (stage ``spool``) if the disk
        is full, StoreError if it refuses the file otherwise."""
        path = self.path_of(uid)
        doing = f"spooling instances retrieved from the PACS (one batch of about {self.batch} at a time)"
        try:
            with disk_full_is_error(self.path, "spool", doing):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise InputProblem("retrieve", "the same SOPInstanceUID is listed twice in this batch") from None
        except OSError as exc:
            raise StoreError(f"cannot create a spool file in {self.path}: {exc.strerror}") from None
        try:
            with disk_full_is_error(self.path, "spool", doing), open(fd, "w+b") as out:
                yield out
        except DiskFullError:
            path.unlink(missing_ok=True)
            raise
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise StoreError(f"cannot write a spool file in {self.path}: {exc.strerror}") from None
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def usage(self) -> tuple[int, int]:
        """Files and bytes in the spool."""
        sizes = [entry.stat().st_size for entry in self.path.iterdir()]
        return len(sizes), sum(sizes)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.clear()
        finally:
            os.close(self._fd)


class _Fetcher:
    """Retrieves series batch by batch into the spool, recording what fails."""

    def __init__(self, remote: _Remote, pseudo: Pseudonymizer, spool: Spool, report: IngestReport,
                 progress: bool) -> None:
        self.remote, self.pseudo, self.spool, self.report, self.progress = remote, pseudo, spool, report, progress

    def batches(self, todo: list[SeriesRef]) -> Iterator[int]:
        """Retrieve batch after batch into the spool; yield how many series of each arrived complete
        (the caller ingests the spool, then empties it)."""
        batch: list[tuple[SeriesRef, list[InstanceRef]]] = []
        for ref in todo:
            try:
                instances = self.remote.search_instances(ref)
            except InputProblem as exc:
                self._reject(ref, 0, exc.reason, (), "skipped" if exc.skipped else "rejected")
                continue
            if not instances:
                self._reject(ref, 0, "the server lists no instance in this series", ())
                continue
            batch.append((ref, instances))
            if sum(len(i) for _, i in batch) >= self.spool.batch:
                yield self._retrieve(batch)
                batch = []
        if batch:
            yield self._retrieve(batch)

    def _retrieve(self, batch: list[tuple[SeriesRef, list[InstanceRef]]]) -> int:
        total = sum(len(instances) for _, instances in batch)
        began = time.perf_counter()
        with progress_bar("retrieving instances", total, enabled=self.progress) as advance:
            failed = self.remote.retrieve(batch, self.spool, advance)
        files, size = self.spool.usage()
        self.report.files += files
        self.report.bytes += size
        log.info("retrieved %d instances of %d series (%.1f MB) in %.1f s", files, len(batch), size / 1e6,
                 time.perf_counter() - began)
        for ref, instances in batch:
            if ref.series in failed:
                for inst in instances:
                    self.spool.path_of(inst.uid).unlink(missing_ok=True)
                self._reject_incomplete(ref, instances, failed[ref.series])
        return sum(1 for ref, _ in batch if ref.series not in failed)

    def _url(self, ref: SeriesRef, inst: InstanceRef | None = None) -> str:
        """The resource URL with pseudonyms in place of the UIDs."""
        p = self.pseudo
        url = f"{self.remote.base}/studies/{p.uid('study', ref.study)}/series/{p.uid('series', ref.series)}"
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

    def _reject(self, ref: SeriesRef, planes: int, reason: str, sources: tuple[str, ...],
                status: str = "rejected") -> None:
        self.report.rejects.append(RejectRecord(status, "retrieve", reason, self._url(ref), sources=sources))
        self.report.series.append(SeriesOutcome(self.pseudo.uid("series", ref.series), status, ref.modality,
                                                planes, reason=reason))


class WadoRetriever:
    """DICOMweb retrieval: ``connections`` threads, each streaming one instance (WADO-RS) into the spool."""

    def __init__(self, client: DicomWebClient, options: RetrieveOptions) -> None:
        self.client, self.options, self.base = client, options, client.endpoint.base
        self.search_instances = client.search_instances

    def retrieve(self, batch: list[tuple[SeriesRef, list[InstanceRef]]], spool: Spool,
                 advance: Callable[[int], None]) -> dict[str, list[tuple[InstanceRef, str]]]:
        failed: dict[str, list[tuple[InstanceRef, str]]] = defaultdict(list)
        with ThreadPoolExecutor(self.options.connections, thread_name_prefix="medload-wado") as pool:
            futures = {pool.submit(self._one, ref, inst, spool): (ref, inst)
                       for ref, instances in batch for inst in instances}
            try:
                for future in as_completed(futures):
                    ref, inst = futures[future]
                    try:
                        future.result()
                    except InputProblem as exc:
                        failed[ref.series].append((inst, exc.reason))
                    advance(1)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return failed

    def _one(self, ref: SeriesRef, inst: InstanceRef, spool: Spool) -> None:
        with spool.file(inst.uid) as out:
            self.client.retrieve_instance(ref, inst, out, self.options.max_instance_bytes)
