"""Vendor private tags whose meaning is public, read where the standard attributes are absent.

Only what tells stacks at the same positions apart (:mod:`medload.ingest.splits`), each checked
against its private creator (PS3.5 7.8.1) so another vendor's element at the same number is never read:

- GE (``GEMS_PARM_01``): the b-value is the first value of (0043,1039) (a value of 1e9 or more carries
  a flag in its 10th digit: the b-value is its remainder modulo 1e9, as dcm2niix reads it);
  (``GEMS_ACQU_01``) the diffusion gradient (0019,10BB/10BC/10BD), in the scanner's image frame;
  (``GEMS_RELA_01``) the RTIA timer (0021,105E), seconds since the start of the acquisition.
- Siemens (``SIEMENS MR HEADER``): B_value (0019,100C) and DiffusionGradientDirection (0019,100E),
  in the patient frame (LPS), else -- for a diffusion image (ImageType (0008,0008) holds ``DIFFUSION``)
  -- the same two entries of the CSA image header (0029,1010), read with nibabel's CSA reader.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from pydicom.dataelem import DataElement, RawDataElement
from pydicom.dataset import Dataset

from medload.ingest import tags

__all__ = ["VendorValues", "vendor_values"]

_GE_B_VALUE = (0x0043, 0x39, "GEMS_PARM_01")
_GE_GRADIENT = tuple((0x0019, e, "GEMS_ACQU_01") for e in (0xBB, 0xBC, 0xBD))
_GE_RTIA = (0x0021, 0x5E, "GEMS_RELA_01")
_SIEMENS_B_VALUE = (0x0019, 0x0C, "SIEMENS MR HEADER")
_SIEMENS_GRADIENT = (0x0019, 0x0E, "SIEMENS MR HEADER")
_CSA_IMAGE = (0x0029, 0x10, "SIEMENS CSA HEADER")


@dataclass(frozen=True)
class VendorValues:
    """What a vendor's private tags say: ``diffusion`` as ``"b-value|gx\\gy\\gz"`` (``""`` when absent),
    ``gradient_frame`` (``"patient"`` or ``"image"``) and ``time`` (GE's RTIA timer, seconds, ``""``)."""

    diffusion: str = ""
    gradient_frame: str = ""
    time: str = ""


def _element(ds: Dataset, group: int, offset: int, creator: str) -> RawDataElement | DataElement | None:
    """The private element ``(group, xx<offset>)`` of the block reserved by ``creator``, or None. Only
    blocks 0x10-0x2F are looked at: scanners reserve the first few."""
    for block in range(0x10, 0x30):
        owner = ds.get_item((group << 16) | block)
        if owner is None:
            continue
        value = owner.value
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        if text.strip("\x00 ").upper() == creator:
            return ds.get_item((group << 16) | (block << 8) | offset)
    return None


def _texts(ds: Dataset, where: tuple[int, int, str]) -> list[str]:
    elem = _element(ds, *where)
    value = getattr(elem, "value", None)
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value is None:
        return []
    if not isinstance(value, str) and isinstance(value, Iterable):  # a converted multi-valued element
        return [str(v).strip() for v in value]
    return [v.strip("\x00 ") for v in str(value).split("\\")]


def _doubles(ds: Dataset, where: tuple[int, int, str], n: int) -> list[float] | None:
    """``n`` FD values (Siemens writes them binary, also in explicit VR files as UN), or None."""
    elem = _element(ds, *where)
    value = getattr(elem, "value", None)
    if isinstance(value, bytes) and len(value) == 8 * n:
        return list(struct.unpack(f"<{n}d", value))
    if not isinstance(value, (str, bytes)) and isinstance(value, Iterable) and len(values := list(value)) == n:
        return [float(v) for v in values]
    return None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _format(b_value: float, gradient: list[float] | None) -> str:
    direction = "\\".join(f"{v:g}" for v in gradient) if gradient is not None and any(gradient) else ""
    return f"{b_value:g}|{direction}"


def _ge(ds: Dataset) -> VendorValues:
    b_texts = _texts(ds, _GE_B_VALUE)
    b_value = _number(b_texts[0]) if b_texts else None
    timer = _texts(ds, _GE_RTIA)
    seconds = _number(timer[0]) if timer else None
    time = "" if seconds is None else f"{seconds:g}"
    if b_value is None:
        return VendorValues(time=time)
    gradient = [_number(t[0]) if (t := _texts(ds, where)) else None for where in _GE_GRADIENT]
    vector = [v for v in gradient if v is not None]
    return VendorValues(_format(b_value % 1e9, vector if len(vector) == 3 else None), "image", time)


def _siemens(ds: Dataset) -> VendorValues:
    b_texts = _texts(ds, _SIEMENS_B_VALUE)
    if b_texts and (b_value := _number(b_texts[0])) is not None:
        return VendorValues(_format(b_value, _doubles(ds, _SIEMENS_GRADIENT, 3)), "patient")
    return _csa(ds) if "DIFFUSION" in tags.strings(ds, "ImageType") else VendorValues()


def _csa(ds: Dataset) -> VendorValues:
    """B_value and DiffusionGradientDirection of the CSA image header, through nibabel's reader."""
    elem = _element(ds, *_CSA_IMAGE)
    value = getattr(elem, "value", None)
    if not isinstance(value, bytes):
        return VendorValues()
    with warnings.catch_warnings():  # nibabel calls its DICOM readers experimental on import
        warnings.simplefilter("ignore", UserWarning)
        from nibabel.nicom import csareader  # only for Siemens diffusion images without (0019,100C)
    try:
        csa = csareader.read(value)
        b_value = csareader.get_b_value(csa)
        vector = csareader.get_g_vector(csa)
    except Exception:  # a damaged private header is no reason to refuse the image: it is not read
        return VendorValues()
    if b_value is None:
        return VendorValues()
    return VendorValues(_format(float(b_value), None if vector is None else [float(v) for v in vector]), "patient")


def vendor_values(ds: Dataset) -> VendorValues:
    """The private values of an MR image ``ds`` for its Manufacturer (0008,0070); none for other modalities."""
    if (tags.text(ds, "Modality") or "").upper() != "MR":
        return VendorValues()
    maker = (tags.text(ds, "Manufacturer") or "").upper()
    if maker.startswith("GE"):
        return _ge(ds)
    if maker.startswith("SIEMENS"):
        return _siemens(ds)
    return VendorValues()
