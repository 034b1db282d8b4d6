"""A small DICOMweb client: QIDO-RS searches, WADO-RS retrieval of single instances and the POST that
STOW-RS stores with (:mod:`medload.writeback.pacs`), over httpx.

- Series search: ``GET {root}/series?{query}`` with study- and series-level matching keys
  (PS3.18 §10.6, Search Transaction); instances of a series: ``GET .../series/{uid}/instances``, of
  which only those of SOP classes medload ingests are retrieved (:func:`retrievable`, shared with DIMSE).
  Responses are the DICOM JSON model (PS3.18 Annex F). Results are read in pages (``limit``/``offset``).
- Instance retrieval: ``GET .../instances/{uid}`` accepting ``multipart/related;
  type="application/dicom"; transfer-syntax=*`` (PS3.18 §10.4, Retrieve Transaction): the instance as
  stored, streamed to a file (see :mod:`medload.pacs.multipart`).

Transient failures (connection errors, timeouts, HTTP 429/502/503/504) are retried with exponential
backoff, honouring ``Retry-After``; HTTP 500 is not (a server's error for one instance tends to stay).
A refused login (401/403) or a server that cannot be reached stops the run; any other failure of one
instance is that instance's problem (:class:`~medload.errors.InputProblem`, stage ``retrieve``).
Request URLs carry raw UIDs, so httpx's own request log is kept below INFO.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import BinaryIO, TypeVar
from urllib.parse import parse_qsl

from pydicom.datadict import tag_for_keyword
from pydicom.uid import UID

from medload.errors import ConfigError, InputProblem, RemoteSourceError
from medload.extras import require
from medload.ingest.headers import VOLUME_SOP_CLASSES
from medload.ingest.labels import LABEL_SOP_CLASSES
from medload.pacs.endpoint import Credentials, Endpoint
from medload.pacs.multipart import boundary_of, write_single_part
from medload.version import __version__

require("httpx", "dicomweb", "A dicomweb:// PACS (QIDO-RS, WADO-RS, STOW-RS)")
import httpx  # noqa: E402

__all__ = ["DicomWebClient", "RetryPolicy", "SeriesRef", "InstanceRef", "RETRIEVED_SOP_CLASSES", "retrievable",
           "parse_query"]

log = logging.getLogger(__name__)
for _name in ("httpx", "httpcore"):  # their INFO/DEBUG lines print request URLs, which hold raw UIDs
    logging.getLogger(_name).setLevel(logging.WARNING)

_ACCEPT_DICOM = 'multipart/related; type="application/dicom"; transfer-syntax=*'
_ACCEPT_JSON = "application/dicom+json, application/json"
_TRANSIENT = frozenset({429, 502, 503, 504})
_UID = re.compile(r"[0-9]+(\.[0-9]+)*")
_TAG = re.compile(r"[0-9A-Fa-f]{8}")
_RESERVED = frozenset({"limit", "offset", "includefield"})
_PAGE = 1000
_CHUNK = 1 << 16
_T = TypeVar("_T")
# DICOM JSON model keys (PS3.18 F.2): the tags the searches read.
STUDY_UID, SERIES_UID, INSTANCE_UID = "0020000D", "0020000E", "00080018"
MODALITY, SERIES_NUMBER, INSTANCE_NUMBER, SOP_CLASS = "00080060", "00200011", "00200013", "00080016"
#: SOP classes medload retrieves: the volume images it stacks, and the labels it places on them.
RETRIEVED_SOP_CLASSES = (*VOLUME_SOP_CLASSES, *LABEL_SOP_CLASSES)


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all; the k-th wait is ``backoff * 2**k`` seconds (with jitter), or the
    server's ``Retry-After``, capped at ``max_wait``."""

    attempts: int = 4
    backoff: float = 0.5
    max_wait: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff < 0 or self.max_wait < 0:
            raise ConfigError(f"retry policy {self}: attempts must be at least 1, waits non-negative")

    def wait(self, attempt: int, retry_after: str | None) -> float:
        if retry_after is not None and retry_after.strip().isdigit():
            return min(float(retry_after), self.max_wait)
        return min(self.backoff * 2**attempt * random.uniform(0.8, 1.2), self.max_wait)


