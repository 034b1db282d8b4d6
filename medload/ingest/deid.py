"""Keyed pseudonyms for patient, study, series and instance identities (DICOM PS3.15 Annex E spirit).

Raw identifiers (PatientID, UIDs) are replaced by HMAC-SHA256 pseudonyms in the process that parses
the header, so they never reach the index, the records, the writer or the logs. The key lives outside
the store (``--key-file``, ``MEDLOAD_KEY_FILE``, default ``~/.config/medload/pseudonym.key``, created
0600 on first use); the store records only a fingerprint of it, so the same key gives the same
pseudonyms and series keys on every machine, and a store refuses a different key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from medload.errors import ConfigError

__all__ = ["Pseudonymizer", "load_key", "default_key_path"]

log = logging.getLogger(__name__)

_KEY_BYTES = 32
_PSEUDONYM_BYTES = 16


def default_key_path() -> Path:
    """``$MEDLOAD_KEY_FILE`` if set, else ``~/.config/medload/pseudonym.key``."""
    env = os.environ.get("MEDLOAD_KEY_FILE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "medload" / "pseudonym.key"


def load_key(path: str | os.PathLike | None = None, *, create: bool = True) -> bytes:
    """Read the pseudonymisation key (32 random bytes, stored as 64 hex digits), creating it if allowed."""
    path = Path(path) if path is not None else default_key_path()
    if not path.exists():
        if not create:
            raise ConfigError(f"pseudonymisation key {path} does not exist: pass the key the store was built with")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(_KEY_BYTES) + "\n")
        log.warning("created a new pseudonymisation key at %s: keep it (and back it up) outside the store", path)
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise ConfigError(f"{path} is not a medload key (expected {2 * _KEY_BYTES} hex digits)") from None
    if len(key) < 16:
        raise ConfigError(f"key in {path} is only {len(key)} bytes: use at least 16 random bytes")
    return key


class Pseudonymizer:
    """Maps identifiers to stable keyed pseudonyms (32 hex digits)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @property
    def fingerprint(self) -> str:
        """A short public fingerprint of the key (recorded in ``store.json``)."""
        return self._digest("fingerprint", "medload")[:16]

    def _digest(self, kind: str, value: str) -> str:
        msg = f"{kind}\x00{value}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).digest()[:_PSEUDONYM_BYTES].hex()

    def patient(self, patient_id: str, issuer: str = "") -> str:
        """Pseudonym of PatientID (0010,0020) qualified by IssuerOfPatientID (0010,0021)."""
        return self._digest("patient", f"{issuer}\x00{patient_id}")

    def uid(self, kind: str, uid: str) -> str:
        """Pseudonym of a UID of the given kind (``study``, ``series``, ``instance``, ``frame_of_reference``)."""
        return self._digest(kind, uid)
