"""Ingest over DICOMweb (PS3.18 QIDO-RS/WADO-RS) from a real Orthanc, compared with the ingest from files.

The server tests start one Orthanc for the module (see ``orthanc_server.py``) and skip only when the
Orthanc binary is absent (``make test`` installs it). A proxy between medload and Orthanc counts
requests, injects HTTP 500 for one instance, holds a request so the ingester can be killed mid-download,
or speaks TLS.
"""

from __future__ import annotations

import io
import json
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import pydicom
import pytest
from conftest import PHILIPS
from helpers.orthanc_server import ORTHANC, Orthanc, Proxy, free_port

from medload.config import IngestConfig
from medload.deid import Pseudonymizer, load_key
from medload.errors import ConfigError, InputProblem, RemoteSourceError
from medload.ingest.run import ingest
from medload.pacs import dicomweb
from medload.pacs.dicomweb import RetryPolicy, parse_query
from medload.pacs.endpoint import load_credentials, parse_endpoint
from medload.pacs.ingest import RetrieveOptions, ingest_dicomweb
from medload.pacs.multipart import boundary_of, write_single_part
from medload.storage.store import open_store

pytestmark = pytest.mark.orthanc

MEDLOAD = [sys.executable, "-m", "medload.cli"]
DICOM = PHILIPS / "dicom"
FAST = RetrieveOptions(retry=RetryPolicy(attempts=2, backoff=0.05))
needs_orthanc = pytest.mark.skipif(ORTHANC is None, reason="Orthanc is not installed (make test installs the Debian "
                                                           "packages orthanc and orthanc-dicomweb)")


def _uids() -> dict[str, dict[str, str]]:
    """SOPInstanceUID -> {study, series, instance, series_number} of every sample file."""
    out = {}
    for path in sorted(p for p in DICOM.rglob("*") if p.is_file()):
        ds = pydicom.dcmread(path, stop_before_pixels=True)
        out[ds.SOPInstanceUID] = {"study": ds.StudyInstanceUID, "series": ds.SeriesInstanceUID,
                                  "number": int(ds.SeriesNumber), "z": float(ds.get("ImagePositionPatient", [0, 0, 0])[2])}
    return out


UIDS = _uids()
CT_SERIES = next(u["series"] for u in UIDS.values() if u["number"] == 201)  # the 28-slice head CT (folder S2010)


# ---- without a server ------------------------------------------------------------------------------
def _multipart(body: bytes, boundary: str = "b0und", parts: int = 1, kind: str = "application/dicom") -> bytes:
    part = f"--{boundary}\r\nContent-Type: {kind}\r\n\r\n".encode() + body + b"\r\n"
    return b"preamble\r\n" + part * parts + f"--{boundary}--\r\n".encode()


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_multipart_body_is_streamed_exactly_whatever_the_chunking(chunk):
    body = bytes(range(256)) * 40 + b"\r\n--b0un" + b"\r\n--"  # near-delimiters inside the body
    data = _multipart(body)
    out = io.BytesIO()
    size = write_single_part((data[i:i + chunk] for i in range(0, len(data), chunk)), b"b0und", out, 1 << 20)
    assert out.getvalue() == body and size == len(body)


@pytest.mark.parametrize(("data", "reason", "cap"), [
    (_multipart(b"x" * 100)[:-30], "cut short", 1000),
    (_multipart(b"x", parts=2), "more than one part", 1000),
    (_multipart(b"x", kind="application/json"), "not application/dicom", 1000),
    (b"--b0und--\r\n", "no part", 1000),
    (_multipart(b"x" * 100), "larger than the cap", 50),
])
def test_broken_multipart_is_a_retrieve_problem(data, reason, cap):
    with pytest.raises(InputProblem, match=reason) as info:
        write_single_part([data], b"b0und", io.BytesIO(), cap)
    assert info.value.stage == "retrieve"


def test_boundary_of_content_type():
    assert boundary_of('multipart/related; type="application/dicom"; boundary="a:b"') == b"a:b"
    with pytest.raises(InputProblem, match="not multipart/related"):
        boundary_of("application/json")


