"""Compressed frames cut short are refused, never decoded into made-up pixels (medload.ingest.codestreams,
medload.ingest.encapsulated): every compressed transfer syntax, cuts at 50-99 %, with and without the
end marker put back; offset tables that disagree with the fragments; a codestream too small for the
pixels it declares. And no valid image of any syntax is refused."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pydicom
import pytest
from helpers.codestream_files import KINDS, encode, to_bytes, write_series
from pydicom.encaps import encapsulate, generate_frames
from pydicom.uid import JPEGLSLossless

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import InputProblem
from medload.ingest.discover import SourceRef
from medload.ingest.headers import read_headers
from medload.ingest.labels import LabelInput
from medload.ingest.pixels import LoadedFile, decode_plane
from medload.synthetic import SeriesSpec, make_series
from medload.synthetic.broken import cut_codestream, truncate

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "scans"
LOSSLESS_JPEG = DATA / "transfer_syntaxes" / "In" / "5.dcm"   # JPEG Lossless SV1, a real Siemens file
FRACTIONS = (0.5, 0.75, 0.9, 0.95, 0.99)
PSEUDO = Pseudonymizer(b"k" * 32)


def _planes(path: Path) -> list[np.ndarray]:
    """What the ingest makes of ``path``: its planes decoded (none for a SEG), or the InputProblem it raises."""
    headers = read_headers(SourceRef(str(path), None, path.stat().st_size), PSEUDO, IngestConfig())
    if isinstance(headers, LabelInput):
        return []
    file = LoadedFile(path.read_bytes())
    return [decode_plane(file, h, h.modality, "int16")[0] for h in headers]


@pytest.fixture(scope="module")
def slices(tmp_path_factory) -> dict[str, tuple[bytes, np.ndarray]]:
    """kind -> (one encoded 64 x 64 slice, its stored ground truth), plus the real lossless JPEG file."""
    root = tmp_path_factory.mktemp("slices")
    out = {}
    for kind in KINDS:
        gen = make_series(root / kind, SeriesSpec(n_slices=1, rows=64, cols=64), seed=3)
        ds = pydicom.dcmread(gen.paths[0])
        encode(ds, kind)
        out[kind] = (to_bytes(ds), gen.hu[0])
    out["jpeg_lossless"] = (LOSSLESS_JPEG.read_bytes(), np.empty(0))
    return out


def _cases() -> list[tuple[str, float, bytes]]:
    cases = []
    for kind, (_, _, end) in [*KINDS.items(), ("jpeg_lossless", (None, True, b"\xff\xd9"))]:
        for fraction in FRACTIONS:
            cases += [(kind, fraction, b"")] + ([(kind, fraction, end)] if end else [])
    return cases


@pytest.mark.parametrize(("kind", "fraction", "end"), _cases(),
                         ids=[f"{k}-{int(f * 100)}{'-end' if e else ''}" for k, f, e in _cases()])
def test_a_codestream_cut_short_is_refused(slices, tmp_path, kind, fraction, end):
    data = slices[kind][0]
    path = tmp_path / "cut.dcm"
    path.write_bytes(truncate(data, int(len(data) * fraction)) if kind == "deflated"
                     else cut_codestream(data, fraction, end))
    with pytest.raises(InputProblem) as err:
        _planes(path)
    assert err.value.stage in ("header", "decode") and err.value.reason


def test_the_reason_says_what_happened(slices, tmp_path):
    path = tmp_path / "cut.dcm"
    path.write_bytes(cut_codestream(slices["jpegls_lossless"][0], 0.9, b"\xff\xd9"))
    with pytest.raises(InputProblem, match="ends before its image does: the decoder .* made up the missing pixels"):
        _planes(path)
    path.write_bytes(cut_codestream(slices["jpeg_baseline"][0], 0.9))
    with pytest.raises(InputProblem, match="ends inside scan 1, without the marker that closes it: truncated"):
        _planes(path)
    path.write_bytes(cut_codestream(slices["jpeg_baseline_restarts"][0], 0.5, b"\xff\xd9"))
    with pytest.raises(InputProblem, match=r"holds \d+ restart markers; 64 MCUs in intervals of 5 need 12"):
        _planes(path)


@pytest.mark.parametrize("kind", [*KINDS, "jpeg_lossless"])
def test_every_valid_syntax_decodes_and_lossless_ones_exactly(slices, tmp_path, kind):
    data, truth = slices[kind]
    path = tmp_path / "ok.dcm"
    path.write_bytes(data)
    (plane,) = _planes(path)
    if kind in KINDS and KINDS[kind][1]:
        assert np.array_equal(plane, truth)
    assert plane.std() > 0


def test_no_image_in_the_test_data_is_refused():
    """Every image of every transfer syntax in tests/scans and sample_data passes the checks."""
    paths = [p for folder in (DATA, ROOT / "sample_data") for p in sorted(folder.rglob("*"))
             if p.is_file() and p.read_bytes()[128:132] == b"DICM"]
    decoded, refused = 0, []
    for path in paths:
        try:
            decoded += len(_planes(path))
        except InputProblem as exc:
            refused += [] if exc.skipped else [(path, exc.reason)]
    assert not refused
    assert decoded >= 45


def test_an_offset_table_out_of_order_is_refused(tmp_path):
    """Frames 2 and 3 listed the wrong way round: pydicom would decode each from the other's fragment."""
    (path,) = make_series(tmp_path / "mf", SeriesSpec(n_slices=3, rows=64, cols=64, multiframe=True,
                                                       transfer_syntax=JPEGLSLossless), seed=1).paths
    ds = pydicom.dcmread(path)
    frames = list(generate_frames(ds.PixelData, number_of_frames=3))
    table = bytearray(ds.PixelData)
    first, second, third = struct.unpack("<3I", table[8:20])
    table[8:20] = struct.pack("<3I", first, third, second)
    ds.PixelData = bytes(table)
    path.write_bytes(to_bytes(ds))
    with pytest.raises(InputProblem, match=r"Basic Offset Table puts frame 3 at byte \d+, before frame 2"):
        _planes(path)
    ds.PixelData = encapsulate(frames)  # the same frames, a table that agrees with them
    path.write_bytes(to_bytes(ds))
    assert len(_planes(path)) == 3


