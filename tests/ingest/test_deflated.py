"""Deflated Explicit VR Little Endian inflated within what the file declares (medload.ingest.deflated):
valid files decode as their native twins do, cut streams are refused, and a 2 MB deflate bomb is
refused from its declared sizes, its worker peaking far below the 2 GB it would inflate to."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydicom
import pytest
from pydicom.uid import DeflatedExplicitVRLittleEndian

from medload.config import IngestConfig
from medload.deid import Pseudonymizer
from medload.errors import InputProblem
from medload.ingest.discover import SourceRef
from medload.ingest.headers import read_headers
from medload.ingest.pixels import LoadedFile, decode_plane
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series
from medload.synthetic.broken import deflate_bomb, truncate

PSEUDO = Pseudonymizer(b"k" * 32)
PEAK = 512 * 2**20
# Started from this small process, which reports the peak memory of the medload process it waits for
# (Linux carries a process's peak RSS across exec: a command started from pytest would report pytest's).
WRAPPER = ("import resource, subprocess, sys; subprocess.call(sys.argv[1:]); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)")


def _planes(path: Path) -> list[np.ndarray]:
    headers = read_headers(SourceRef(str(path), None, path.stat().st_size), PSEUDO, IngestConfig())
    assert isinstance(headers, list)
    file = LoadedFile(path.read_bytes())
    return [decode_plane(file, h, h.modality, "int16")[0] for h in headers]


def _deflated(path: Path) -> bytes:
    ds = pydicom.dcmread(path)
    ds.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()


@pytest.mark.parametrize("multiframe", [False, True])
def test_a_deflated_file_decodes_as_its_native_twin(tmp_path, multiframe):
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=3, rows=48, cols=40, multiframe=multiframe), seed=5)
    path = tmp_path / "deflated.dcm"
    path.write_bytes(_deflated(gen.paths[0]))
    assert len(path.read_bytes()) < gen.paths[0].stat().st_size
    assert all(np.array_equal(a, b) for a, b in zip(_planes(path), _planes(gen.paths[0]), strict=True))


@pytest.mark.parametrize("fraction", [0.5, 0.75, 0.9, 0.95, 0.99])
def test_a_cut_deflate_stream_is_refused(tmp_path, fraction):
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=1, rows=64, cols=64), seed=6)
    data = _deflated(gen.paths[0])
    path = tmp_path / "cut.dcm"
    path.write_bytes(truncate(data, int(len(data) * fraction)))
    with pytest.raises(InputProblem, match="the deflate stream ends .* without its final block: truncated") as err:
        _planes(path)
    assert err.value.stage == "header"


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> Path:
    """Two 2 MB files inflating to 2.2 GB: Pixel Data declaring 2.2 GB of a 64 x 64 image, and a whole
    64 x 64 image followed by 2.2 GB of Data Set Trailing Padding (FFFC,FFFC)."""
    root = tmp_path_factory.mktemp("bombs")
    gen = make_series(root / "template", SeriesSpec(n_slices=1, rows=64, cols=64), seed=7)
    template = pydicom.dcmread(gen.paths[0])
    src = root / "src"
    src.mkdir()
    for name, trailing in (("pixels", False), ("trailing", True)):
        (src / f"{name}.dcm").write_bytes(deflate_bomb(template, name, 2200 * 10**6, trailing=trailing))
    return src


def test_deflate_bombs_are_refused_from_their_declared_sizes(bombs):
    assert all(2 * 10**6 < p.stat().st_size < 3 * 10**6 for p in bombs.iterdir())
    with pytest.raises(InputProblem, match=r"Pixel Data declares 2\d{9} bytes, but Rows x Columns x NumberOfFrames "
                                           r"64 x 64 x 1 of 16 bits need 8192: refused before inflating it"):
        _planes(bombs / "pixels.dcm")
    with pytest.raises(InputProblem, match=r"the deflated dataset inflates past 16\.\d MB, but Rows x Columns x "
                                           r"NumberOfFrames 64 x 64 x 1 of 16 bits need 8192 bytes of pixels"):
        _planes(bombs / "trailing.dcm")


def test_a_deflate_bomb_costs_its_worker_far_less_than_it_inflates_to(bombs, tmp_path):
    """The ingest's processes, its decoding worker included, peak below 512 MB (they reached 2 GB)."""
    store = tmp_path / "store"
    command = [sys.executable, "-c", "from medload.cli import main; main()", "ingest", str(bombs), str(store),
               "--workers", "1", "--no-progress"]
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *command], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    peak = int(proc.stdout.strip().splitlines()[-1])
    assert 0 < peak < PEAK, (peak, proc.stderr[-2000:])
    reasons = {Path(r.source).name: r for r in open_store(store).rejects()}
    assert set(reasons) == {"pixels.dcm", "trailing.dcm"}
    assert all(r.stage == "header" and "deflate bomb" in r.reason for r in reasons.values())
