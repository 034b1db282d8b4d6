"""Files that share a folder with CT series but are not volumes: localizers, screenshots, broken files."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pydicom
from pydicom.uid import CTImageStorage, SecondaryCaptureImageStorage

from medload.errors import ConfigError
from medload.synthetic.dataset import Identity, add_identity, new_dataset, save, synthetic_uid
from medload.synthetic.phantom import phantom_hu
from medload.synthetic.pixels import set_pixel_data

__all__ = ["write_localizer", "write_secondary_capture", "write_broken_files", "add_modality_lut"]

log = logging.getLogger(__name__)


def _identity(kind: str, seed: int, study_uid: str | None, series_number: int) -> Identity:
    study_uid = study_uid or synthetic_uid("study", "SYN-0001", seed)
    series_uid = synthetic_uid(kind, study_uid, seed)
    return Identity("SYN-0001", "Doe^Synthetic", study_uid, series_uid, series_number, "CT", kind)


def write_localizer(out_dir: Path, *, seed: int, study_uid: str | None = None) -> Path:
    """Write a coronal scout: CT Image Storage with ImageType (0008,0008) ORIGINAL\\PRIMARY\\LOCALIZER.

    Unsigned 12-bit, RescaleIntercept -1024; pixels are the mean HU of a phantom along the AP axis.
    """
    rng = np.random.default_rng(seed)
    ident = _identity("localizer", seed, study_uid, 100)
    rows, cols = 64, 48
    scout = phantom_hu((rows, 32, cols), rng).mean(axis=1)
    ds = new_dataset(CTImageStorage, synthetic_uid("instance", ident.series_uid, 0))
    add_identity(ds, ident)
    ds.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
    ds.InstanceNumber = 1
    ds.AcquisitionNumber = 1
    ds.KVP = 120
    ds.ImagePositionPatient = ["-180", "0", "0"]
    ds.ImageOrientationPatient = ["1", "0", "0", "0", "0", "-1"]
    ds.PixelSpacing = ["5", "7.5"]
    ds.SliceThickness = "1"
    ds.Rows, ds.Columns = rows, cols
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.RescaleIntercept, ds.RescaleSlope, ds.RescaleType = "-1024", "1", "HU"
    ds.WindowCenter, ds.WindowWidth = "40", "400"
    set_pixel_data(ds, np.rint(scout + 1024).astype(np.uint16), ds.file_meta.TransferSyntaxUID)
    path = Path(out_dir) / f"localizer_{seed}.dcm"
    path.parent.mkdir(parents=True, exist_ok=True)
    save(ds, path)
    log.info("wrote localizer %s", path)
    return path


def write_secondary_capture(out_dir: Path, *, seed: int, study_uid: str | None = None) -> Path:
    """Write a screenshot: Secondary Capture Image Storage (1.2.840.10008.5.1.4.1.1.7), RGB 8-bit.

    Modality (0008,0060) is CT, as scanners write for their screen captures, so only the SOP class,
    SamplesPerPixel 3 and PhotometricInterpretation RGB tell an ingester it is not a CT slice.
    """
    rng = np.random.default_rng(seed)
    ident = _identity("secondary-capture", seed, study_uid, 101)
    gray = np.clip((phantom_hu((1, 64, 64), rng)[0] + 160.0) / 400.0 * 255.0, 0, 255).astype(np.uint8)
    rgb = np.repeat(gray[:, :, None], 3, axis=2)
    rgb[30:34, 8:56] = (255, 64, 0)  # an annotation line burned into the pixels
    ds = new_dataset(SecondaryCaptureImageStorage, synthetic_uid("instance", ident.series_uid, 0))
    add_identity(ds, ident)
    ds.ImageType = ["DERIVED", "SECONDARY"]
    ds.ConversionType = "WSD"
    ds.InstanceNumber = 1
    ds.BurnedInAnnotation = "YES"
    ds.Rows, ds.Columns = rgb.shape[:2]
    ds.SamplesPerPixel = 3
    ds.PhotometricInterpretation = "RGB"
    ds.PlanarConfiguration = 0
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
    ds.PixelData = rgb.tobytes()
    path = Path(out_dir) / f"secondary_capture_{seed}.dcm"
    path.parent.mkdir(parents=True, exist_ok=True)
    save(ds, path)
    log.info("wrote secondary capture %s", path)
    return path


def write_broken_files(out_dir: Path, source: Path) -> dict[str, Path]:
    """Write three files an ingester must quarantine, derived from the valid DICOM file ``source``.

    ``truncated``: a copy of ``source`` cut in the middle of PixelData (7FE0,0010); ``not_dicom``: a
    text file named like DICOM (ignored as not DICOM, with a record of its own); ``no_pixels``: ``source`` without PixelData and with a new
    SOPInstanceUID (0008,0018).
    """
    out_dir, source = Path(out_dir), Path(source)
    out_dir.mkdir(parents=True, exist_ok=True)
    ds = pydicom.dcmread(source)
    if "PixelData" not in ds:
        raise ConfigError(f"{source} has no PixelData to cut")
    raw = source.read_bytes()
    little_endian = ds.original_encoding[1]
    tag = b"\xe0\x7f\x10\x00" if little_endian else b"\x7f\xe0\x00\x10"
    start = raw.find(tag)
    if start < 0:
        raise ConfigError(f"cannot find the PixelData element in {source}")
    paths = {name: out_dir / f"broken_{name}.dcm" for name in ("truncated", "not_dicom", "no_pixels")}
    for path in paths.values():
        if path.exists():
            raise ConfigError(f"{path} exists already")
    paths["truncated"].write_bytes(raw[: start + (len(raw) - start) // 2])
    paths["not_dicom"].write_text("This is not a DICOM file: it is a note left in an export folder.\n")
    del ds.PixelData
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = synthetic_uid("no-pixels", ds.SOPInstanceUID)
    save(ds, paths["no_pixels"])
    log.info("wrote broken files %s", ", ".join(str(p) for p in paths.values()))
    return paths


def add_modality_lut(path: Path, table: np.ndarray, first_mapped: int = 0, *, words: bool = True,
                     entries: int | None = None) -> None:
    """Give the image at ``path`` a Modality LUT Sequence (0028,3000) mapping stored value
    ``first_mapped + i`` to ``table[i]`` (16-bit entries; LUTData as OW ``words``, else US), in place of
    its RescaleSlope/Intercept. ``entries`` overrides the count LUTDescriptor declares (to write a broken one)."""
    ds = pydicom.dcmread(path)
    item = pydicom.Dataset()
    count = len(table) if entries is None else entries
    item.LUTDescriptor = [count % 65536, first_mapped % 65536 if ds.PixelRepresentation else first_mapped, 16]
    item.ModalityLUTType = "US"
    data = np.asarray(table, dtype=np.uint16)
    if words:
        item.add_new("LUTData", "OW", data.astype("<u2").tobytes())
    else:
        item.add_new("LUTData", "US", [int(v) for v in data])
    ds.ModalityLUTSequence = [item]
    for keyword in ("RescaleSlope", "RescaleIntercept", "RescaleType"):
        if keyword in ds:
            delattr(ds, keyword)
    ds.save_as(path, enforce_file_format=True)
