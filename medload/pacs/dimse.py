"""A small DIMSE client (pynetdicom): C-FIND to search, C-GET to retrieve whole series into the spool.

- Series search: C-FIND at SERIES level of the Study Root Query/Retrieve Information Model (PS3.4 C.6.2)
  with the user's matching keys; relational queries (PS3.4 C.4.1.2.2.2, a series search without a study
  UID) are proposed by SOP Class Extended Negotiation (PS3.4 C.5.1.1).
- Instances of a series: C-FIND at IMAGE level, returning SOPInstanceUID (0008,0018), InstanceNumber
  (0020,0013) and SOPClassUID (0008,0016). Instances of SOP classes medload does not ingest (the volume
  classes of :data:`~medload.ingest.headers.VOLUME_SOP_CLASSES`, SEG and RTSTRUCT) are not retrieved.
- Retrieval: one C-GET per series (PS3.4 C.4.3). The PACS sends the instances back as C-STORE
  sub-operations on the same association, so medload needs no inbound port: it proposes storage
  presentation contexts with the SCP role (PS3.7 D.3.3.4) for each ingested SOP class, one context per
  transfer syntax pydicom can decode (uncompressed first, then lossless, then lossy, up to the 128
  contexts an association may hold). Each instance is written as received (file meta + dataset, not
  decoded) into its spool file. An instance listed by the search that does not arrive -- warning or
  failure status, failed sub-operations, the association breaking off -- is reported failed with the
  C-GET status, so that its series is quarantined as incomplete.

Plain DIMSE is unencrypted: identifiers and pixels cross the network in clear. Use it inside a trusted
network (or a VPN/TLS tunnel); DICOMweb over ``dicomwebs://`` is the encrypted alternative.
pynetdicom's own log dumps identifiers (raw UIDs) at DEBUG and repeats rejections at ERROR, so it is
kept to CRITICAL; medload's messages say what happened.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydicom.datadict import dictionary_VR, tag_for_keyword
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset
from pydicom.pixels import get_decoder
from pydicom.tag import Tag
from pydicom.uid import (
    HTJ2K,
    JPEG2000,
    UID,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    HTJ2KLossless,
    HTJ2KLosslessRPCL,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEGLSNearLossless,
    RLELossless,
)

from medload.errors import ConfigError, InputProblem, RemoteSourceError, StoreError
from medload.extras import require
from medload.pacs.dicomweb import (  # one UID rule and one choice of instances for both protocols
    RETRIEVED_SOP_CLASSES,
    InstanceRef,
    SeriesRef,
    retrievable,
    valid_uid,
)
from medload.pacs.endpoint import DimseEndpoint, check_ae_title
from medload.version import __version__

require("pynetdicom", "pacs", "A dimse:// PACS (C-FIND, C-GET, C-STORE)")
from pynetdicom import AE, build_context, build_role, evt  # noqa: E402
from pynetdicom.association import Association  # noqa: E402
from pynetdicom.pdu_primitives import SOPClassExtendedNegotiation  # noqa: E402

# pynetdicom generates its SOP classes into sop_class's globals() at import: they exist at runtime, not to mypy
from pynetdicom.sop_class import (  # type: ignore[attr-defined]  # noqa: E402
    StudyRootQueryRetrieveInformationModelFind as FIND_MODEL,
)
from pynetdicom.sop_class import (  # type: ignore[attr-defined]  # noqa: E402
    StudyRootQueryRetrieveInformationModelGet as GET_MODEL,
)
from pynetdicom.status import QR_GET_SERVICE_CLASS_STATUS, code_to_category  # noqa: E402

if TYPE_CHECKING:
    from pynetdicom.pdu_primitives import _UI  # the user-information items AE.associate(ext_neg=...) takes

    from medload.pacs.ingest import Spool

__all__ = ["DimseClient", "storage_contexts"]

log = logging.getLogger(__name__)
logging.getLogger("pynetdicom").setLevel(logging.CRITICAL)

_UNCOMPRESSED = (ExplicitVRLittleEndian, ImplicitVRLittleEndian, DeflatedExplicitVRLittleEndian, ExplicitVRBigEndian)
#: Compressed syntaxes in order of preference: lossless first, then the common lossy ones.
_COMPRESSED = (JPEGLosslessSV1, JPEGLossless, JPEG2000Lossless, JPEGLSLossless, RLELossless, HTJ2KLossless,
               HTJ2KLosslessRPCL, JPEGBaseline8Bit, JPEGExtended12Bit, JPEG2000, JPEGLSNearLossless, HTJ2K)
_MAX_CONTEXTS = 128  # presentation context IDs are the odd numbers 1..255 (PS3.8 §9.3.2.2)
_PENDING, _SUCCESS = "Pending", "Success"
_REJECT_HINTS = {
    3: "the PACS does not accept medload's calling AE title {calling}: register it in the PACS (AE title {calling}, "
       "this host's address, any port: C-GET needs no inbound connection) or give the registered one with "
       "--calling-aet",
    7: "the PACS does not answer to the called AE title {called}: check the AE title in dimse://AET@HOST:PORT "
       "(the PACS's own AE title, case-sensitive)",
}


def storage_contexts(limit: int = _MAX_CONTEXTS - 2) -> list:
    """Storage presentation contexts for :data:`RETRIEVED_SOP_CLASSES`: one per SOP class with the
    uncompressed transfer syntaxes, then one per (class, compressed syntax pydicom can decode), lossless
    before lossy, while ``limit`` allows (an acceptor picks one syntax per context, PS3.8 §9.3.3.2).

    Examples:
        >>> len(storage_contexts()) <= 126
        True
    """
    contexts = [build_context(sop, list(_UNCOMPRESSED)) for sop in RETRIEVED_SOP_CLASSES]
    for syntax in filter(_decodable, _COMPRESSED):
        contexts += [build_context(sop, syntax) for sop in RETRIEVED_SOP_CLASSES]
    return contexts[:limit]


def _decodable(syntax: UID) -> bool:
    """Whether pydicom has a decoder plugin installed for ``syntax`` (pylibjpeg, its plugins, or gdcm)."""
    return get_decoder(syntax).is_available


@dataclass
class _Delivery:
    """What one C-GET is expected to deliver, and what arrived (filled by the C-STORE handler thread)."""

    expected: dict[str, InstanceRef]
    spool: Spool
    max_bytes: int
    received: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)
    unexpected: int = 0
    error: StoreError | None = None


class DimseClient:
    """One association at a time to ``endpoint`` (opened on first use, opened again if it breaks),
    calling itself ``calling_aet``; every network wait is bounded by ``timeout`` seconds.

    Examples:
        >>> with DimseClient(parse_dimse_endpoint("dimse://PACS@pacs:104"), calling_aet="MEDLOAD") as pacs:
        ...     series = pacs.search_series({"Modality": "CT"})                  # doctest: +SKIP
    """

    def __init__(self, endpoint: DimseEndpoint, *, calling_aet: str = "MEDLOAD", timeout: float = 60.0,
                 max_instance_bytes: int = 2 << 30) -> None:
        self.endpoint, self.base = endpoint, endpoint.base
        self.calling_aet = check_ae_title(calling_aet, "--calling-aet")
        self.timeout, self.max_instance_bytes = timeout, max_instance_bytes
        self._ae = AE(ae_title=self.calling_aet)
        self._ae.implementation_version_name = f"MEDLOAD_{__version__}"[:16]
        self._ae.acse_timeout = self._ae.dimse_timeout = self._ae.network_timeout = timeout
        self._ae.connection_timeout = min(timeout, 10.0)
        self._contexts = [build_context(FIND_MODEL), build_context(GET_MODEL), *storage_contexts()]
        relational = SOPClassExtendedNegotiation()
        relational.sop_class_uid, relational.service_class_application_information = FIND_MODEL, b"\x01"
        self._ext_neg: list[_UI] = [relational, *(build_role(sop, scp_role=True) for sop in RETRIEVED_SOP_CLASSES)]
        self._assoc: Association | None = None
        self._delivery: _Delivery | None = None

    def close(self) -> None:
        if self._assoc is not None and self._assoc.is_established:
            self._assoc.release()
        self._assoc = None

    def __enter__(self) -> DimseClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- C-FIND --------------------------------------------------------------------------------
    def search_series(self, query: dict[str, str]) -> list[SeriesRef]:
        """Series matching ``query`` (keywords or 8-digit tags, as :func:`~medload.pacs.dicomweb.parse_query`
        reads them), in study, SeriesNumber, UID order."""
        keys = {"StudyInstanceUID": "", "SeriesInstanceUID": "", "Modality": "", "SeriesNumber": "", **query}
        found = {}
        for item in self._find(_identifier("SERIES", keys), "series search"):
            study, series = _uid(item, "StudyInstanceUID"), _uid(item, "SeriesInstanceUID")
            if study is None or series is None:
                log.warning("the series search returned an entry without valid Study/SeriesInstanceUIDs; ignored")
                continue
            found[series] = SeriesRef(study, series, str(item.get("Modality", "") or ""), _int(item, "SeriesNumber"))
        return sorted(found.values(), key=lambda s: (s.study, s.number is None, s.number or 0, s.series))

    def search_instances(self, series: SeriesRef) -> list[InstanceRef]:
        """Instances of ``series`` that medload ingests, in InstanceNumber order; InputProblem (skipped)
        when the series holds none (e.g. only secondary captures or reports)."""
        keys = {"StudyInstanceUID": series.study, "SeriesInstanceUID": series.series, "SOPInstanceUID": "",
                "SOPClassUID": "", "InstanceNumber": ""}
        found = {}
        for item in self._find(_identifier("IMAGE", keys), "instance search", one_series=True):
            uid = _uid(item, "SOPInstanceUID")
            if uid is None:
                raise InputProblem("retrieve", "the instance search returned an entry without a valid SOPInstanceUID")
            found[uid] = InstanceRef(uid, _int(item, "InstanceNumber"), str(item.get("SOPClassUID", "") or ""))
        return retrievable(series, found.values())

    def _find(self, identifier: Dataset, what: str, *, one_series: bool = False) -> Iterator[Dataset]:
        """The matches of a C-FIND. A failure status is that series' problem (InputProblem) for a search
        within ``one_series``, else the run's (RemoteSourceError), as is an association that breaks off."""
        assoc = self._association()
        for status, item in assoc.send_c_find(identifier, FIND_MODEL):
            code = status.get("Status")
            if code is None:
                self._assoc = None
                raise RemoteSourceError(f"{self.base} ended the association during the {what} (C-FIND), or sent "
                                        f"nothing within {self.timeout:g} s: check that the PACS lets AE title "
                                        f"{self.calling_aet} query (C-FIND) and retrieve (C-GET) from this host")
            category = code_to_category(code)
            if category == _PENDING and item is not None:
                yield item
            elif category not in (_PENDING, _SUCCESS) and one_series:
                raise InputProblem("retrieve", f"the {what} failed (C-FIND status 0x{code:04X}, {category})")
            elif category not in (_PENDING, _SUCCESS):
                raise RemoteSourceError(f"{self.base} failed the {what} (C-FIND status 0x{code:04X}, {category}): "
                                        "check --query (a PACS may refuse series searches without a StudyInstanceUID "
                                        "or some keys) and the PACS's log")

    # ---- C-GET ---------------------------------------------------------------------------------
    def retrieve(self, batch: list[tuple[SeriesRef, list[InstanceRef]]], spool: Spool,
                 advance: Callable[[int], None]) -> dict[str, list[tuple[InstanceRef, str]]]:
        """C-GET each series of ``batch`` into ``spool``; the instances that did not arrive, with why,
        by SeriesInstanceUID. RemoteSourceError when the PACS cannot be used at all. The association is
        released at the end: no network thread runs while the batch is decoded (by forked processes)."""
        failed = {}
        try:
            for ref, instances in batch:
                missing = self._get_series(ref, instances, spool, advance)
                if missing:
                    failed[ref.series] = missing
        finally:
            self.close()
        return failed

    def _get_series(self, ref: SeriesRef, instances: list[InstanceRef], spool: Spool,
                    advance: Callable[[int], None]) -> list[tuple[InstanceRef, str]]:
        delivery = _Delivery({i.uid: i for i in instances}, spool, self.max_instance_bytes)
        identifier = _identifier("SERIES", {"StudyInstanceUID": ref.study, "SeriesInstanceUID": ref.series})
        assoc, done, status = self._association(), 0, Dataset()
        self._delivery = delivery
        try:
            for response, _ in assoc.send_c_get(identifier, GET_MODEL):
                status = response  # the last one is final (PS3.7 9.1.3: pending responses come before)
                advance(len(delivery.received) - done)
                done = len(delivery.received)
        finally:
            self._delivery = None
        advance(len(delivery.received) - done)
        if delivery.error is not None:
            raise delivery.error
        if delivery.unexpected:
            log.warning("series number %s: %d instance(s) arrived that the instance search had not listed (added "
                        "since?); not ingested", ref.number, delivery.unexpected)
        code = status.get("Status")
        if code is None:
            self._assoc = None
            if not delivery.received:
                raise RemoteSourceError(f"{self.base} ended the association on a C-GET, or sent nothing within "
                                        f"{self.timeout:g} s: check that the PACS lets AE title {self.calling_aet} "
                                        "retrieve (C-GET) from this host, and the PACS's log")
        why = _get_outcome(code, status, self.timeout)
        return [(inst, delivery.refused.get(uid, why)) for uid, inst in delivery.expected.items()
                if uid not in delivery.received]

    def _on_store(self, event) -> int:
        """C-STORE sub-operation of a C-GET (handler thread): write the instance as received."""
        delivery, uid = self._delivery, str(event.request.AffectedSOPInstanceUID)
        if delivery is None or uid not in delivery.expected:
            if delivery is not None:
                delivery.unexpected += 1
            return 0x0000
        data = event.encoded_dataset(include_meta=True)
        if len(data) > delivery.max_bytes:
            delivery.refused[uid] = f"instance of {len(data)} bytes is larger than the cap ({delivery.max_bytes})"
            return 0xA700  # Refused: Out of Resources (PS3.4 B.2.3)
        try:
            with delivery.spool.file(uid) as out:
                out.write(data)
        except InputProblem:  # delivered twice: the first copy stands
            pass
        except StoreError as exc:
            delivery.error = exc
            return 0xA700
        delivery.received.add(uid)
        return 0x0000

    # ---- association ---------------------------------------------------------------------------
    def _association(self) -> Association:
        if self._assoc is not None and self._assoc.is_established:
            return self._assoc
        assoc = self._ae.associate(self.endpoint.host, self.endpoint.port, self._contexts,
                                   ae_title=self.endpoint.called_aet, ext_neg=self._ext_neg,
                                   evt_handlers=[(evt.EVT_C_STORE, self._on_store)])
        if assoc.is_established:
            accepted = {cx.abstract_syntax for cx in assoc.accepted_contexts}
            for model, what in ((FIND_MODEL, "queries (C-FIND)"), (GET_MODEL, "retrievals (C-GET)")):
                if model not in accepted:
                    assoc.release()
                    raise RemoteSourceError(f"{self.base} accepts no Study Root {what} from AE title "
                                            f"{self.calling_aet}: check the PACS supports them and allows them to this "
                                            "AE title (medload retrieves by C-GET; C-MOVE is not supported)")
            self._assoc = assoc
            return assoc
        if assoc.is_rejected:
            raise self._rejected(assoc.acceptor.primitive)
        raise self._unreachable()

    def _rejected(self, answer) -> Exception:
        if answer.result_source == 1 and answer.diagnostic in _REJECT_HINTS:
            hint = _REJECT_HINTS[answer.diagnostic].format(calling=self.calling_aet, called=self.endpoint.called_aet)
            return ConfigError(f"{self.base} rejected the association ({answer.reason_str}): {hint}")
        later = ": retry later" if answer.result == 2 else ": check the PACS's log and its configuration for medload"
        return RemoteSourceError(f"{self.base} rejected the association ({answer.result_str}, {answer.source_str}: "
                                 f"{answer.reason_str}){later}")

    def _unreachable(self) -> RemoteSourceError:
        """Why no association came about: no TCP connection at all, or no (valid) answer to the request."""
        host, port = self.endpoint.host, self.endpoint.port
        try:
            socket.create_connection((host, port), timeout=min(self.timeout, 10.0)).close()
        except OSError as exc:
            return RemoteSourceError(f"cannot connect to {self.base} ({exc.strerror or type(exc).__name__}): check "
                                     "the host and the PACS's DICOM port, that its DICOM service runs and that no "
                                     "firewall blocks it from here")
        return RemoteSourceError(f"{self.base} accepted a connection but no DICOM association (no answer within "
                                 f"{self.timeout:g} s, or it aborted): check that HOST:PORT is the PACS's DICOM port "
                                 "(not its web port) and that it does not require DICOM TLS")


