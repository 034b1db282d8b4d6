"""Grouping and splitting: one SeriesInstanceUID holding parts that cannot share a voxel grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom

from medload.synthetic import SeriesSpec, make_series

CORONAL = (1.0, 0.0, 0.0, 0.0, 0.0, -1.0)


def _same_series_uid(paths: list[Path], uid: str) -> None:
    for path in paths:
        ds = pydicom.dcmread(path)
        ds.SeriesInstanceUID = uid
        ds.save_as(path)


def test_orientations_and_matrices_in_one_series_become_separate_volumes(tmp_path, run_ingest):
    src = tmp_path / "src"
    axial = make_series(src, SeriesSpec(n_slices=8, rows=32, cols=40), seed=1)
    coronal = make_series(src, SeriesSpec(n_slices=6, rows=32, cols=40, orientation=CORONAL), seed=2,
                          study_uid=axial.study_uid)
    bigger = make_series(src, SeriesSpec(n_slices=5, rows=48, cols=40), seed=3, study_uid=axial.study_uid)
    _same_series_uid(coronal.paths + bigger.paths, axial.series_uid)
    report, store = run_ingest(src)
    assert report.counts["ingested"] == 3 and not report.rejects
    records = store.series()
    assert len({r.key for r in records}) == 3 and len({r.series for r in records}) == 1
    for gen in (axial, coronal, bigger):
        (rec,) = [r for r in records if r.shape == gen.hu.shape and np.allclose(r.affine, gen.affine_ras, atol=1e-4)]
        assert np.array_equal(store.read(rec.key), gen.hu)


def test_split_keys_do_not_depend_on_which_other_parts_are_present(tmp_path, run_ingest):
    src = tmp_path / "src"
    axial = make_series(src, SeriesSpec(n_slices=8, rows=32, cols=40), seed=1)
    _, alone = run_ingest(src)
    coronal = make_series(src, SeriesSpec(n_slices=6, rows=32, cols=40, orientation=CORONAL), seed=2,
                          study_uid=axial.study_uid)
    _same_series_uid(coronal.paths, axial.series_uid)
    _, both = run_ingest(src)
    assert {r.key for r in alone.series()} < {r.key for r in both.series()}


def test_orientation_rounding_noise_is_not_a_split(tmp_path, run_ingest):
    src = tmp_path / "src"
    gen = make_series(src, SeriesSpec(n_slices=8, rows=32, cols=40), seed=1)
    for k, path in enumerate(gen.paths):  # IOP written with 1e-5 noise, as some scanners do
        ds = pydicom.dcmread(path)
        ds.ImageOrientationPatient = [f"{v + (1e-5 if k % 2 else -1e-5):.6f}" for v in map(float, ds.ImageOrientationPatient)]
        ds.save_as(path)
    report, store = run_ingest(src)
    (rec,) = store.series()
    assert rec.shape == gen.hu.shape and np.array_equal(store.read(rec.key), gen.hu)


def test_sixteen_bit_mr_is_stored_as_float32_not_refused(tmp_path, run_ingest):
    """Unsigned 16-bit MR without a rescale may use values up to 65535: they do not fit int16."""
    src = tmp_path / "src"
    gen = make_series(src, SeriesSpec(n_slices=4, rows=32, cols=40, bits_stored=16, rescale_intercept=-1024.0), seed=5)
    for path in gen.paths:
        ds = pydicom.dcmread(path)
        ds.Modality = "MR"
        ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = pydicom.uid.MRImageStorage
        del ds.RescaleSlope, ds.RescaleIntercept, ds.RescaleType
        pixels = ds.pixel_array.copy()
        pixels[0, 0] = 65000
        ds.PixelData = pixels.tobytes()
        ds.save_as(path)
    report, store = run_ingest(src)
    (rec,) = store.series()
    assert rec.modality == "MR" and rec.dtype == "float32"
    volume = store.read(rec.key)
    assert volume.dtype == np.float32 and volume.max() == 65000
    assert np.array_equal(volume[volume != 65000], (gen.hu + 1024)[volume != 65000])


def test_headers_of_a_batch_share_repeated_values_without_changing_any():
    """The header pass gives equal values one object per batch (memory of 10 M headers), never merging
    values that merely compare equal: -0.0 keeps its sign."""
    from conftest import slice_header

    from medload.ingest.worker import _share_repeats

    headers = [slice_header((0, 0, z), name=f"{z}.dcm", instance=str(z)) for z in range(3)]
    headers.append(slice_header((0, 0, 3), orientation=(1.0, -0.0, 0.0, 0.0, 1.0, 0.0), name="3.dcm"))
    shared = _share_repeats(headers, {})
    assert shared == headers
    assert shared[0].series is shared[2].series and shared[0].orientation is shared[2].orientation
    assert str(shared[3].orientation[1]) == "-0.0" and shared[3].orientation is not shared[0].orientation
