"""The Modality LUT Sequence (0028,3000): stored values to modality values through a table.

An image may map its stored values with a lookup table instead of RescaleSlope/Intercept (PS3.3
C.11.1). medload applies it as pydicom's ``apply_modality_lut`` does: LUTDescriptor (0028,3002) gives
the number of entries (0 means 65536), the first stored value mapped (signed when PixelRepresentation
is 1) and the bits per entry (8 or 16); a stored value below the first mapped one takes the first
entry, one past the table the last. When the LUT is present the rescale attributes are ignored, as
pydicom does. A table that cannot be applied as written -- several items, a descriptor without three
values, LUTData (0028,3006) of another length than the descriptor says, entries wider than their bits
-- rejects the image at the header stage, naming what is wrong: its values would otherwise be guesses.
"""

from __future__ import annotations

import struct

import numpy as np
from pydicom.dataset import Dataset

from medload.errors import InputProblem

__all__ = ["read_modality_lut", "apply_modality_lut", "lut_range"]

_WHAT = "Modality LUT Sequence (0028,3000)"


def _refuse(why: str) -> InputProblem:
    return InputProblem("header", f"{_WHAT} {why}: it cannot be applied, and its stored values are not "
                                  "modality values; fix or drop the LUT")


def read_modality_lut(ds: Dataset) -> tuple[int, bytes] | None:
    """``(first mapped stored value, entries as little-endian uint16 bytes)``, or None without a LUT.
    Raises :class:`InputProblem` for a LUT that cannot be applied."""
    seq = ds.get("ModalityLUTSequence")
    if not seq:
        return None
    if len(seq) != 1:
        raise _refuse(f"has {len(seq)} items, not one")
    item = seq[0]
    descriptor = list(item.get("LUTDescriptor") or [])
    if len(descriptor) != 3 or "LUTData" not in item:
        raise _refuse("needs LUTDescriptor (0028,3002) with 3 values and LUTData (0028,3006)")
    entries, first, bits = (int(v) for v in descriptor)
    entries = entries or 1 << 16
    if int(ds.get("PixelRepresentation", 0) or 0) == 1 and first >= 1 << 15:
        first -= 1 << 16  # the second value is SS for signed pixel data
    if bits not in (8, 16):
        raise _refuse(f"has {bits}-bit entries (LUTDescriptor), not 8 or 16")
    raw = item.LUTData
    if isinstance(raw, bytes):  # OW: words in the file's byte order
        order = "<" if ds.original_encoding[1] is not False else ">"
        if len(raw) != 2 * entries:
            raise _refuse(f"LUTData holds {len(raw) // 2} entries, LUTDescriptor says {entries}")
        data = np.asarray(struct.unpack(f"{order}{entries}H", raw), dtype=np.uint16)
    else:
        values = [raw] if isinstance(raw, int) else list(raw)
        if len(values) != entries:
            raise _refuse(f"LUTData holds {len(values)} entries, LUTDescriptor says {entries}")
        data = np.asarray(values, dtype=np.int64)
    if data.size and (data.min() < 0 or data.max() >= 1 << bits):
        raise _refuse(f"has entries up to {int(data.max())}, beyond its {bits} bits")
    return first, data.astype("<u2").tobytes()


def apply_modality_lut(stored: np.ndarray, lut: tuple[int, bytes]) -> np.ndarray:
    """Modality values (uint16) of ``stored`` through ``lut`` (from :func:`read_modality_lut`)."""
    first, data = lut
    table = np.frombuffer(data, dtype="<u2")
    index = np.clip(stored.astype(np.int64) - first, 0, len(table) - 1)
    return table[index]


def lut_range(lut: tuple[int, bytes]) -> tuple[int, int]:
    """Smallest and largest value the table can give."""
    table = np.frombuffer(lut[1], dtype="<u2")
    return int(table.min()), int(table.max())
