"""De-identification: keyed pseudonyms for identities, and the table of what a store keeps.

Reference: DICOM PS3.15 Annex E, Basic Application Level Confidentiality Profile. The header pass
reads only the attributes below, and replaces identities by HMAC-SHA256 pseudonyms *in the process
that parses the header*, so raw identifiers never reach the writer, the index, the records or the
logs. The key lives outside the store (``--key-file``, ``$MEDLOAD_KEY_FILE``, default
``~/.config/medload/pseudonym.key``, created 0600 on the first ingest into a new store; a given path
only with ``--new-key``), readable by its owner alone; the store records only a fingerprint of it, so
the same key gives the same pseudonyms and series keys on every machine, and a store refuses a
different key (see :func:`load_key`). ``tests/project/test_privacy.py`` checks this table against the records.

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
InstanceNumber, DimensionIndexValues with             read in memory only, to order and split
DimensionIndexSequence; GE RTIA timer (0021,105E)     stacks at the same positions
                                                      (:mod:`medload.ingest.timepoints`), not kept
DiffusionBValue, DiffusionGradientOrientation;        kept for diffusion stacks (``b_value``,
GE (0043,1039), (0019,10BB/BC/BD); Siemens            ``gradient``, ``gradient_image``): acquisition
(0019,100C/100E), CSA B_value and                     parameters, not identifying
DiffusionGradientDirection
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
every other private tag
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
from dataclasses import dataclass
from pathlib import Path

from medload.errors import ConfigError
from medload.owner_only import check_owner_only

__all__ = ["Pseudonymizer", "KeyFile", "load_key", "create_key", "default_key_path", "check_key_fingerprint"]

log = logging.getLogger(__name__)

_KEY_BYTES = 32
_PSEUDONYM_BYTES = 16


@dataclass(frozen=True)
class KeyFile:
    """Which pseudonymisation key to use, and what medload may do about it (``--key-file``, ``--new-key``,
    ``--allow-shared-key``).

    Attributes:
        path: the key file; None: ``$MEDLOAD_KEY_FILE`` if set, else ``~/.config/medload/pseudonym.key``.
        new: create a new key at a given path (``path`` or ``$MEDLOAD_KEY_FILE``) where no file is, in a
            folder that exists (a file there is used as it is). Without it a given path that does not exist
            is an error, so that a typo never starts new pseudonyms; only the default path is created
            unasked, on the first ingest into a new store.
        allow_shared: use a key file other users may read, with a warning (else refused, as for credentials).
    """

    path: str | os.PathLike | None = None
    new: bool = False
    allow_shared: bool = False


def default_key_path() -> Path:
    """``$MEDLOAD_KEY_FILE`` if set, else ``~/.config/medload/pseudonym.key``."""
    env = os.environ.get("MEDLOAD_KEY_FILE")
    return Path(env) if env else _default_path()


def _default_path() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "medload" / "pseudonym.key"


def load_key(key_file: str | os.PathLike | KeyFile | None = None, *, store: str | os.PathLike | None = None,
             recorded: str | None = None, create: bool = True) -> bytes:
    """Read the pseudonymisation key (32 random bytes, stored as 64 hex digits), creating it where allowed.

    A missing key is created only at the default path, or at a given one with ``KeyFile(new=True)``
    (see :class:`KeyFile`), and never for a store that records a key fingerprint (``recorded``: a new key
    could not match the one it was built with) or with ``create=False``. A key file others may read is
    refused (``chmod 600``) unless ``KeyFile(allow_shared=True)``. A key whose fingerprint is not
    ``recorded`` is refused; ``store`` names the store in the messages. For a store on disk,
    :func:`medload.storage.store_key.load_store_key` reads ``recorded`` from it.
    """
    wanted = key_file if isinstance(key_file, KeyFile) else KeyFile(key_file)
    path = Path(wanted.path) if wanted.path is not None else default_key_path()
    given = "--key-file" if wanted.path is not None else "$MEDLOAD_KEY_FILE" if path != _default_path() else None
    root = Path(store) if store is not None else "the store"
    if not path.exists():
        if recorded is not None:
            raise ConfigError(f"{root} was built with pseudonymisation key {recorded}, and there is no key file "
                              f"at {path}: pass the store's key with --key-file (or MEDLOAD_KEY_FILE); a new key "
                              "could never match the store, so none was created")
        if not create:
            raise ConfigError(f"pseudonymisation key {path} does not exist: pass the key the store was built with")
        if given is not None and not wanted.new:
            raise ConfigError(f"pseudonymisation key {path} (from {given}) does not exist: check the path (a new key "
                              "would give every patient new pseudonyms); to start a new key there, add --new-key")
        if given is None:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        create_key(path)
    check_owner_only(path, "pseudonymisation key", shared_option="--allow-shared-key",
                     allow_shared=wanted.allow_shared)
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise ConfigError(f"{path} is not a medload key (expected {2 * _KEY_BYTES} hex digits)") from None
    if len(key) < 16:
        raise ConfigError(f"key in {path} is only {len(key)} bytes: use at least 16 random bytes")
    if recorded is not None:
        check_key_fingerprint(root, recorded, Pseudonymizer(key).fingerprint, path)
    return key


def check_key_fingerprint(store: str | os.PathLike, recorded: str, used: str, key: Path | None = None) -> None:
    """Refuse a pseudonymisation key (of fingerprint ``used``, read from ``key``) other than the one ``store``
    was built with (``recorded``): the same patient would get two pseudonyms in one store."""
    if used != recorded:
        where = f" (the key in {key})" if key is not None else ""
        raise ConfigError(f"{store} was built with pseudonymisation key {recorded}, this run uses {used}{where}: "
                          "pass the store's key with --key-file (or MEDLOAD_KEY_FILE)")


def create_key(path: str | os.PathLike) -> Path:
    """Write a new key at ``path``, in a folder that must exist, unless a file is there (kept as it is: two
    first-time ingests at once, or a rerun): the key is written in full to a private temporary file and
    hard-linked into place, which is atomic and never replaces an existing key, so every process reads the
    one whole key that won."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"cannot create the pseudonymisation key {path}: the folder {path.parent} does not exist; "
                          "check the path, or create the folder first (mkdir -m 700)")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(_KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return path  # another process's key won: read that one
        except OSError as err:  # a file system without hard links
            raise ConfigError(f"cannot create the pseudonymisation key {path}: {err.strerror}; write 64 random hex "
                              "digits to a file yourself (mode 0600) and pass it with --key-file") from None
    finally:
        os.unlink(tmp)
    log.warning("created a new pseudonymisation key at %s: keep it (and back it up) outside the store", path)
    return path


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