def test_urls_and_queries():
    assert parse_endpoint("dicomweb://pacs:8042/dicom-web/").base == "http://pacs:8042/dicom-web"
    assert parse_endpoint("dicomwebs://pacs/dicom-web").secure
    with pytest.raises(ConfigError, match="user name or password") as info:
        parse_endpoint("dicomweb://bob:hunter2@pacs:8042/dicom-web")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError, match="--query"):
        parse_endpoint("dicomweb://pacs/dicom-web?Modality=CT")
    assert parse_query("Modality=CT&StudyDate=20150101-20151231&00100020=X") == {
        "Modality": "CT", "StudyDate": "20150101-20151231", "00100020": "X"}
    for bad in ("Modalty=CT", "limit=5", "Modality=CT&Modality=MR", "Modality"):
        with pytest.raises(ConfigError, match="--query"):
            parse_query(bad)


def test_credentials_from_file_or_environment(tmp_path):
    cred = tmp_path / "cred"
    cred.write_text("alice:pa:ss\n")
    cred.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_credentials(cred)
    cred.chmod(0o600)
    c = load_credentials(cred)
    assert (c.user, c.secret) == ("alice", "pa:ss") and "pa:ss" not in repr(c)
    cred.write_text("eyJtoken\n")
    assert load_credentials(cred).user is None
    env = {"MEDLOAD_DICOMWEB_USER": "u", "MEDLOAD_DICOMWEB_PASSWORD": "p"}
    assert load_credentials(None, env).secret == "p"
    with pytest.raises(ConfigError, match="not both|unset one"):
        load_credentials(None, {**env, "MEDLOAD_DICOMWEB_TOKEN": "t"})
    with pytest.raises(ConfigError, match="both"):
        load_credentials(None, {"MEDLOAD_DICOMWEB_USER": "u"})
    assert load_credentials(None, {}) is None


# ---- against Orthanc -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def orthanc(tmp_path_factory):
    server = Orthanc(tmp_path_factory.mktemp("orthanc"))
    try:
        assert server.upload(DICOM) == len(UIDS)
        yield server
    finally:
        server.stop()


@pytest.fixture
def cred_env(orthanc, monkeypatch):
    monkeypatch.setenv("MEDLOAD_DICOMWEB_USER", orthanc.user)
    monkeypatch.setenv("MEDLOAD_DICOMWEB_PASSWORD", orthanc.password)


@pytest.fixture(scope="module")
def from_files(tmp_path_factory) -> dict[str, dict]:
    """The sample ingested from files: key -> record."""
    path = tmp_path_factory.mktemp("files") / "store"
    ingest(DICOM, path, config=IngestConfig(workers=1))
    return _records(path)


def _records(store: Path) -> dict[str, dict]:
    out = subprocess.run([*MEDLOAD, "ls", str(store), "--json"], capture_output=True, text=True, check=True).stdout
    records = json.loads(out)
    assert len({r["key"] for r in records}) == len(records), "a series is stored twice"
    return {r["key"]: r for r in records}


