"""Modality LUT Sequence (0028,3000): applied as pydicom's apply_modality_lut does, or refused."""

from __future__ import annotations

import numpy as np
import pydicom
import pytest
from pydicom.pixels import apply_modality_lut

from medload.synthetic import SeriesSpec, add_modality_lut, make_series


def _mr(paths) -> None:
    for path in paths:
        ds = pydicom.dcmread(path)
        ds.Modality = "MR"
        ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = pydicom.uid.MRImageStorage
        ds.save_as(path, enforce_file_format=True)


def _reference(paths) -> dict[tuple, np.ndarray]:
    """pydicom's modality values of each file, by position."""
    out = {}
    for path in paths:
        ds = pydicom.dcmread(path)
        out[tuple(float(v) for v in ds.ImagePositionPatient)] = apply_modality_lut(ds.pixel_array, ds)
    return out


@pytest.mark.parametrize(("top", "first", "words", "dtype"), [
    (30000, 0, True, "int16"),        # entries fit int16: stored as int16
    (60000, 100, False, "float32"),   # entries up to 60000, US LUTData, first mapped value 100 (below it: entry 0)
])
def test_lut_is_applied_like_pydicom(tmp_path, run_ingest, top, first, words, dtype):
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=4, rows=24, cols=20), seed=11)
    _mr(gen.paths)
    table = np.rint(top * np.sqrt(np.linspace(0, 1, 4096))).astype(np.uint16)  # not a rescale: a curve
    for path in gen.paths:
        add_modality_lut(path, table, first, words=words)
    report, store = run_ingest(tmp_path / "src")
    (rec,) = store.series()
    assert report.counts["ingested"] == 1 and rec.dtype == dtype
    volume = store.read(rec.key)
    reference = _reference(gen.paths)
    for z, position in enumerate(rec.positions):
        expected = reference[tuple(position)]
        assert np.array_equal(volume[z], expected.astype(volume.dtype))
    assert not np.array_equal(volume, gen.hu)  # the LUT, not the rescale it replaced, was applied


def test_lut_that_cannot_be_applied_rejects_with_that_reason(tmp_path, run_ingest):
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=3, rows=24, cols=20), seed=12)
    _mr(gen.paths)
    add_modality_lut(gen.paths[1], np.arange(4096, dtype=np.uint16), entries=2048)  # descriptor disagrees
    report, store = run_ingest(tmp_path / "src")
    (bad,) = [r for r in report.rejects if r.source.endswith(gen.paths[1].name)]
    assert bad.status == "rejected" and bad.stage == "header"
    assert "Modality LUT Sequence (0028,3000)" in bad.reason and "4096 entries" in bad.reason
    assert "2048" in bad.reason
