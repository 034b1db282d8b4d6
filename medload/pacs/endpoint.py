"""Where a DICOMweb server is, and how medload authenticates to it.

``dicomweb://HOST:PORT/PATH`` names a DICOMweb service root over HTTP, ``dicomwebs://`` over HTTPS
(PS3.18 §8.2: the service root the QIDO-RS and WADO-RS resources hang from). Credentials never come
from the command line or the URL, which shell history and process lists keep: they come from a file
only its owner can read (``user:password``, or a bearer token on its own), or from the environment
(``MEDLOAD_DICOMWEB_USER`` + ``MEDLOAD_DICOMWEB_PASSWORD``, or ``MEDLOAD_DICOMWEB_TOKEN``).

``dimse://CALLED_AET@HOST:PORT`` names a DICOM application entity reached over DIMSE (PS3.8 upper layer,
unencrypted): its AE title (the *called* AE title of the association, PS3.8 §9.3.2) and TCP address.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from medload.errors import ConfigError
from medload.owner_only import check_owner_only

__all__ = ["Endpoint", "Credentials", "DimseEndpoint", "is_dicomweb_url", "is_dimse_url", "is_remote_url",
           "parse_endpoint", "parse_dimse_endpoint", "check_ae_title", "load_credentials", "tls_context"]

log = logging.getLogger(__name__)

_SCHEMES = {"dicomweb": "http", "dicomwebs": "https"}
_ENV_USER, _ENV_PASSWORD, _ENV_TOKEN = "MEDLOAD_DICOMWEB_USER", "MEDLOAD_DICOMWEB_PASSWORD", "MEDLOAD_DICOMWEB_TOKEN"
_DIMSE = "dimse://"
_DIMSE_FORM = "write dimse://CALLED_AET@HOST:PORT, e.g. dimse://PACS@pacs.example.org:104"
_HOW = f"use --credentials FILE (mode 0600) or {_ENV_USER}/{_ENV_PASSWORD} or {_ENV_TOKEN}"


@dataclass(frozen=True)
class Endpoint:
    """A DICOMweb service root: ``base`` is its http(s) URL without a trailing slash (and never with
    credentials, so it is safe in messages)."""

    base: str

    @property
    def secure(self) -> bool:
        return self.base.startswith("https:")


@dataclass(frozen=True)
class Credentials:
    """A user name and password (HTTP Basic), or a bearer token (``user`` is None). The secret is
    left out of ``repr`` so it cannot reach a log or a traceback by accident."""

    user: str | None
    secret: str = field(repr=False)


@dataclass(frozen=True)
class DimseEndpoint:
    """A DICOM application entity reached over DIMSE: its AE title (the called AE title), host and port.
    ``base`` names it in messages and quarantine records.

    Examples:
        >>> parse_dimse_endpoint("dimse://PACS@pacs.example.org:104").base
        'dimse://PACS@pacs.example.org:104'
    """

    called_aet: str
    host: str
    port: int

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{_DIMSE}{self.called_aet}@{host}:{self.port}"


def is_dicomweb_url(text: str | os.PathLike) -> bool:
    """Whether ``text`` is a ``dicomweb://`` or ``dicomwebs://`` source."""
    return str(text).lower().startswith(tuple(f"{scheme}://" for scheme in _SCHEMES))


def is_dimse_url(text: str | os.PathLike) -> bool:
    """Whether ``text`` is a ``dimse://`` source.

    Examples:
        >>> is_dimse_url("dimse://PACS@pacs:104"), is_dimse_url("scans/")
        (True, False)
    """
    return str(text).lower().startswith(_DIMSE)


def is_remote_url(text: str | os.PathLike) -> bool:
    """Whether ``text`` names a PACS (``dicomweb://``, ``dicomwebs://`` or ``dimse://``) rather than files.

    Examples:
        >>> is_remote_url("dimse://PACS@pacs:104"), is_remote_url("dicomweb://pacs/dicom-web")
        (True, True)
    """
    return is_dicomweb_url(text) or is_dimse_url(text)


def check_ae_title(title: str, what: str) -> str:
    """``title`` if it is a valid AE title (PS3.5 §6.2, VR AE: 1-16 characters of the default character
    repertoire, no backslash, not only spaces), stripped of surrounding spaces; ConfigError otherwise.

    Examples:
        >>> check_ae_title("MEDLOAD", "--calling-aet")
        'MEDLOAD'
    """
    stripped = title.strip(" ")
    if not stripped or len(title) > 16 or "\\" in title or not all(" " <= c <= "~" for c in title):
        raise ConfigError(f"{what} {title!r} is not a DICOM AE title: 1 to 16 printable ASCII characters, no "
                          "backslash (PS3.5 VR AE)")
    return stripped