@dataclass(frozen=True)
class SeriesRef:
    """A series found by the search: its UIDs (raw: they never leave this process), Modality (0008,0060)
    and SeriesNumber (0020,0011)."""

    study: str
    series: str
    modality: str
    number: int | None


@dataclass(frozen=True)
class InstanceRef:
    """An instance of a series: SOPInstanceUID (0008,0018), InstanceNumber (0020,0013) and SOPClassUID
    (0008,0016; "" where the server did not say)."""

    uid: str
    number: int | None
    sop_class: str = ""


def retrievable(series: SeriesRef, instances: Iterable[InstanceRef]) -> list[InstanceRef]:
    """The instances worth retrieving, in InstanceNumber order: those of a SOP class medload ingests, or
    of an unknown one. A series with none (secondary captures, reports, dose SRs) is an InputProblem
    (skipped): nothing of it is downloaded, on the first run or any rerun.

    Examples:
        >>> retrievable(ref, [InstanceRef("1.2.3", 1, "1.2.840.10008.5.1.4.1.1.2")])   # doctest: +SKIP
        [InstanceRef(uid='1.2.3', number=1, sop_class='1.2.840.10008.5.1.4.1.1.2')]
    """
    found, other = [], {}
    for inst in instances:
        if inst.sop_class and inst.sop_class not in RETRIEVED_SOP_CLASSES:
            other[inst.uid] = inst.sop_class
        else:
            found.append(inst)
    if other:
        names = ", ".join(sorted({f"{UID(c).name} ({c})" for c in other.values()}))
        reason = f"{len(other)} instance(s) of {names}: not a CT/MR/PET volume, SEG or RTSTRUCT, not retrieved"
        if not found:
            raise InputProblem("retrieve", reason, skipped=True)
        log.info("series number %s: %s", series.number, reason)
    return sorted(found, key=lambda i: (i.number is None, i.number or 0, i.uid))


def parse_query(text: str) -> dict[str, str]:
    """QIDO-RS matching keys (PS3.18 §8.3.4) from ``"Modality=CT&StudyDate=20150101-20151231"``: attribute
    keywords or 8-digit tags, each once; ``limit``, ``offset`` and ``includefield`` are medload's own."""
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=True) if text else []
    except ValueError:
        raise ConfigError(f"--query {text!r}: write KEY=VALUE pairs joined by &, e.g. 'Modality=CT&StudyDate=2015'") \
            from None
    query: dict[str, str] = {}
    for key, value in pairs:
        if key in _RESERVED:
            raise ConfigError(f"--query: {key} is set by medload itself; leave it out")
        if key != "fuzzymatching" and tag_for_keyword(key) is None and not _TAG.fullmatch(key):
            raise ConfigError(f"--query: {key!r} is not a DICOM attribute keyword (e.g. StudyDate, Modality) or tag "
                              "(e.g. 00080060)")
        if key in query:
            raise ConfigError(f"--query: {key} is given twice; give it once (a range is FROM-TO, a list A\\B)")
        query[key] = value
    return query


