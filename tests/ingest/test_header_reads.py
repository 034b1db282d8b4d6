"""How the header pass reads a file (medload.ingest.headers): a small file at once, else its first bytes
(the head) in memory, and the whole file, bounded by its size, when the header goes on past them. A
damaged length never makes it allocate what the element declares, and the header read is the same
wherever Pixel Data (7FE0,0010) falls against the end of the head."""

from __future__ import annotations

import io
import tracemalloc
from pathlib import Path

import pydicom
import pytest

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import InputProblem
from medload.ingest.discover import SourceRef
from medload.ingest.headers import _HEAD, SliceHeader, read_headers
from medload.synthetic import SeriesSpec, make_series

PSEUDO = Pseudonymizer(b"k" * 32)
PRIVATE = 0x00091001  # an OB element of a private group, put before Pixel Data


def _header(path: Path) -> SliceHeader:
    (header,) = read_headers(SourceRef(str(path), None, path.stat().st_size), PSEUDO, IngestConfig())
    return header


def _with_private(source: Path, value: bytes) -> bytes:
    ds = pydicom.dcmread(source)
    ds.add_new(0x00090010, "LO", "MEDLOAD TEST")
    ds.add_new(PRIVATE, "OB", value)
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()


@pytest.mark.parametrize("rows", [32, 512])  # a file read at once; a file larger than the head
def test_an_element_declaring_4_gb_is_refused_without_allocating_it(tmp_path, rows):
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=1, rows=rows, cols=rows), seed=3)
    data = _with_private(gen.paths[0], b"abcd")
    at = data.index(b"\x09\x00\x01\x10OB\0\0") + 8
    path = tmp_path / "huge.dcm"
    path.write_bytes(data[:at] + (0xFFFFFFF0).to_bytes(4, "little") + data[at + 4 :])
    assert (path.stat().st_size > _HEAD) == (rows == 512)
    tracemalloc.start()
    try:
        with pytest.raises(InputProblem) as info:
            _header(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.reason == (f"truncated file: element (0009,1001) declares 4294967280 bytes, the file holds "
                                 f"{len(data) - at - 4}")
    assert peak < 4 * len(data) + (1 << 20)


def test_the_header_is_the_same_wherever_pixel_data_falls_against_the_head(tmp_path):
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=1, rows=512, cols=512), seed=4)
    reference = _header(gen.paths[0])
    short = _with_private(gen.paths[0], b"")
    pixel_tag = short.rindex(b"\xe0\x7f\x10\x00")
    for end in range(_HEAD - 24, _HEAD + 8, 2):  # where the 12 bytes of the Pixel Data element end
        path = tmp_path / f"end{end}.dcm"
        path.write_bytes(_with_private(gen.paths[0], bytes(end - 12 - pixel_tag)))
        header = _header(path)
        assert header.pixel_offset == end
        assert header._replace(ref=reference.ref, file_size=reference.file_size,
                               pixel_offset=reference.pixel_offset) == reference