def parse_dimse_endpoint(url: str) -> DimseEndpoint:
    """The application entity named by ``dimse://CALLED_AET@HOST:PORT``; ConfigError if it is malformed.

    Examples:
        >>> parse_dimse_endpoint("dimse://ORTHANC@127.0.0.1:4242").port
        4242
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != _DIMSE[:-3]:
        raise ConfigError(f"{url!r} is not a DIMSE source: {_DIMSE_FORM}")
    aet, at, _ = parts.netloc.rpartition("@")
    if not at or not aet:
        raise ConfigError(f"{url!r} names no called AE title (the PACS's own AE title): {_DIMSE_FORM}")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{url!r} has an invalid port: {_DIMSE_FORM}") from None
    if not parts.hostname or port is None:
        raise ConfigError(f"{url!r} needs a host and a port (DICOM has no default port; 104 and 11112 are common): "
                          f"{_DIMSE_FORM}")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ConfigError(f"{url!r} has a path or query part: {_DIMSE_FORM} and give search keys with --query, "
                          "e.g. --query 'Modality=CT'")
    return DimseEndpoint(check_ae_title(unquote(aet), "the called AE title"), parts.hostname, port)


def parse_endpoint(url: str) -> Endpoint:
    """The service root named by a ``dicomweb://`` or ``dicomwebs://`` URL; ConfigError if it is malformed
    or carries credentials (the message never repeats the URL then)."""
    parts = urlsplit(url)
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ConfigError(f"{url!r} is not a DICOMweb source: write dicomweb://HOST:PORT/PATH (dicomwebs:// for TLS)")
    if "@" in parts.netloc:
        raise ConfigError(f"the {parts.scheme}:// URL carries a user name or password, which shell history and process "
                          f"lists keep: remove it from the URL and {_HOW}")
    try:
        parts.port  # validates the port
    except ValueError:
        raise ConfigError(f"{url!r} has an invalid port: write dicomweb://HOST:PORT/PATH") from None
    if not parts.hostname:
        raise ConfigError(f"{url!r} names no host: write dicomweb://HOST:PORT/PATH")
    if parts.query or parts.fragment:
        raise ConfigError(f"{url!r} has a query part: give search keys with --query, e.g. --query 'Modality=CT'")
    return Endpoint(f"{scheme}://{parts.netloc}{parts.path.rstrip('/')}")


def load_credentials(path: Path | None, environ: Mapping[str, str] = os.environ) -> Credentials | None:
    """Credentials from ``path`` if given (refused unless only its owner can read it), else from the
    environment, else None (anonymous access)."""
    if path is not None:
        return _from_file(Path(path))
    token, user, password = (environ.get(name) or None for name in (_ENV_TOKEN, _ENV_USER, _ENV_PASSWORD))
    if token and (user or password):
        raise ConfigError(f"both {_ENV_TOKEN} and {_ENV_USER}/{_ENV_PASSWORD} are set: unset one of them")
    if token:
        return Credentials(None, token)
    if bool(user) != bool(password):
        raise ConfigError(f"set both {_ENV_USER} and {_ENV_PASSWORD} (only one is set)")
    return Credentials(user, password) if user and password else None  # both or neither (checked above)


def _from_file(path: Path) -> Credentials:
    """``user:password`` or a token on the first non-empty line of a file only its owner may read."""
    check_owner_only(path, "credentials file")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise ConfigError(f"credentials file {path} is empty: write user:password, or a bearer token, on one line")
    user, sep, secret = lines[0].partition(":")
    if not sep:
        return Credentials(None, lines[0])
    if not user or not secret:
        raise ConfigError(f"credentials file {path}: write user:password (both non-empty), or a bearer token alone")
    return Credentials(user, secret)


def tls_context(ca_bundle: Path | None) -> ssl.SSLContext | bool:
    """Certificate verification for ``dicomwebs://``: the default trust store, or ``ca_bundle`` (PEM) for a
    server whose certificate a private CA (or the server itself) signed. Verification is never off."""
    if ca_bundle is None:
        return True
    try:
        return ssl.create_default_context(cafile=str(ca_bundle))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load CA bundle {ca_bundle}: {exc}; give a PEM file of CA certificates") from None
