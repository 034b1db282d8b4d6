"""A real Orthanc (Debian packages ``orthanc`` + ``orthanc-dicomweb``) for tests, and a small HTTP proxy.

:class:`Orthanc` runs ``Orthanc CONFIG.json`` with a generated configuration: a free port on loopback
(``RemoteAccessAllowed: false``; Orthanc 1.10 cannot bind one address), a temporary storage folder, the
DICOMweb plugin, authentication with a generated user and password; with ``dimse=True`` also a DICOM
(DIMSE) listener on a free port (Orthanc 1.10 listens on every interface: only callers from 127.0.0.1
registered as ``calling_aet`` may query and retrieve, ``DicomCheckModalityHost``), which checks the called
AE title, logs each C-GET request (``--verbose``) and reads instances from disk on every retrieval
(no storage cache), so that a test can damage one.
:class:`Proxy` sits between medload and Orthanc: it counts the requests it forwards, answers HTTP 500
for chosen paths and can hold chosen requests until released; with a certificate it speaks TLS.
"""

from __future__ import annotations

import base64
import http.client
import json
import secrets
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ORTHANC = shutil.which("Orthanc") or next((p for p in ("/usr/sbin/Orthanc", "/usr/bin/Orthanc") if Path(p).exists()),
                                          None)
_PLUGIN_DIRS = ("/usr/share/orthanc/plugins", "/usr/lib/orthanc")


def dicomweb_plugin() -> Path:
    """The DICOMweb plugin of the ``orthanc-dicomweb`` package."""
    listed = subprocess.run(["dpkg", "-L", "orthanc-dicomweb"], capture_output=True, text=True).stdout.split()
    found = [Path(p) for p in listed if "DicomWeb" in p and ".so" in p] or \
        [p for d in _PLUGIN_DIRS for p in sorted(Path(d).glob("libOrthancDicomWeb.so*"))]
    if not found:
        raise RuntimeError("the Orthanc DICOMweb plugin is missing: apt-get install orthanc-dicomweb (make test does)")
    return found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Orthanc:
    """One Orthanc process with DICOMweb at ``dicomweb_url``; ``user`` and ``password`` are generated.
    With ``dimse``: a DICOM listener at ``dimse_url`` for C-FIND and C-GET from ``calling_aet``."""

    AET = "ORTHANC"

    def __init__(self, folder: Path, *, dimse: bool = False, calling_aet: str = "MEDLOAD") -> None:
        self.user, self.password = "medload", secrets.token_urlsafe(18)
        self.port = free_port()
        self.dicom_port = free_port() if dimse else None
        config = {
            "Name": "medload-test", "StorageDirectory": str(folder / "db"), "IndexDirectory": str(folder / "db"),
            "HttpPort": self.port, "RemoteAccessAllowed": False, "DicomServerEnabled": False,
            "AuthenticationEnabled": True, "RegisteredUsers": {self.user: self.password},
            "Plugins": [str(dicomweb_plugin())], "DicomWeb": {"Enable": True, "Root": "/dicom-web/"},
            "HttpDescribeErrors": True,
        }
        if dimse:
            config.update({
                "DicomServerEnabled": True, "DicomAet": self.AET, "DicomPort": self.dicom_port,
                "DicomCheckCalledAet": True, "DicomCheckModalityHost": True, "MaximumStorageCacheSize": 0,
                # Port: where Orthanc would connect for C-MOVE/C-STORE SCU, which these tests never ask for
                "DicomModalities": {"medload": {"AET": calling_aet, "Host": "127.0.0.1", "Port": 104,
                                                "AllowFind": True, "AllowGet": True, "AllowMove": False,
                                                "AllowStore": False, "AllowEcho": True}},
            })
        self.config = folder / "orthanc.json"
        self.config.write_text(json.dumps(config))
        self.log = folder / "orthanc.log"
        args = [ORTHANC, *(["--verbose"] if dimse else []), str(self.config)]
        with open(self.log, "wb") as log:
            self._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def dicomweb_url(self) -> str:
        return f"dicomweb://127.0.0.1:{self.port}/dicom-web"

    @property
    def dimse_url(self) -> str:
        return f"dimse://{self.AET}@127.0.0.1:{self.dicom_port}"

    def c_gets(self) -> int:
        """C-GET requests Orthanc has received so far (lines of its --verbose log)."""
        return self.log.read_text(errors="replace").count("C-GET-SCU request received")

    def resource_id(self, uid: str) -> str:
        """Orthanc's own identifier of the study, series or instance with this DICOM UID (REST /tools/lookup);
        its log names resources by it."""
        return json.loads(self._request("POST", "/tools/lookup", uid.encode()))[0]["ID"]

    def stored_file(self, sop_instance_uid: str) -> Path:
        """The file in Orthanc's storage folder holding the instance (its ``dicom`` attachment UUID, by which
        the filesystem storage area names files)."""
        instance = self.resource_id(sop_instance_uid)
        uuid = json.loads(self._request("GET", f"/instances/{instance}/attachments/dicom/info"))["Uuid"]
        config = json.loads(self.config.read_text())
        return Path(config["StorageDirectory"]) / uuid[:2] / uuid[2:4] / uuid

    def _request(self, method: str, path: str, data: bytes | None = None) -> bytes:
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request = urllib.request.Request(self.http_url + path, data=data, method=method,
                                         headers={"Authorization": f"Basic {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"Orthanc exited with {self._proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                self._request("GET", "/system")
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"Orthanc did not answer within {timeout:.0f} s: {self.log.read_text()[-2000:]}")

    def upload(self, folder: Path) -> int:
        """POST every file under ``folder`` to /instances (Orthanc REST); the number uploaded."""
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        for path in files:
            self._request("POST", "/instances", path.read_bytes())
        return len(files)

    def stop(self) -> None:
        """Kill the server: its folder is thrown away with the test, and Orthanc's orderly shutdown on
        SIGTERM takes about 3 s (a dozen servers per run)."""
        self._proc.kill()
        self._proc.wait()


class Proxy:
    """Forwards GET requests to ``upstream`` (http://host:port) and records their paths in ``paths``.

    ``fail(path) -> bool`` picks requests answered with ``status`` (500) instead; ``hold(path) -> bool``
    picks requests held until :meth:`release` (``held`` is set when the first one arrives).
    """

    def __init__(self, upstream: str, *, fail: Callable[[str], bool] = lambda p: False, status: int = 500,
                 hold: Callable[[str], bool] = lambda p: False, tls: ssl.SSLContext | None = None) -> None:
        self.paths: list[str] = []
        self.held, self._release = threading.Event(), threading.Event()
        host, port = upstream.split("://", 1)[1].split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                proxy.paths.append(self.path)
                if fail(self.path):
                    body = b'{"Message": "injected failure"}'
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if hold(self.path):
                    proxy.held.set()
                    proxy._release.wait(60)
                upstream_conn = http.client.HTTPConnection(host, int(port), timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                upstream_conn.request("GET", self.path, headers=headers)
                response = upstream_conn.getresponse()
                body = response.read()
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                upstream_conn.close()

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.handle_error = lambda request, address: None  # a client killed mid-request is expected
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, scheme: str = "dicomweb") -> str:
        return f"{scheme}://127.0.0.1:{self.port}/dicom-web"

    def release(self) -> None:
        self._release.set()

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
