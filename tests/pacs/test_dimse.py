"""Ingest over DIMSE (PS3.4 C-FIND + C-GET, pynetdicom) from a real Orthanc, compared with the ingest from files.

One Orthanc with its DICOM port enabled serves the module (see ``orthanc_server.py``): it knows medload's
AE title (MEDLOAD) on 127.0.0.1, checks the called AE title, and logs each C-GET request, which the tests
count. The server tests skip only when the Orthanc binary is absent (``make test`` installs it).
"""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
from helpers.orthanc_server import Orthanc, free_port
from test_dicomweb import CT_SERIES, DICOM, MEDLOAD, UIDS, _pseudo, _records, _same, needs_orthanc

from medload.config import IngestConfig
from medload.errors import ConfigError, RemoteSourceError
from medload.ingest.run import ingest
from medload.pacs.dicomweb import RETRIEVED_SOP_CLASSES
from medload.pacs.dimse import _identifier, storage_contexts
from medload.pacs.endpoint import is_remote_url, parse_dimse_endpoint
from medload.pacs.ingest import RetrieveOptions, ingest_dimse
from medload.storage.store import open_store

pytestmark = pytest.mark.orthanc


# ---- without a server ------------------------------------------------------------------------------
def test_dimse_urls_and_ae_titles():
    endpoint = parse_dimse_endpoint("dimse://PACS@pacs.example.org:11112")
    assert (endpoint.called_aet, endpoint.host, endpoint.port) == ("PACS", "pacs.example.org", 11112)
    assert endpoint.base == "dimse://PACS@pacs.example.org:11112"
    assert is_remote_url("dimse://PACS@pacs:104") and not is_remote_url("dimse.txt")
    for bad, says in [("dimse://pacs:104", "no called AE title"), ("dimse://PACS@pacs", "needs a host and a port"),
                      ("dimse://PACS@pacs:104/x", "path or query"), ("dimse://WAY_TOO_LONG_AE_TITLE@pacs:104", "AE title"),
                      ("dicomweb://pacs/dicom-web", "not a DIMSE source")]:
        with pytest.raises(ConfigError, match=says):
            parse_dimse_endpoint(bad)


def test_storage_contexts_fit_one_association_and_offer_uncompressed_first():
    contexts = storage_contexts()
    assert len(contexts) <= 126  # with C-FIND and C-GET: 128, the most one association holds (PS3.8)
    first = {c.abstract_syntax: c.transfer_syntax for c in contexts[:len(RETRIEVED_SOP_CLASSES)]}
    assert set(first) == set(RETRIEVED_SOP_CLASSES)
    assert all(syntaxes[0] == "1.2.840.10008.1.2.1" for syntaxes in first.values())
    jpeg_lossless = [c for c in contexts if c.transfer_syntax == ["1.2.840.10008.1.2.4.70"]]
    assert len(jpeg_lossless) == len(RETRIEVED_SOP_CLASSES)  # pylibjpeg is a dependency: decodable


def test_query_keys_become_a_c_find_identifier():
    ds = _identifier("SERIES", {"Modality": "CT", "StudyDate": "20150101-20151231", "00200011": "", "SeriesNumber": ""})
    assert (ds.QueryRetrieveLevel, ds.Modality, ds.StudyDate) == ("SERIES", "CT", "20150101-20151231")
    assert "SeriesNumber" in ds and ds.SeriesNumber is None  # a return key
    for bad, says in [({"fuzzymatching": "true"}, "DICOMweb"), ({"ReferencedSeriesSequence": "x"}, "sequence"),
                      ({"Rows": "many"}, "not a valid US")]:
        with pytest.raises(ConfigError, match=says):
            _identifier("SERIES", bad)


# ---- against Orthanc -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def orthanc(tmp_path_factory):
    server = Orthanc(tmp_path_factory.mktemp("orthanc"), dimse=True)
    try:
        assert server.upload(DICOM) == len(UIDS)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def from_files(tmp_path_factory) -> dict[str, dict]:
    path = tmp_path_factory.mktemp("files") / "store"
    ingest(DICOM, path, config=IngestConfig(workers=1))
    return _records(path)


def _ingest(orthanc: Orthanc, store, *args: str, url: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*MEDLOAD, "-vv", "ingest", url or orthanc.dimse_url, str(store), "--workers", "1",
                           "--no-progress", *args], capture_output=True, text=True)


