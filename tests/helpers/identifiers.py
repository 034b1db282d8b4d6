"""Patient identifiers in DICOM files and how to find them in bytes: the attributes the privacy tests
(tests/project/test_privacy.py) and the nnU-Net export's (tests/export/test_nnunet_export.py) search for."""

from __future__ import annotations

import re
from pathlib import Path

import pydicom

#: PS3.15 E.1-1 attributes a CT header commonly carries, besides the four UIDs checked separately.
IDENTIFYING = ("PatientName", "PatientID", "PatientBirthDate", "AccessionNumber", "InstitutionName",
               "InstitutionAddress", "StationName", "DeviceSerialNumber", "OperatorsName",
               "ReferringPhysicianName", "PerformingPhysicianName", "StudyID", "OtherPatientIDs")
UIDS = ("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID", "FrameOfReferenceUID")


def _dicom_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(("LICENSE", "README")))


def _raw_values(files: list[Path], keywords: tuple[str, ...]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in files:
        ds = pydicom.dcmread(path, stop_before_pixels=True)
        for keyword in keywords:
            value = ds.get(keyword)
            text = "\\".join(map(str, value)) if isinstance(value, pydicom.multival.MultiValue) else str(value or "")
            if text:
                found.setdefault(keyword, set()).add(text)
    return found


def _pattern(secret: str) -> re.Pattern[bytes]:
    """The bytes of ``secret``; one made of hex digits only (the sample's StudyID is 2157) must also not
    be part of a longer run of hex digits, where a pseudonym or digest would hold it by chance (a four-digit
    secret sits in some hex pseudonym of a run about one time in thirty)."""
    body = re.escape(secret.encode())
    if re.fullmatch(r"[0-9A-Fa-f]+", secret):
        return re.compile(rb"(?<![0-9A-Fa-f])" + body + rb"(?![0-9A-Fa-f])")
    return re.compile(body)
