"""De-identification: keyed pseudonyms for identities, and the table of what a store keeps.

Reference: DICOM PS3.15 Annex E, Basic Application Level Confidentiality Profile. The header pass
reads only the attributes below, and replaces identities by HMAC-SHA256 pseudonyms *in the process
that parses the header*, so raw identifiers never reach the writer, the index, the records or the
logs. The key lives outside the store (``--key-file``, ``$MEDLOAD_KEY_FILE``, default
``~/.config/medload/pseudonym.key``, created 0600 on first use); the store records only a
fingerprint of it, so the same key gives the same pseudonyms and series keys on every machine, and a
store refuses a different key. ``tests/test_privacy.py`` checks this table against the records.

====================================================  =============================================
attribute (tag)                                       in the store
====================================================  =============================================
PatientID (0010,0020) + IssuerOfPatientID (0010,0021) keyed pseudonym (``patient``)
StudyInstanceUID (0020,000D)                          keyed pseudonym (``study``)
SeriesInstanceUID (0020,000E)                         keyed pseudonym (``series``, and in the key)
SOPInstanceUID (0008,0018)                            keyed pseudonym, only inside a source fingerprint
FrameOfReferenceUID (0020,0052)                       keyed pseudonym (``frame_of_reference``)
Modality, Manufacturer, ManufacturerModelName,        kept (``modality``, ``manufacturer``,
ConvolutionKernel, BodyPartExamined, ImageType,       ``model``, ``kernel``, ``body_part``,
SliceThickness, WindowCenter/WindowWidth              ``image_type``, ``slice_thickness``,
                                                      ``scanner_windows``): not identifying (PS3.15
                                                      E.1-1 lists none of them)
ImagePositionPatient, ImageOrientationPatient,        kept as geometry (``affine``, ``positions``,
PixelSpacing, pixel data                              ``orientation``, ``spacing``, slices)
ImageType/FrameType, ComplexImageComponent,           which stack of a series a volume is (``split``,
EchoTime/EffectiveEchoTime, DiffusionBValue,          ``time_series``, ``time_point``): a name such
DiffusionGradientOrientation, TemporalPosition-       as ``phase``, ``echo_2`` or ``t_07``, never the
Identifier/Index, TriggerTime, AcquisitionNumber,     values; AcquisitionDate/Time,
AcquisitionDate, AcquisitionTime,                     AcquisitionDateTime and
AcquisitionDateTime, FrameAcquisitionDateTime         FrameAcquisitionDateTime are read in memory
                                                      only, to order time points, and not kept
file and folder names of label inputs (``--labels``   path relative to the folder it was found in,
masks named after a SeriesInstanceUID, SEG/RTSTRUCT   every UID in it (digits and dots, four parts
files, mapping files' rows)                           or more) replaced by ``uid-`` and its keyed
                                                      pseudonym as a SeriesInstanceUID (``source``
                                                      of label and quarantine records, the ingest's
                                                      output and messages)
PatientName, PatientBirthDate, PatientSex/Age,        never read, never stored
AccessionNumber, every other date and time,
Institution*,
ReferringPhysician/Operators/PerformingPhysician
Name, StationName, DeviceSerialNumber,
SeriesDescription/StudyDescription (free text),
private tags
====================================================  =============================================

No date is stored, so no date shifting is needed. Quarantine records of images keep the *path* of the
file they name (what a user must act on); paths are not DICOM attributes, but a site whose folder or
file names carry patient names or UIDs should ingest from neutral paths. Label inputs are named as the
table says (see :func:`medload.ingest.labels.label_source_name`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import tempfile
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
        _create_key(path)
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise ConfigError(f"{path} is not a medload key (expected {2 * _KEY_BYTES} hex digits)") from None
    if len(key) < 16:
        raise ConfigError(f"key in {path} is only {len(key)} bytes: use at least 16 random bytes")
    return key


def _create_key(path: Path) -> None:
    """Write a new key at ``path``, unless another process creates one there first (two first-time ingests
    at once): the key is written in full to a private temporary file and hard-linked into place, which is
    atomic and never replaces an existing key, so every process reads the one whole key that won."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(_KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return  # another process's key won: read that one
        except OSError as err:  # a file system without hard links
            raise ConfigError(f"cannot create the pseudonymisation key {path}: {err.strerror}; write 64 random hex "
                              "digits to a file yourself and pass it with --key-file") from None
    finally:
        os.unlink(tmp)
    log.warning("created a new pseudonymisation key at %s: keep it (and back it up) outside the store", path)


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