class _StatusError(RemoteSourceError):
    """A search answered with an unexpected HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _Transient(Exception):
    """One attempt failed in a way worth retrying; ``unreachable``: no connection could be made at all."""

    def __init__(self, reason: str, retry_after: str | None = None, *, unreachable: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.retry_after, self.unreachable = reason, retry_after, unreachable


class DicomWebClient:
    """One connection pool to a DICOMweb service root, shared by the retrieval threads (httpx's
    ``Client`` may be shared between threads); ``connections`` bounds the requests in flight."""

    def __init__(self, endpoint: Endpoint, credentials: Credentials | None, *, verify=True, connections: int = 8,
                 timeout: float = 60.0, retry: RetryPolicy = RetryPolicy()) -> None:
        self.endpoint, self.retry = endpoint, retry
        self._anonymous = credentials is None
        auth = None if credentials is None else (
            httpx.BasicAuth(credentials.user, credentials.secret) if credentials.user is not None
            else _BearerAuth(credentials.secret))
        self._http = httpx.Client(auth=auth, verify=verify, follow_redirects=False,
                                  timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                  limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
                                  headers={"User-Agent": f"medload/{__version__}"})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> DicomWebClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- QIDO-RS -------------------------------------------------------------------------------
    def search_series(self, query: dict[str, str]) -> list[SeriesRef]:
        """Series matching ``query`` (study- and series-level keys), in study, SeriesNumber, UID order."""
        found = {}
        for item in self._search("/series", query, (STUDY_UID, SERIES_UID, MODALITY, SERIES_NUMBER), "series search"):
            study, series = _uid(item, STUDY_UID), _uid(item, SERIES_UID)
            if study is None or series is None:
                log.warning("the series search returned an entry without valid Study/SeriesInstanceUIDs; ignored")
                continue
            found[series] = SeriesRef(study, series, _text(item, MODALITY) or "", _int(item, SERIES_NUMBER))
        return sorted(found.values(), key=lambda s: (s.study, s.number is None, s.number or 0, s.series))

    def search_instances(self, series: SeriesRef) -> list[InstanceRef]:
        """Instances of ``series``, in InstanceNumber order (each SOPInstanceUID once)."""
        found = {}
        try:
            for item in self._search(f"/studies/{series.study}/series/{series.series}/instances", {},
                                     (INSTANCE_UID, INSTANCE_NUMBER, SOP_CLASS), "instance search"):
                uid = _uid(item, INSTANCE_UID)
                if uid is None:
                    raise InputProblem("retrieve", "the instance search returned an entry without a valid SOPInstanceUID")
                found[uid] = InstanceRef(uid, _int(item, INSTANCE_NUMBER), _uid(item, SOP_CLASS) or "")
        except _StatusError as exc:
            if exc.status in (401, 403):
                raise
            raise InputProblem("retrieve", f"instance search failed with HTTP {exc.status}") from None
        return retrievable(series, found.values())

    def _search(self, path: str, query: dict[str, str], fields: tuple[str, ...], what: str) -> Iterator[dict]:
        """Every result of a QIDO-RS search, read in pages of ``_PAGE``; stops when a page adds nothing new
        (a server that ignores ``offset``)."""
        seen: set[str] = set()
        offset = 0
        while True:
            params = [*query.items(), *(("includefield", f) for f in fields), ("limit", str(_PAGE)),
                      ("offset", str(offset))]
            page = self._with_retries(partial(self._get_json, path, params, what), what)
            fresh = [item for item in page if _key(item) not in seen]
            seen.update(_key(item) for item in fresh)
            yield from fresh
            if len(page) < _PAGE or not fresh:
                return
            offset += len(page)

    def _get_json(self, path: str, params: list[tuple[str, str]], what: str) -> list[dict]:
        with self._open(path, params, _ACCEPT_JSON) as response:
            if response.status_code == 204:  # no match (PS3.18 §10.6.3.2)
                return []
            if response.status_code != 200:
                raise _StatusError(self._status_message(response, what), response.status_code)
            try:
                body = response.read()
            except httpx.TransportError as exc:
                raise _Transient(f"{what} response broke off: {_describe(exc)}") from None
        try:
            doc = json.loads(body) if body.strip() else []
        except ValueError:
            doc = None
        if not isinstance(doc, list) or not all(isinstance(item, dict) for item in doc):
            raise RemoteSourceError(f"{self.endpoint.base}: the {what} did not answer a DICOM JSON array "
                                    "(PS3.18 Annex F): is the URL the DICOMweb root (e.g. .../dicom-web)?")
        return doc

    # ---- WADO-RS -------------------------------------------------------------------------------
    def retrieve_instance(self, series: SeriesRef, instance: InstanceRef, out: BinaryIO, max_bytes: int) -> int:
        """Stream ``instance`` (as stored: ``transfer-syntax=*``) into ``out``; its size in bytes.

        InputProblem (stage ``retrieve``) when the server cannot deliver it; RemoteSourceError when the
        server refuses the credentials or cannot be reached at all.
        """
        path = f"/studies/{series.study}/series/{series.series}/instances/{instance.uid}"

        def attempt() -> int:
            out.seek(0)
            out.truncate()
            with self._open(path, [], _ACCEPT_DICOM, identity=True) as response:
                if response.status_code in (401, 403):
                    raise _StatusError(self._status_message(response, "instance retrieval"), response.status_code)
                if response.status_code != 200:
                    raise InputProblem("retrieve", f"HTTP {response.status_code} {response.reason_phrase}")
                boundary = boundary_of(response.headers.get("content-type", ""))
                try:
                    return write_single_part(response.iter_bytes(_CHUNK), boundary, out, max_bytes)
                except httpx.TransportError as exc:
                    raise _Transient(f"transfer broke off: {_describe(exc)}") from None

        return self._with_retries(attempt, "instance retrieval", InputProblem)

    # ---- writes (STOW-RS) ---------------------------------------------------------------------
    def post(self, path: str, content: bytes, headers: dict[str, str], what: str,
             accepted: frozenset[int]) -> httpx.Response:
        """POST ``content`` to ``path`` under the service root, retried on transport errors and transient
        statuses as searches are (for idempotent writes only, such as STOW-RS: a PACS keeps one instance per
        SOPInstanceUID); a RemoteSourceError saying what to do on a status outside ``accepted``."""
        def attempt() -> httpx.Response:
            try:
                response = self._http.post(self.endpoint.base + path, content=content, headers=headers)
            except httpx.TransportError as exc:
                raise _Transient(_describe(exc), unreachable=isinstance(exc, httpx.ConnectError)) from None
            _raise_if_transient(response)
            return response

        response = self._with_retries(attempt, what)
        if response.status_code not in accepted:
            raise RemoteSourceError(self._status_message(response, what))
        return response

    # ---- plumbing ------------------------------------------------------------------------------
    @contextmanager
    def _open(self, path: str, params: list[tuple[str, str]], accept: str, *,
              identity: bool = False) -> Iterator[httpx.Response]:
        """One request, its response streamed and closed after use; transient statuses and transport
        errors become ``_Transient``. ``identity``: no gzip (for instances, which are mostly
        compressed or incompressible pixels: gzip costs the server far more than it saves on a LAN,
        docs/benchmarks.md, "Design measurements")."""
        headers = {"Accept": accept, **({"Accept-Encoding": "identity"} if identity else {})}
        request = self._http.build_request("GET", self.endpoint.base + path, params=tuple(params), headers=headers)
        try:
            response = self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc):
                raise RemoteSourceError(
                    f"{self.endpoint.base}: the server's TLS certificate is not trusted ({_describe(exc)}): give the "
                    "CA that signed it (or the server's own certificate) with --ca-bundle FILE") from None
            raise _Transient(_describe(exc), unreachable=isinstance(exc, httpx.ConnectError)) from None
        _raise_if_transient(response)
        try:
            yield response
        finally:
            response.close()

    def _with_retries(self, attempt: Callable[[], _T], what: str,
                      final: Callable[[str, str], Exception] | None = None) -> _T:
        """``attempt()`` until it succeeds or the retries are spent; then ``final(stage, reason)`` (an
        InputProblem for one instance), or a RemoteSourceError saying the server cannot be used -- always
        when it cannot be reached at all, which no later instance would change."""
        for k in range(self.retry.attempts):
            try:
                return attempt()
            except _Transient as exc:
                failure = exc
                if k + 1 < self.retry.attempts:
                    wait = self.retry.wait(k, exc.retry_after)
                    log.info("%s: %s; retrying in %.1f s (%d of %d)", what, exc.reason, wait, k + 2, self.retry.attempts)
                    time.sleep(wait)
        reason = f"{failure.reason} (after {self.retry.attempts} attempts)"
        if final is not None and not failure.unreachable:
            raise final("retrieve", reason)
        raise RemoteSourceError(f"cannot use {self.endpoint.base} for the {what}: {reason}: check the host and port, "
                                "that the server runs and is reachable from here (proxy, firewall), and retry later")

    def _status_message(self, response: httpx.Response, what: str) -> str:
        """What an unexpected status means for the whole run, and what to do (no response body: it may
        echo identifiers)."""
        status, base = response.status_code, self.endpoint.base
        if status == 401 and self._anonymous:
            return (f"{base} requires credentials (HTTP 401 on the {what}): use --credentials FILE (mode 0600) or "
                    "MEDLOAD_DICOMWEB_USER/MEDLOAD_DICOMWEB_PASSWORD or MEDLOAD_DICOMWEB_TOKEN")
        if status == 401:
            return (f"{base} refused the credentials (HTTP 401 on the {what}): check the user name and password "
                    "(or token) in the credentials file or environment")
        if status == 403:
            return f"{base} denied access (HTTP 403 on the {what}): the account lacks the right to query or retrieve"
        if status == 404:
            return f"{base}: no DICOMweb service there (HTTP 404 on the {what}): check the path, e.g. /dicom-web"
        if 300 <= status < 400:
            return (f"{base} redirects the {what} (HTTP {status}) to {response.headers.get('location', '?')}: "
                    "give the address it redirects to")
        hint = "check the server's log" if status >= 500 else "check --query"
        return f"{base} failed the {what}: HTTP {status} {response.reason_phrase}: {hint}"


class _BearerAuth(httpx.Auth):
    """``Authorization: Bearer <token>`` (RFC 6750) on every request."""

    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token}"

    def auth_flow(self, request: httpx.Request):
        request.headers["Authorization"] = self._header
        yield request


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _raise_if_transient(response: httpx.Response) -> None:
    """``_Transient`` (the response closed) for a status worth retrying: HTTP 429/502/503/504."""
    if response.status_code in _TRANSIENT:
        response.close()
        raise _Transient(f"HTTP {response.status_code} {response.reason_phrase}", response.headers.get("retry-after"))


def json_values(item: dict, tag: str) -> list:
    """The ``Value`` list of ``tag`` in a DICOM JSON object (PS3.18 Annex F), empty if absent."""
    attr = item.get(tag)
    return attr.get("Value", []) if isinstance(attr, dict) else []


def _text(item: dict, tag: str) -> str | None:
    values = json_values(item, tag)
    return str(values[0]).strip() if values and values[0] is not None else None


def valid_uid(value: str | None) -> str | None:
    """``value`` if it is a valid UID (PS3.5 §9.1: digits and dots, at most 64 characters), else None: UIDs
    from a PACS go into request paths and file names. Shared by the DICOMweb and DIMSE clients."""
    return value if value and len(value) <= 64 and _UID.fullmatch(value) else None


def _uid(item: dict, tag: str) -> str | None:
    return valid_uid(_text(item, tag))


def _int(item: dict, tag: str) -> int | None:
    value = _text(item, tag)
    try:
        return int(float(value)) if value else None
    except ValueError:
        return None


def _key(item: dict) -> str:
    return f"{_text(item, SERIES_UID)}/{_text(item, INSTANCE_UID)}"
