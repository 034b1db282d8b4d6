"""DICOM header pieces shared by every synthetic file: UIDs, patient, study, series, equipment."""

from __future__ import annotations

import datetime as dt
import hashlib
from dataclasses import dataclass
from pathlib import Path

from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import UID, ExplicitVRLittleEndian, generate_uid

from medload.errors import ConfigError

__all__ = ["Identity", "synthetic_uid", "new_dataset", "add_identity", "save"]

MANUFACTURER = "medload-synthetic"


def synthetic_uid(*parts: object) -> UID:
    """A UID derived only from ``parts``: the same parts always give the same UID."""
    return generate_uid(entropy_srcs=["medload-synthetic", *(str(p) for p in parts)])


def _digest(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()[:8], "big")


def _date(base: dt.date, span_days: int, *parts: object) -> str:
    return (base + dt.timedelta(days=_digest(*parts) % span_days)).strftime("%Y%m%d")


@dataclass(frozen=True)
class Identity:
    """Who and what a file belongs to: patient, study and series."""

    patient_id: str
    patient_name: str
    study_uid: str
    series_uid: str
    series_number: int
    modality: str
    series_description: str


def new_dataset(sop_class_uid: str, sop_instance_uid: str) -> Dataset:
    """An empty dataset with file meta (0002,xxxx), SOPClassUID (0008,0016) and SOPInstanceUID (0008,0018)."""
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = UID(sop_class_uid)
    ds.file_meta.MediaStorageSOPInstanceUID = UID(sop_instance_uid)
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SpecificCharacterSet = "ISO_IR 100"
    ds.SOPClassUID = sop_class_uid
    ds.SOPInstanceUID = sop_instance_uid
    return ds


def add_identity(ds: Dataset, ident: Identity) -> None:
    """Set the patient, general study, general series, frame of reference and equipment modules.

    PatientName/ID/BirthDate/Sex (0010,xxxx), StudyInstanceUID, StudyDate/Time, AccessionNumber,
    StudyID, ReferringPhysicianName, InstitutionName, Modality, SeriesInstanceUID, SeriesNumber,
    SeriesDescription, FrameOfReferenceUID (one per study), Manufacturer, ManufacturerModelName.
    Dates are derived from the identifiers, never from the clock, so output is reproducible.
    """
    ds.PatientName = ident.patient_name
    ds.PatientID = ident.patient_id
    ds.PatientBirthDate = _date(dt.date(1940, 1, 1), 20000, "birth", ident.patient_id)
    ds.PatientSex = "O"
    study_date = _date(dt.date(2015, 1, 1), 3000, "study", ident.study_uid)
    ds.StudyInstanceUID = ident.study_uid
    ds.StudyDate = ds.SeriesDate = ds.ContentDate = ds.AcquisitionDate = study_date
    ds.StudyTime = "093000"
    ds.SeriesTime = ds.ContentTime = ds.AcquisitionTime = f"0931{ident.series_number % 60:02d}"
    ds.AccessionNumber = f"SYNACC{_digest('accession', ident.study_uid) % 10**8:08d}"
    ds.StudyID = f"{_digest('study-id', ident.study_uid) % 10**4:04d}"
    ds.StudyDescription = "synthetic CT study"
    ds.ReferringPhysicianName = "Referrer^Synthetic"
    ds.InstitutionName = "Synthetic General Hospital"
    ds.Modality = ident.modality
    ds.SeriesInstanceUID = ident.series_uid
    ds.SeriesNumber = ident.series_number
    ds.SeriesDescription = ident.series_description
    ds.BodyPartExamined = "CHEST"
    ds.PatientPosition = "HFS"
    ds.FrameOfReferenceUID = synthetic_uid("frame-of-reference", ident.study_uid)
    ds.PositionReferenceIndicator = ""
    ds.Manufacturer = MANUFACTURER
    ds.ManufacturerModelName = "SynthCT 64"
    ds.DeviceSerialNumber = "SYN-0000001"
    ds.SoftwareVersions = "1.0"
    ds.StationName = "SYNTHCT01"


def save(ds: Dataset, path: Path) -> None:
    """Write ``ds`` as a DICOM Part 10 file, refusing to overwrite an existing file."""
    if path.exists():
        raise ConfigError(f"{path} exists already; write each series with its own seed or to an empty folder")
    ds.save_as(path, enforce_file_format=True)
