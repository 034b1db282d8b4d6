"""One connection to a PACS for writing back: search and retrieve (as ingest does), and store.

- ``dicomweb://`` / ``dicomwebs://``: QIDO-RS and WADO-RS through :class:`~medload.pacs.dicomweb.DicomWebClient`;
  instances are stored with STOW-RS (PS3.18 §10.5, Store Transaction): one ``POST {root}/studies`` of
  ``multipart/related; type="application/dicom"``, answered by a DICOM JSON Store Instances Response whose
  Referenced SOP Sequence (0008,1199) lists what was stored and Failed SOP Sequence (0008,1198) what was not
  (PS3.18 §10.5.3).
- ``dimse://``: C-FIND and C-GET through :class:`~medload.pacs.dimse.DimseClient`; instances are stored by
  C-STORE (PS3.4 Annex B) on an association of their own, proposing each SOP class with the uncompressed
  transfer syntaxes. The PACS must let medload's AE title store.

Messages never name an instance by its UIDs (they are identifiers); they count instances instead.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from pydicom import Dataset
from pydicom.filebase import DicomBytesIO

from medload.errors import ConfigError, RemoteSourceError
from medload.pacs.dicomweb import DicomWebClient, InstanceRef, SeriesRef, json_values
from medload.pacs.endpoint import (
    is_dicomweb_url,
    is_dimse_url,
    load_credentials,
    parse_dimse_endpoint,
    parse_endpoint,
    tls_context,
)
from medload.pacs.ingest import RetrieveOptions, WadoRetriever

if TYPE_CHECKING:
    from medload.pacs.dimse import DimseClient

__all__ = ["PacsConnection", "connect"]

_STOW = "store (STOW-RS)"
# DICOM JSON keys of the Store Instances Response (PS3.18 §10.5.3.1)
_REFERENCED_SOP, _FAILED_SOP, _INSTANCE_UID, _FAILURE_REASON = "00081199", "00081198", "00081155", "00081197"


class PacsConnection:
    """A PACS opened by :func:`connect`: ``base`` names it in messages (no credentials); ``search_instances``
    and ``retrieve`` are those of ingest (:mod:`medload.pacs.ingest`); :meth:`search_series` remembers its
    answers for the connection's life (writing back a validation set searches the PACS once, not once
    per series); :meth:`send` stores instances. Use it as a context manager (or :meth:`close` it)."""

    def __init__(self, base: str, client: DicomWebClient | DimseClient,
                 retrieve: Callable[..., dict[str, list[tuple[InstanceRef, str]]]],
                 send: Callable[[list[Dataset]], None]) -> None:
        self.base, self._client, self._send = base, client, send
        self.search_instances: Callable[[SeriesRef], list[InstanceRef]] = client.search_instances
        self.retrieve = retrieve
        self._searches: dict[tuple[tuple[str, str], ...], list[SeriesRef]] = {}

    def search_series(self, query: dict[str, str]) -> list[SeriesRef]:
        """The series matching ``query`` (QIDO-RS or C-FIND), searched once per query and connection."""
        key = tuple(sorted(query.items()))
        if key not in self._searches:
            self._searches[key] = self._client.search_series(query)
        return self._searches[key]

    def send(self, datasets: Sequence[Dataset]) -> None:
        """Store ``datasets`` (DICOM instances with file meta) in the PACS; RemoteSourceError if any is refused."""
        self._send(list(datasets))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PacsConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(url: str, *, credentials: str | Path | None = None, ca_bundle: str | Path | None = None,
            calling_aet: str = "MEDLOAD", timeout: float = 60.0) -> PacsConnection:
    """Open the PACS at ``url``: ``dicomweb://HOST:PORT/PATH`` (``dicomwebs://`` for TLS; credentials as for
    ``medload ingest``: a 0600 file, else the MEDLOAD_DICOMWEB_* variables) or ``dimse://AET@HOST:PORT``
    (medload calls itself ``calling_aet``; plain DIMSE is unencrypted).

    Example:
        >>> with connect("dicomweb://pacs:8042/dicom-web", credentials="~/.config/medload/pacs.cred") as pacs:
        ...     pacs.send([seg])                                                    # doctest: +SKIP
    """
    options = RetrieveOptions(timeout=timeout)
    if is_dimse_url(url):
        if credentials is not None or ca_bundle is not None:
            raise ConfigError("--credentials and --ca-bundle apply to dicomweb:// PACS: a DIMSE PACS authorises medload "
                              "by its AE title (--calling-aet) and host")
        from medload.writeback.dimse_store import DimseStoreClient  # pynetdicom: the [pacs] extra

        dimse = DimseStoreClient(parse_dimse_endpoint(url), calling_aet=calling_aet, timeout=timeout)
        return PacsConnection(dimse.base, dimse, dimse.retrieve, dimse.store)
    if not is_dicomweb_url(url):
        raise ConfigError(f"{url!r} is not a PACS: write dicomweb://HOST:PORT/PATH (dicomwebs:// for TLS) or "
                          "dimse://CALLED_AET@HOST:PORT")
    endpoint = parse_endpoint(url)
    if ca_bundle is not None and not endpoint.secure:
        raise ConfigError("--ca-bundle applies to dicomwebs:// (TLS) PACS only")
    creds = load_credentials(None if credentials is None else Path(credentials).expanduser())
    verify = tls_context(None if ca_bundle is None else Path(ca_bundle).expanduser())
    web = DicomWebClient(endpoint, creds, verify=verify, connections=options.connections, timeout=timeout,
                         retry=options.retry)
    return PacsConnection(endpoint.base, web, WadoRetriever(web, options).retrieve, partial(_stow, web))


def _part10(ds: Dataset) -> bytes:
    """``ds`` as a DICOM Part 10 file (preamble, file meta, dataset in its transfer syntax)."""
    buffer = DicomBytesIO()
    ds.save_as(buffer, enforce_file_format=True)
    return buffer.getvalue()


def _stow(client: DicomWebClient, datasets: Sequence[Dataset]) -> None:
    """Store ``datasets`` with one STOW-RS request (PS3.18 §10.5), retried as searches are (storing an
    instance twice is harmless); a RemoteSourceError naming what the server did not store, and why."""
    boundary = secrets.token_hex(16)
    body = b"".join(b"--" + boundary.encode() + b"\r\nContent-Type: application/dicom\r\n\r\n" + _part10(ds)
                    + b"\r\n" for ds in datasets) + f"--{boundary}--\r\n".encode()
    headers = {"Content-Type": f'multipart/related; type="application/dicom"; boundary={boundary}',
               "Accept": "application/dicom+json, application/json"}
    response = client.post("/studies", body, headers, _STOW, frozenset({200, 202, 409}))
    base = client.endpoint.base
    try:
        doc = response.json() if response.content.strip() else {}
    except ValueError:
        doc = None
    if isinstance(doc, list) and len(doc) == 1:
        doc = doc[0]
    if not isinstance(doc, dict):
        raise RemoteSourceError(f"{base}: the {_STOW} did not answer a DICOM JSON Store Instances "
                                f"Response (HTTP {response.status_code}): check the server's log")
    stored = {str(v) for item in _items(doc, _REFERENCED_SOP) for v in json_values(item, _INSTANCE_UID)}
    reasons = sorted({f"0x{int(v):04X}" for item in _items(doc, _FAILED_SOP) for v in json_values(item, _FAILURE_REASON)})
    missing = [ds for ds in datasets if str(ds.SOPInstanceUID) not in stored]
    if missing or response.status_code == 409:
        why = f"failure reason(s) {', '.join(reasons)} (PS3.18 Table 10.5.3-1)" if reasons else "no reason given"
        raise RemoteSourceError(f"{base} did not store {len(missing)} of {len(datasets)} instance(s) "
                                f"(HTTP {response.status_code}; {why}): check that the account may store "
                                "(STOW-RS) and that the server accepts the SOP class, and its log")


def _items(doc: dict, tag: str) -> list[dict]:
    return [item for item in json_values(doc, tag) if isinstance(item, dict)]