@needs_orthanc
def test_dimse_ingest_equals_file_ingest_and_a_rerun_retrieves_no_stored_series(orthanc, from_files, tmp_path):
    store = tmp_path / "store"
    before = orthanc.c_gets()
    proc = _ingest(orthanc, store, "--query", "Modality=CT&StudyDate=20000101-20301231")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _same(_records(store), from_files)
    assert "1 ingested" in proc.stdout and "29 files" in proc.stdout  # CT + localizer; not the 6 secondary captures
    assert orthanc.c_gets() - before == 2, "one C-GET per series with ingestable instances"
    skipped = [r for r in open_store(store).rejects() if r.stage == "retrieve"]
    assert [r.status for r in skipped] == ["skipped"] and "Secondary Capture" in skipped[0].reason
    assert not list((store / "staging" / "dimse").iterdir()), "spooled instances left behind"
    uids = set(UIDS) | {u["study"] for u in UIDS.values()} | {u["series"] for u in UIDS.values()}
    output = (proc.stdout + proc.stderr).encode()
    stored = [p.read_bytes() for p in store.rglob("*") if p.is_file()]
    for uid in map(str.encode, uids):
        assert uid not in output, f"{uid[:12]!r} in the output"
        assert not any(uid in data for data in stored), f"{uid[:12]!r} in the store"

    log_before, before = len(orthanc.log.read_text()), orthanc.c_gets()
    again = _ingest(orthanc, store, "--query", "Modality=CT&StudyDate=20000101-20301231")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 ingested, 1 already present" in again.stdout
    _same(_records(store), from_files)
    # only the localizer is retrieved again: nothing of it is stored (the same resume rule as DICOMweb)
    assert orthanc.c_gets() - before == 1
    ct_resource = orthanc.resource_id(CT_SERIES)
    assert f"Sending resource {ct_resource}" in orthanc.log.read_text()[:log_before]
    assert f"Sending resource {ct_resource}" not in orthanc.log.read_text()[log_before:], "the stored CT was retrieved"


@needs_orthanc
def test_a_c_get_short_of_an_instance_rejects_the_whole_series(orthanc, from_files, tmp_path):
    victim = max((uid for uid, u in UIDS.items() if u["series"] == CT_SERIES), key=lambda uid: UIDS[uid]["z"])
    stored_file = orthanc.stored_file(victim)
    intact = stored_file.read_bytes()
    # damaged storage: Orthanc still finds it (C-FIND reads up to the pixel data) but cannot send it (C-GET)
    stored_file.write_bytes(intact[:len(intact) // 2])
    store = tmp_path / "store"
    try:
        report = ingest_dimse(orthanc.dimse_url, store, config=IngestConfig(workers=1))
    finally:
        stored_file.write_bytes(intact)
    p, u = _pseudo(), UIDS[victim]
    url = f"{orthanc.dimse_url}/studies/{p.uid('study', u['study'])}/series/{p.uid('series', u['series'])}"
    retrieve = {r.source: r for r in open_store(store).rejects() if r.stage == "retrieve"}
    assert "C-GET status 0x" in retrieve[f"{url}/instances/{p.uid('instance', victim)}"].reason
    assert "series incomplete:" in retrieve[url].reason and "of 28 instance(s)" in retrieve[url].reason
    assert [s.status for s in report.series if s.key == p.uid("series", CT_SERIES)] == ["rejected"]
    assert _records(store) == {}, "the series must not be stored short of an instance"
    assert not any(victim in r.source + r.reason for r in open_store(store).rejects())
    again = ingest_dimse(orthanc.dimse_url, store, config=IngestConfig(workers=1))
    assert again.counts["ingested"] == 1  # nothing of it was stored: the rerun retrieves and stores it
    _same(_records(store), from_files)


@needs_orthanc
def test_wrong_ae_titles_and_an_unreachable_port_say_what_to_check(orthanc, tmp_path):
    wrong_called = _ingest(orthanc, tmp_path / "s1", url=f"dimse://NOT_ORTHANC@127.0.0.1:{orthanc.dicom_port}")
    assert wrong_called.returncode == 2
    assert "does not answer to the called AE title NOT_ORTHANC" in wrong_called.stderr
    assert not (tmp_path / "s1").exists(), "a refused run must not create the store"
    with pytest.raises(RemoteSourceError, match=r"cannot connect to dimse://ORTHANC@127\.0\.0\.1:\d+ .*DICOM port"):
        ingest_dimse(f"dimse://ORTHANC@127.0.0.1:{free_port()}", tmp_path / "s2")
    with pytest.raises(RemoteSourceError, match=r"no DICOM association .*\(not its web port\)"):
        ingest_dimse(f"dimse://ORTHANC@127.0.0.1:{orthanc.port}", tmp_path / "s3")  # Orthanc's HTTP port
    with socket.create_server(("127.0.0.1", 0)) as silent:  # connections complete, nothing ever answers
        url = f"dimse://ORTHANC@127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RemoteSourceError, match=r"no answer within 0\.5 s"):
            ingest_dimse(url, tmp_path / "s3", options=RetrieveOptions(timeout=0.5))
    stranger = _ingest(orthanc, tmp_path / "s4", "--calling-aet", "STRANGER")
    assert stranger.returncode == 2 and "lets AE title STRANGER query (C-FIND)" in stranger.stderr
    usage = _ingest(orthanc, tmp_path / "s5", "--connections", "4")
    assert usage.returncode == 2 and "apply to dicomweb:// sources" in usage.stderr


@needs_orthanc
def test_a_query_matching_nothing_ingests_nothing(orthanc, tmp_path):
    before = orthanc.c_gets()
    proc = _ingest(orthanc, tmp_path / "store", "--query", "Modality=MR")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 ingested, 0 already present, 0 skipped, 0 rejected" in proc.stdout
    assert orthanc.c_gets() == before and json.loads(
        subprocess.run([*MEDLOAD, "ls", str(tmp_path / "store"), "--json"], capture_output=True, text=True).stdout) == []