def _identifier(level: str, keys: dict[str, str]) -> Dataset:
    """A C-FIND/C-GET identifier (PS3.4 C.4.1.1.3): QueryRetrieveLevel (0008,0052) and the keys, each by
    keyword or 8-digit tag, an empty value asking the PACS to return it."""
    ds = Dataset()
    ds.QueryRetrieveLevel = level
    for key, value in keys.items():
        tag = tag_for_keyword(key)
        if tag is None:
            if key == "fuzzymatching":
                raise ConfigError("--query: fuzzymatching is a DICOMweb (QIDO-RS) option; leave it out for dimse://")
            tag = Tag(int(key, 16))
        try:
            vr = dictionary_VR(tag).split(" or ")[0]
        except KeyError:
            raise ConfigError(f"--query: {key} is not in the DICOM dictionary; use a standard attribute") from None
        if vr == "SQ":
            raise ConfigError(f"--query: {key} is a sequence; sequence matching is not supported")
        try:
            ds[tag] = DataElement(tag, vr, _typed(vr, value))
        except ValueError:
            raise ConfigError(f"--query: {key}={value!r} is not a valid {vr} value") from None
    return ds


def _typed(vr: str, value: str):
    if not value:
        return None
    if vr in ("US", "SS", "UL", "SL", "UV", "SV"):
        return int(value)
    if vr in ("FL", "FD"):
        return float(value)
    return value


def _get_outcome(code: int | None, status: Dataset, timeout: float) -> str:
    """Why instances of a finished C-GET did not arrive, from its final status (PS3.4 C.4.3.1.4)."""
    if code is None:
        return f"the association broke off during the C-GET (aborted, or nothing within {timeout:g} s)"
    category, meaning = QR_GET_SERVICE_CLASS_STATUS.get(code, (code_to_category(code), "unknown status"))
    counts = ", ".join(f"{status.get(f'NumberOf{kind}Suboperations', '?')} {kind.lower()}"
                       for kind in ("Completed", "Failed", "Warning"))
    if category == _SUCCESS:
        return f"the C-GET ended with success ({counts} sub-operations) but this instance never arrived"
    return f"C-GET status 0x{code:04X} ({category}: {meaning}; {counts} sub-operations)"


def _uid(item: Dataset, keyword: str) -> str | None:
    return valid_uid(str(item.get(keyword, "") or "").strip())


def _int(item: Dataset, keyword: str) -> int | None:
    try:
        value = item.get(keyword)
        return int(float(value)) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None