def _jpeg_declaring(data: bytes, size: int, rows_columns: int) -> bytes:
    """The JPEG slice ``data`` with its SOF0 saying ``size`` x ``size`` and Rows/Columns ``rows_columns``."""
    ds = pydicom.dcmread(io.BytesIO(data))
    (frame,) = generate_frames(ds.PixelData, number_of_frames=1)
    sof = frame.find(b"\xff\xc0")
    frame = frame[: sof + 5] + struct.pack(">HH", size, size) + frame[sof + 9 :]
    ds.PixelData = encapsulate([frame])
    ds.Rows = ds.Columns = rows_columns
    return to_bytes(ds)


def test_a_jpeg_declaring_16384_squared_is_refused_before_decoding(slices, tmp_path):
    path = tmp_path / "bomb.dcm"
    path.write_bytes(_jpeg_declaring(slices["jpeg_baseline"][0], 16384, 64))
    with pytest.raises(InputProblem, match="declares 16384 x 16384 x 1 samples; Columns x Rows x SamplesPerPixel "
                                           "say 64 x 64") as err:
        _planes(path)
    assert err.value.stage == "header"
    path.write_bytes(_jpeg_declaring(slices["jpeg_baseline"][0], 16384, 16384))  # Rows and Columns agree
    with pytest.raises(InputProblem, match=r"holds \d+ bytes, but 16384 x 16384 pixels take 1048576 at the least") \
            as err:
        _planes(path)
    assert err.value.stage == "header" and len(path.read_bytes()) < 10_000


@pytest.mark.parametrize("kind", ["jpegls_lossless", "jpeg_baseline"])
def test_a_series_with_one_slice_cut_short_is_rejected_naming_it(run_ingest, tmp_path, kind):
    """The case of the report: slice 6 of 12 cut to 90 % and closed with EOI."""
    paths = write_series(tmp_path / "src", kind)
    paths[5].write_bytes(cut_codestream(paths[5].read_bytes(), 0.9, b"\xff\xd9"))
    report, store = run_ingest(tmp_path / "src")
    assert store.series() == []
    (outcome,) = report.series
    assert outcome.status == "rejected"
    (record,) = store.rejects()
    assert record.stage == "decode" and record.source == str(paths[5])
    assert "made up the missing pixels" in record.reason
