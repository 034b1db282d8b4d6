"""Fast, tolerant, checked access to header attributes.

The header pass reads about 35 attributes of every file, so it reads pydicom's *raw* elements
(``Dataset.get_item``) and decodes their bytes here -- ASCII text split on backslashes, or fixed-size
binary numbers -- which is several times cheaper than pydicom's general value conversion. Non-ASCII
text and already-converted elements go through pydicom as usual.

Real archives hold malformed values (a DS with stray characters, an IS with a decimal point, a vector
with the wrong number of values). These accessors return clean Python values, or raise
:class:`InputProblem` naming the attribute, its tag and the value -- never a bare pydicom error.
"""

from __future__ import annotations

import math
import struct
from functools import cache
from typing import Any, overload

from pydicom.datadict import dictionary_VR, tag_for_keyword
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.multival import MultiValue
from pydicom.tag import BaseTag, Tag

from medload.errors import InputProblem

__all__ = ["present", "text", "strings", "integer", "decimal", "vector", "window_pairs"]

#: binary VR -> (struct format of one value, its size)
_BINARY = {vr: (fmt, struct.calcsize(fmt)) for vr, fmt in
           {"US": "H", "SS": "h", "UL": "I", "SL": "i", "FL": "f", "FD": "d", "US or SS": "H"}.items()}


@cache
def _info(keyword: str) -> tuple[BaseTag, str, str]:
    """The tag (a BaseTag, which pydicom's lookups take as it is), dictionary VR and label of a keyword."""
    tag = tag_for_keyword(keyword)
    if tag is None:  # keywords are medload's own constants: a misspelt one is a bug, not bad input
        raise ValueError(f"{keyword!r} is not a keyword of pydicom's DICOM data dictionary")
    return Tag(tag), dictionary_VR(tag), f"{keyword} ({tag >> 16:04X},{tag & 0xFFFF:04X})"


def _values(ds: Dataset, keyword: str) -> list | None:
    """The values of an attribute as a list (strings for text VRs, numbers for binary ones), or None."""
    tag, dict_vr, label = _info(keyword)
    elem = ds.get_item(tag)
    if elem is None:
        return None
    value = elem.value
    if isinstance(elem, RawDataElement) and isinstance(value, bytes):
        vr = elem.VR or dict_vr
        binary = _BINARY.get(vr)
        if binary is not None:
            fmt, size = binary
            if len(value) % size:
                raise InputProblem("header", f"{label} has {len(value)} bytes, not a multiple of {size}")
            order = "<" if elem.is_little_endian else ">"
            return list(struct.unpack(f"{order}{len(value) // size}{fmt}", value))
        try:
            decoded = value.decode("ascii")
        except UnicodeDecodeError:
            try:
                value = ds[tag].value  # pydicom applies SpecificCharacterSet
            except Exception as exc:
                raise InputProblem("header", f"{label} cannot be read: {exc}") from None
        else:
            decoded = decoded.strip("\x00 ")
            return [v.strip() for v in decoded.split("\\")] if decoded else None
    if value is None or value == "":
        return None
    if isinstance(value, (MultiValue, list, tuple)):
        return [str(v) if not isinstance(v, (int, float)) else v for v in value]
    return [value if isinstance(value, (int, float)) else str(value)]


def present(ds: Dataset, keyword: str) -> bool:
    """``keyword in ds``, with the keyword looked up once per process rather than at every call."""
    return _info(keyword)[0] in ds


def _label(keyword: str) -> str:
    return _info(keyword)[2]


def text(ds: Dataset, keyword: str) -> str | None:
    """The value as one stripped string (multiple values joined by backslashes); None when absent."""
    values = _values(ds, keyword)
    if not values:
        return None
    joined = "\\".join(str(v).strip() for v in values).strip("\\ ")
    return joined or None


def strings(ds: Dataset, keyword: str) -> tuple[str, ...]:
    """All values of a (possibly multi-valued) string attribute, upper-cased and stripped."""
    return tuple(str(v).strip().upper() for v in (_values(ds, keyword) or ()))


def _number(keyword: str, value: Any) -> float:  # a header value of any VR
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise InputProblem("header", f"{_label(keyword)} is {value!r}, not a number") from None
    if not math.isfinite(x):
        raise InputProblem("header", f"{_label(keyword)} is {value!r}, not a finite number")
    return x


@overload
def integer(ds: Dataset, keyword: str, *, default: int) -> int: ...
@overload
def integer(ds: Dataset, keyword: str, *, default: None) -> int | None: ...
def integer(ds: Dataset, keyword: str, *, default: int | None) -> int | None:
    """An integer value (IS, US, SS...); ``default`` when absent."""
    values = _values(ds, keyword)
    if not values:
        return default
    x = _number(keyword, values[0])
    if x != int(x):
        raise InputProblem("header", f"{_label(keyword)} is {values[0]!r}, not an integer")
    return int(x)


def decimal(ds: Dataset, keyword: str) -> float | None:
    """A single decimal value (DS, FD...); ``None`` when absent."""
    values = _values(ds, keyword)
    return _number(keyword, values[0]) if values else None


def vector(ds: Dataset, keyword: str, n: int) -> tuple[float, ...]:
    """Exactly ``n`` finite numbers; a missing attribute is an error (the image cannot be placed)."""
    values = _values(ds, keyword)
    if not values:
        raise InputProblem("header", f"no {_label(keyword)}: the image cannot be placed in space")
    if len(values) != n:
        raise InputProblem("header", f"{_label(keyword)} has {len(values)} values, needs {n}")
    return tuple(_number(keyword, v) for v in values)


def window_pairs(ds: Dataset) -> tuple[tuple[float, float], ...]:
    """Scanner windows as unique (center, width) pairs from WindowCenter/WindowWidth (0028,1050/1051)."""
    try:
        centers = _values(ds, "WindowCenter") or []
        widths = _values(ds, "WindowWidth") or []
        return tuple(dict.fromkeys((float(c), float(w)) for c, w in zip(centers, widths)))
    except (InputProblem, TypeError, ValueError):
        return ()  # display hints only: a malformed one is dropped, never a reason to reject
