"""Headers of 4-D series told apart only by vendor tags, DimensionIndexValues or InstanceNumber, as
scanners write them (see :mod:`medload.ingest.timepoints`, :mod:`medload.ingest.vendor`), for
:func:`medload.synthetic.stacks.make_shared_positions`; and an interrupted time series.

====================  ==========================================================================  ==================
kind                  what the stacks differ by                                                   labels
====================  ==========================================================================  ==================
``ge_fmri``           GE MR: RTIA timer (0021,105E) and InstanceNumber only                       t_01, t_02...
``ge_dwi``            GE MR: b-value in (0043,1039) (b1000 with the 1e9 flag), gradient             b0, b1000_dir01...
                      (0019,10BB/BC/BD)
``siemens_dwi``       Siemens MR: B_value (0019,100C), gradient (0019,100E) acquired x, z, y       b0, b1000_dir01...
``siemens_csa``       Siemens MR: B_value and DiffusionGradientDirection of the CSA image header       b0, b1000_dir01...
                      (0029,1010) only, ImageType ``...\\DIFFUSION\\NONE``
``instance``          MR: InstanceNumber only                                                     t_01, t_02...
``tie``               MR: AcquisitionNumber 3, 1, 2..., equal AcquisitionTime; InstanceNumber      t_01, t_02...
                      in stack order (dcm2niix's order wins the tie)
====================  ==========================================================================  ==================
"""

from __future__ import annotations

import struct
from pathlib import Path

import pydicom
from pydicom.dataset import Dataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset

__all__ = ["PRIVATE_KINDS", "csa_header", "private_stack_attributes", "interrupt_time_series", "without_preamble_dicm_at_128"]

PRIVATE_KINDS = ("ge_fmri", "ge_dwi", "siemens_dwi", "siemens_csa", "instance", "tie")
#: directions of the b1000 stacks, in acquisition order: not their sorted order
SIEMENS_DIRECTIONS = ((1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (0.0, 1.0, 0.0))


def private_stack_attributes(ds: Dataset, kind: str, s: int) -> None:
    """The attributes of stack ``s`` of ``kind`` (module docstring) in single-frame MR image ``ds``."""
    if kind == "ge_fmri":
        ds.Manufacturer = "GE MEDICAL SYSTEMS"
        ds.private_block(0x0021, "GEMS_RELA_01", create=True).add_new(0x5E, "DS", f"{2.5 * s:g}")
    elif kind == "ge_dwi":
        ds.Manufacturer = "GE MEDICAL SYSTEMS"
        b = 0 if s == 0 else 1_000_001_000 if s == 1 else 1000  # the flag in the 10th digit, as GE writes
        ds.private_block(0x0043, "GEMS_PARM_01", create=True).add_new(0x39, "IS", [b, 8, 0, 0])
        block = ds.private_block(0x0019, "GEMS_ACQU_01", create=True)
        vector = (0.0, 0.0, 0.0) if s == 0 else SIEMENS_DIRECTIONS[(s - 1) % 3]
        for element, value in zip((0xBB, 0xBC, 0xBD), vector):
            block.add_new(element, "DS", f"{value:g}")
    elif kind == "siemens_dwi":
        ds.Manufacturer = "SIEMENS"
        block = ds.private_block(0x0019, "SIEMENS MR HEADER", create=True)
        block.add_new(0x0C, "IS", 0 if s == 0 else 1000)
        if s:
            block.add_new(0x0E, "FD", list(SIEMENS_DIRECTIONS[(s - 1) % 3]))
    elif kind == "siemens_csa":
        ds.Manufacturer = "SIEMENS"
        ds.ImageType = ["ORIGINAL", "PRIMARY", "DIFFUSION", "NONE"]
        elements = [("B_value", "IS", [str(0 if s == 0 else 1000)])]
        if s:
            elements.append(("DiffusionGradientDirection", "FD",
                             [f"{v:.8f}" for v in SIEMENS_DIRECTIONS[(s - 1) % 3]]))
        ds.private_block(0x0029, "SIEMENS CSA HEADER", create=True).add_new(0x10, "OB", csa_header(elements))
    elif kind == "tie":
        ds.AcquisitionNumber = (s - 1) % 3 + 1 if s else 3


def csa_header(elements: list[tuple[str, str, list[str]]]) -> bytes:
    """A Siemens CSA2 header ("SV10") holding ``(name, VR, values as text)`` elements, in the layout
    nibabel's and dcm2niix's readers parse: per element a 64-byte name, VM, VR, SyngoDT, item count; per
    item four int32 (the second its length) and its NUL-terminated text padded to 4 bytes."""
    out = [b"SV10", b"\x04\x03\x02\x01", struct.pack("<2I", len(elements), 77)]
    for name, vr, values in elements:
        out.append(struct.pack("<64si4s3i", name.encode(), len(values), vr.encode(), 0, len(values), 77))
        for value in values:
            data = value.encode() + b"\0"
            out.append(struct.pack("<4i", len(data), len(data), 77, len(data)))
            out.append(data + b"\0" * (-len(data) % 4))
    return b"".join(out)


def interrupt_time_series(paths: list[Path], n_slices: int, kept: int) -> list[Path]:
    """Make the last time point of files written by ``make_shared_positions(..., "fmri")`` incomplete, as
    a series stopped during it: keep ``kept`` of its ``n_slices`` files (the others are deleted), and give
    each time point the AcquisitionNumber a Siemens XA writes (1, 21, 41...). Returns the files left."""
    points = len(paths) // n_slices
    left = []
    for i, path in enumerate(sorted(paths)):
        t, k = divmod(i, n_slices)
        if t == points - 1 and k >= kept:
            path.unlink()
            continue
        ds = pydicom.dcmread(path)
        ds.AcquisitionNumber = 1 + 20 * t
        ds.save_as(path, enforce_file_format=True)
        left.append(path)
    return left


def without_preamble_dicm_at_128(source: Path, out: Path) -> Path:
    """A copy of DICOM file ``source`` without preamble and file meta information (a bare implicit VR
    dataset, as old exports write) whose bytes 128..132 happen to read "DICM": a value of ImageType
    (0008,0008), its first element, placed there."""
    ds = pydicom.dcmread(source)
    for tag in [e.tag for e in ds if e.tag < 0x00080008]:  # ImageType first
        del ds[tag]
    values = ["ORIGINAL", "PRIMARY", "AXIAL"]
    while 8 + len("\\".join(values)) < 128 - 16:   # 8: tag and 4-byte length of implicit VR
        values.append("OTHER_FILL_TEXT")
    head = "\\".join(values)
    values.append("X" * (128 - 8 - len(head) - 2))  # two separators before "DICM"
    values.append("DICM")
    ds.ImageType = values
    body = _bare(ds)
    if body[128:132] != b"DICM":  # the generator's own check: a bug here must not pass silently
        raise RuntimeError("without_preamble_dicm_at_128: DICM is not at byte 128")
    out.write_bytes(body)
    return out


def _bare(ds: Dataset) -> bytes:
    buf = DicomBytesIO()
    buf.is_little_endian, buf.is_implicit_VR = True, True
    write_dataset(buf, ds)
    return buf.getvalue()