def _same(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        for field in ("digest", "shape", "affine", "spacing", "series", "source_fingerprint"):
            assert a[key][field] == b[key][field], (key, field)


def _pseudo() -> Pseudonymizer:
    return Pseudonymizer(load_key())


def _write_credentials(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@needs_orthanc
def test_dicomweb_ingest_equals_file_ingest_and_leaks_no_secret(orthanc, from_files, tmp_path):
    store = tmp_path / "store"
    cred = _write_credentials(tmp_path / "cred", f"{orthanc.user}:{orthanc.password}")
    proc = subprocess.run([*MEDLOAD, "-vv", "ingest", orthanc.dicomweb_url, str(store), "--credentials", str(cred),
                           "--workers", "1", "--query", "StudyDate=20000101-20301231"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _same(_records(store), from_files)
    # the 6 secondary captures are found but not downloaded: 28 CT slices and the localizer are
    assert "1 ingested" in proc.stdout and "29 files" in proc.stdout
    skipped = [r for r in open_store(store).rejects() if r.stage == "retrieve"]
    assert [r.status for r in skipped] == ["skipped"] and "Secondary Capture" in skipped[0].reason
    assert not list((store / "staging" / "dicomweb").iterdir()), "spooled instances left behind"
    uids = set(UIDS) | {u["study"] for u in UIDS.values()} | {u["series"] for u in UIDS.values()}
    secrets = [orthanc.password.encode()] + [uid.encode() for uid in uids]
    output = (proc.stdout + proc.stderr).encode()
    stored = [p.read_bytes() for p in store.rglob("*") if p.is_file()]
    for secret in secrets:
        assert secret not in output, f"{secret[:12]!r} in the output"
        assert not any(secret in data for data in stored), f"{secret[:12]!r} in the store"


@needs_orthanc
def test_wrong_password_unreachable_server_and_failed_search_say_so(orthanc, tmp_path, monkeypatch):
    cred = _write_credentials(tmp_path / "cred", f"{orthanc.user}:not-the-password")
    proc = subprocess.run([*MEDLOAD, "ingest", orthanc.dicomweb_url, str(tmp_path / "s1"), "--credentials", str(cred)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "refused the credentials (HTTP 401" in proc.stderr and "not-the-password" not in proc.stderr + proc.stdout
    assert not (tmp_path / "s1").exists(), "a refused run must not create the store"
    with pytest.raises(RemoteSourceError, match="requires credentials"):
        ingest_dicomweb(orthanc.dicomweb_url, tmp_path / "s2", options=FAST)
    with pytest.raises(RemoteSourceError, match=r"cannot use .* for the series search: .*refused.*after 2 attempts"):
        ingest_dicomweb(f"dicomweb://127.0.0.1:{free_port()}/dicom-web", tmp_path / "s3", options=FAST)
    monkeypatch.setenv("MEDLOAD_DICOMWEB_TOKEN", "no-such-token")
    with pytest.raises(RemoteSourceError, match="refused the credentials"):
        ingest_dicomweb(orthanc.dicomweb_url, tmp_path / "s4", options=FAST)
    monkeypatch.delenv("MEDLOAD_DICOMWEB_TOKEN")
    monkeypatch.setenv("MEDLOAD_DICOMWEB_USER", orthanc.user)
    monkeypatch.setenv("MEDLOAD_DICOMWEB_PASSWORD", orthanc.password)
    proxy = Proxy(orthanc.http_url, fail=lambda path: path.startswith("/dicom-web/series"))
    try:
        with pytest.raises(RemoteSourceError, match="failed the series search: HTTP 500"):
            ingest_dicomweb(proxy.url(), tmp_path / "s5", options=FAST)
    finally:
        proxy.stop()


@needs_orthanc
def test_http_500_on_one_instance_rejects_it_and_its_whole_series(orthanc, from_files, cred_env, tmp_path):
    # the top slice: without it the other 27 still form a regular volume, which must not be stored either
    victim = max((uid for uid, u in UIDS.items() if u["series"] == CT_SERIES), key=lambda uid: UIDS[uid]["z"])
    proxy = Proxy(orthanc.http_url, fail=lambda path: path.endswith(f"/instances/{victim}"))
    store = tmp_path / "store"
    try:
        report = ingest_dicomweb(proxy.url(), store, config=IngestConfig(workers=1), options=FAST)
    finally:
        proxy.stop()
    p, u = _pseudo(), UIDS[victim]
    url = f"{proxy.url('http')}/studies/{p.uid('study', u['study'])}/series/{p.uid('series', u['series'])}"
    retrieve = {r.source: r for r in open_store(store).rejects() if r.stage == "retrieve"}
    assert "HTTP 500" in retrieve[f"{url}/instances/{p.uid('instance', victim)}"].reason
    assert "series incomplete: 1 of 28" in retrieve[url].reason and p.uid("instance", victim) in retrieve[url].reason
    assert [s.status for s in report.series if s.key == p.uid("series", CT_SERIES)] == ["rejected"]
    assert _records(store) == {}, "the series must not be stored short of an instance"
    assert not any(victim in r.source + r.reason for r in open_store(store).rejects())
    again = ingest_dicomweb(orthanc.dicomweb_url, store, config=IngestConfig(workers=1), options=FAST)
    assert again.counts["ingested"] == 1  # nothing of it was stored: the rerun retrieves and stores it
    _same(_records(store), from_files)


@needs_orthanc
def test_killed_mid_download_then_rerun_completes_without_retrieving_stored_series(orthanc, from_files, tmp_path,
                                                                                  monkeypatch):
    ct = {uid for uid, u in UIDS.items() if u["series"] == CT_SERIES}
    localizer = {uid for uid, u in UIDS.items() if u["number"] < 201}
    later = next(u["series"] for u in UIDS.values() if u["number"] > 201)  # searched after the CT is stored
    proxy = Proxy(orthanc.http_url, hold=lambda path: f"/series/{later}/instances?" in path)
    store = tmp_path / "store"
    env = {**os.environ, "MEDLOAD_DICOMWEB_USER": orthanc.user, "MEDLOAD_DICOMWEB_PASSWORD": orthanc.password}
    proc = subprocess.Popen([*MEDLOAD, "ingest", proxy.url(), str(store), "--workers", "1", "--spool-instances", "1",
                             "--no-progress"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert proxy.held.wait(30), "the ingester never reached the series after the CT"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
        proxy.stop()
    _same(_records(store), from_files)  # committed before the kill
    leftover = store / "staging" / "dicomweb" / "left-by-a-killed-run.dcm"
    leftover.write_bytes(b"partial")  # as a kill during a download leaves it
    monkeypatch.setenv("MEDLOAD_DICOMWEB_USER", orthanc.user)
    monkeypatch.setenv("MEDLOAD_DICOMWEB_PASSWORD", orthanc.password)
    counting = Proxy(orthanc.http_url)
    try:
        report = ingest_dicomweb(counting.url(), store, config=IngestConfig(workers=1), options=FAST)
    finally:
        counting.stop()
    retrieved = {path.rsplit("/", 1)[-1] for path in counting.paths if "/instances/" in path}
    assert not retrieved & ct, "a stored series was retrieved again"
    # the localizer is retrieved again (nothing of it is stored); the secondary captures never are
    assert retrieved == localizer and report.counts["present"] == 1
    _same(_records(store), from_files)
    assert not list((store / "staging" / "dicomweb").iterdir())


@needs_orthanc
def test_transient_errors_are_retried_and_searches_read_in_pages(orthanc, from_files, cred_env, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setattr(dicomweb, "_PAGE", 5)  # 3 series, 28 instances: several pages each
    flaky = sorted(uid for uid, u in UIDS.items() if u["series"] == CT_SERIES)[:3]
    failures = {uid: 2 for uid in flaky}  # each fails twice with 503, then succeeds

    def fail(path: str) -> bool:
        uid = path.rsplit("/", 1)[-1]
        failures[uid] = failures.get(uid, 0) - 1
        return failures[uid] >= 0

    proxy = Proxy(orthanc.http_url, fail=fail, status=503)
    try:
        options = RetrieveOptions(retry=RetryPolicy(attempts=3, backoff=0.05))
        report = ingest_dicomweb(proxy.url(), tmp_path / "store", config=IngestConfig(workers=1), options=options)
    finally:
        proxy.stop()
    assert report.counts["ingested"] == 1 and report.files == len(UIDS) - 6  # the 6 secondary captures stay
    assert sum(path.endswith(flaky[0]) for path in proxy.paths) == 3
    assert sum("offset=" in path and "/instances?" in path for path in proxy.paths) > 6
    _same(_records(tmp_path / "store"), from_files)


@needs_orthanc
def test_tls_is_verified_and_a_ca_bundle_trusts_the_server(orthanc, cred_env, tmp_path):
    if not Path("/usr/bin/openssl").exists():
        pytest.skip(reason="openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    proxy = Proxy(orthanc.http_url, tls=tls)
    try:
        with pytest.raises(RemoteSourceError, match="not trusted.*--ca-bundle"):
            ingest_dicomweb(proxy.url("dicomwebs"), tmp_path / "s1", options=FAST)
        report = ingest_dicomweb(proxy.url("dicomwebs"), tmp_path / "s2", ca_bundle=cert, query="Modality=CT",
                                 config=IngestConfig(workers=1), options=FAST)
        assert report.counts["ingested"] == 1
    finally:
        proxy.stop()
