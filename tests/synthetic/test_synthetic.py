"""The synthetic series generator writes valid DICOM whose ground truth agrees with independent readers."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk
from pydicom.errors import InvalidDicomError
from pydicom.uid import (
    CTImageStorage,
    EnhancedCTImageStorage,
    ExplicitVRBigEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGLSLossless,
    RLELossless,
    SecondaryCaptureImageStorage,
)

from medload.errors import ConfigError
from medload.synthetic import (
    PADDING_HU,
    GeneratedSeries,
    SeriesSpec,
    broken,
    make_series,
    make_study,
    phantom_hu,
    write_broken_files,
    write_localizer,
    write_secondary_capture,
)

LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


def _normal(ds: pydicom.Dataset) -> np.ndarray:
    iop = np.array(ds.ImageOrientationPatient, dtype=float)
    return np.cross(iop[:3], iop[3:])


def _hu(stored: np.ndarray, slope: float, intercept: float, padding: int | None) -> np.ndarray:
    hu = stored.astype(np.float64) * slope + intercept
    if padding is not None:
        hu[stored == padding] = PADDING_HU
    return hu


def read_slices(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """HU and IPP of single-frame files, read with pydicom and sorted by IPP along the normal."""
    slices = []
    for path in paths:
        ds = pydicom.dcmread(path)
        ipp = np.array(ds.ImagePositionPatient, dtype=float)
        hu = _hu(ds.pixel_array, float(ds.RescaleSlope), float(ds.RescaleIntercept), ds.get("PixelPaddingValue"))
        slices.append((float(ipp @ _normal(ds)), ipp, hu))
    slices.sort(key=lambda s: s[0])
    return np.stack([s[2] for s in slices]), np.stack([s[1] for s in slices])


def _assert_same_image(data: np.ndarray, affine_ras: np.ndarray, series: GeneratedSeries, atol: float = 1e-6) -> None:
    """``data`` with its RAS affine samples the same voxels as the ground truth (any axis order or flip)."""
    theirs = nib.as_closest_canonical(nib.Nifti1Image(data, affine_ras))
    ours = nib.as_closest_canonical(nib.Nifti1Image(series.hu.transpose(2, 1, 0), series.affine_ras))
    np.testing.assert_array_equal(theirs.get_fdata(), ours.get_fdata())
    np.testing.assert_allclose(theirs.affine, ours.affine, atol=atol)


ROUND_TRIPS = {
    "explicit-le-unsigned12": SeriesSpec(),
    "implicit-le-signed16": SeriesSpec(transfer_syntax=ImplicitVRLittleEndian, signed=True, bits_stored=16),
    "explicit-be-signed12": SeriesSpec(transfer_syntax=ExplicitVRBigEndian, signed=True, rescale_intercept=0.0),
    "explicit-be-unsigned16-slope2": SeriesSpec(transfer_syntax=ExplicitVRBigEndian, bits_stored=16, rescale_slope=2.0),
    "explicit-le-slope-half": SeriesSpec(bits_stored=16, rescale_slope=0.5),
    "per-slice-intercept": SeriesSpec(signed=True, bits_stored=16, per_slice_intercept=True, orientation="oblique"),
    "padding-signed": SeriesSpec(signed=True, bits_stored=16, rescale_intercept=0.0, pixel_padding_value=-2000),
    "padding-unsigned-collides": SeriesSpec(pixel_padding_value=0),
    "rle-unsigned-per-slice": SeriesSpec(transfer_syntax=RLELossless, per_slice_intercept=True),
    "rle-signed12-padding": SeriesSpec(transfer_syntax=RLELossless, signed=True, rescale_intercept=0.0,
                                       pixel_padding_value=-2048),
    "j2k-signed12": SeriesSpec(transfer_syntax=JPEG2000Lossless, signed=True, rescale_intercept=0.0),
    "j2k-unsigned-per-slice": SeriesSpec(transfer_syntax=JPEG2000Lossless, per_slice_intercept=True),
    "jpegls-signed16": SeriesSpec(transfer_syntax=JPEGLSLossless, signed=True, bits_stored=16, n_slices=4),
    "jpegls-unsigned12": SeriesSpec(transfer_syntax=JPEGLSLossless, n_slices=4),
}


@pytest.mark.parametrize("spec", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_pydicom_round_trip_equals_ground_truth(tmp_path: Path, spec: SeriesSpec) -> None:
    series = make_series(tmp_path, spec, seed=3)
    assert series.hu.dtype == np.int16 and series.hu.shape == (len(series.ipp), spec.rows, spec.cols)
    hu, ipp = read_slices(series.paths)
    np.testing.assert_array_equal(hu, series.hu)
    np.testing.assert_allclose(ipp, series.ipp, atol=0)
    ds = pydicom.dcmread(series.paths[0])
    assert ds.file_meta.TransferSyntaxUID == spec.transfer_syntax
    assert ds.SOPClassUID == CTImageStorage and ds.BitsAllocated == 16 and ds.HighBit == spec.bits_stored - 1
    assert ds.PixelRepresentation == int(spec.signed)
    if spec.pixel_padding_value is not None:
        assert (series.hu == PADDING_HU).any() and ds.PixelPaddingValue == spec.pixel_padding_value
    intercepts = {float(pydicom.dcmread(p).RescaleIntercept) for p in series.paths}
    assert (len(intercepts) > 1) == spec.per_slice_intercept


@pytest.mark.parametrize("signed", [True, False])
def test_bits_above_high_bit(tmp_path: Path, signed: bool) -> None:
    spec = SeriesSpec(signed=signed, rescale_intercept=0.0 if signed else -1024.0, n_slices=2)
    series = make_series(tmp_path, spec)
    raw = np.frombuffer(pydicom.dcmread(series.paths[0]).PixelData, dtype="<i2" if signed else "<u2")
    if signed:
        assert (raw < 0).any()
        assert set(np.unique(raw >> 11)) <= {0, -1}  # two's complement: bits 11..15 all equal the sign
    else:
        assert (raw >> 12).max() == 0


def test_names_and_instance_numbers_are_shuffled(tmp_path: Path) -> None:
    series = make_series(tmp_path, SeriesSpec(n_slices=8), seed=5)
    names = [p.name for p in series.paths]  # in slice order
    assert names != sorted(names) and names != sorted(names, reverse=True)
    numbers = [pydicom.dcmread(p).InstanceNumber for p in series.paths]
    assert sorted(numbers) == list(range(1, 9))
    assert numbers != sorted(numbers) and numbers != sorted(numbers, reverse=True)
    ordered = make_series(tmp_path / "ordered", SeriesSpec(n_slices=4), shuffle=False)
    assert [pydicom.dcmread(p).InstanceNumber for p in ordered.paths] == [1, 2, 3, 4]


def test_geometry_positions_gaps_and_tilt(tmp_path: Path) -> None:
    origin = (10.0, -20.0, 30.0)
    gaps = make_series(tmp_path / "gaps", SeriesSpec(origin=origin, positions_mm=(7.5, 0.0, 2.5, 10.0)))
    np.testing.assert_allclose(gaps.ipp, [[10, -20, 30 + z] for z in (0.0, 2.5, 7.5, 10.0)])
    np.testing.assert_allclose(gaps.affine_ras[:3, 2], [0, 0, 10 / 3])

    tilted = make_series(tmp_path / "tilt", SeriesSpec(origin=origin, n_slices=3, tilt_deg=20.0))
    shear = np.tan(np.radians(20.0)) * 2.5
    np.testing.assert_allclose(np.diff(tilted.ipp, axis=0), [[0, shear, 2.5]] * 2, atol=1e-9)
    assert float(pydicom.dcmread(tilted.paths[0]).GantryDetectorTilt) == 20.0

    oblique = make_series(tmp_path / "oblique", SeriesSpec(orientation="oblique"), seed=2)
    voxels = np.c_[np.zeros((12, 2)), np.arange(12), np.ones(12)]
    np.testing.assert_allclose((LPS_TO_RAS @ oblique.affine_ras @ voxels.T).T[:, :3], oblique.ipp, atol=1e-9)
    single = make_series(tmp_path / "single", SeriesSpec(n_slices=1, slice_spacing=3.0))
    np.testing.assert_allclose(single.affine_ras[:3, 2], [0, 0, 3.0])


def test_simpleitk_geometry_matches_affine(tmp_path: Path) -> None:
    series = make_series(tmp_path, SeriesSpec(orientation="oblique", signed=True, bits_stored=16), seed=11)
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(tmp_path), series.series_uid))
    image = reader.Execute()
    lps = np.eye(4)
    lps[:3, :3] = np.array(image.GetDirection()).reshape(3, 3) * np.array(image.GetSpacing())
    lps[:3, 3] = image.GetOrigin()
    np.testing.assert_allclose(LPS_TO_RAS @ lps, series.affine_ras, atol=1e-4)
    np.testing.assert_array_equal(sitk.GetArrayFromImage(image), series.hu)


@pytest.mark.dcm2niix
def test_dcm2niix_agrees_with_ground_truth(tmp_path: Path) -> None:
    src, out = tmp_path / "dicom", tmp_path / "nifti"
    out.mkdir()
    series = make_series(src, SeriesSpec(orientation="oblique"), seed=13)
    subprocess.run(["dcm2niix", "-z", "n", "-f", "out", "-o", str(out), str(src)], check=True, capture_output=True)
    reference = nib.load(out / "out.nii")  # dcm2niix flips the row axis; canonical forms must still agree
    _assert_same_image(np.asanyarray(reference.dataobj), reference.affine, series, atol=1e-3)


@pytest.mark.parametrize("transfer_syntax", [ExplicitVRLittleEndian, RLELossless])
def test_multiframe_round_trip(tmp_path: Path, transfer_syntax: str) -> None:
    spec = SeriesSpec(multiframe=True, orientation="oblique", signed=True, bits_stored=16,
                      per_slice_intercept=True, transfer_syntax=transfer_syntax)
    series = make_series(tmp_path, spec, seed=17)
    (path,) = series.paths
    ds = pydicom.dcmread(path)
    assert ds.SOPClassUID == EnhancedCTImageStorage and int(ds.NumberOfFrames) == spec.n_slices
    shared = ds.SharedFunctionalGroupsSequence[0]
    normal = np.cross(*np.reshape(shared.PlaneOrientationSequence[0].ImageOrientationPatient, (2, 3)).astype(float))
    assert [float(v) for v in shared.PixelMeasuresSequence[0].PixelSpacing] == list(spec.pixel_spacing)
    frames = ds.pixel_array
    assert frames.shape == series.hu.shape
    ipp, hu = [], []
    for frame, group in zip(frames, ds.PerFrameFunctionalGroupsSequence):
        rescale = group.PixelValueTransformationSequence[0]
        ipp.append(np.array(group.PlanePositionSequence[0].ImagePositionPatient, dtype=float))
        hu.append(_hu(frame, float(rescale.RescaleSlope), float(rescale.RescaleIntercept), None))
    order = np.argsort(np.array(ipp) @ normal)
    assert not np.array_equal(order, np.arange(len(order)))  # frames are stored shuffled
    np.testing.assert_array_equal(np.array(ipp)[order], series.ipp)
    np.testing.assert_array_equal(np.array(hu)[order], series.hu)

    import highdicom
    volume = highdicom.imread(path).get_volume()  # axes (slice, row, column), affine in LPS, own slice order
    _assert_same_image(volume.array, LPS_TO_RAS @ volume.affine, series)


def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    specs = [SeriesSpec(n_slices=3), SeriesSpec(n_slices=2, orientation="oblique", transfer_syntax=RLELossless),
             SeriesSpec(n_slices=2, multiframe=True)]
    first, second = make_study(tmp_path / "a", specs, seed=7), make_study(tmp_path / "b", specs, seed=7)
    for a, b in zip(first, second):
        assert [p.name for p in a.paths] == [p.name for p in b.paths]
        assert all(p.read_bytes() == q.read_bytes() for p, q in zip(a.paths, b.paths))
        np.testing.assert_array_equal(a.hu, b.hu)
    other = make_series(tmp_path / "c", specs[0], seed=8)
    assert other.series_uid != first[0].series_uid and not np.array_equal(other.hu, first[0].hu)


def test_make_study_writes_distinct_series_in_one_folder(tmp_path: Path) -> None:
    specs = [SeriesSpec(n_slices=3), SeriesSpec(n_slices=4, orientation="oblique"), SeriesSpec(n_slices=2)]
    study = make_study(tmp_path, specs, seed=1)
    assert len({s.series_uid for s in study}) == 3 and len({s.study_uid for s in study}) == 1
    assert len(list(tmp_path.iterdir())) == 9
    headers = [pydicom.dcmread(p) for p in sorted(tmp_path.iterdir())]
    assert {ds.SeriesInstanceUID for ds in headers} == {s.series_uid for s in study}
    assert len({(ds.PatientID, str(ds.PatientName), ds.StudyInstanceUID, ds.FrameOfReferenceUID) for ds in headers}) == 1
    assert sorted({int(ds.SeriesNumber) for ds in headers}) == [1, 2, 3]
    ds = headers[0]
    assert ds.Manufacturer == "medload-synthetic" and ds.PatientBirthDate and ds.AccessionNumber
    for keyword in ("ManufacturerModelName", "ConvolutionKernel", "SliceThickness", "KVP", "WindowCenter",
                    "WindowWidth", "FrameOfReferenceUID", "RescaleType", "ImageType"):
        assert keyword in ds, keyword
    assert ds.Modality == "CT" and ds.SamplesPerPixel == 1 and ds.PhotometricInterpretation == "MONOCHROME2"


def test_localizer_secondary_capture_and_broken_files(tmp_path: Path) -> None:
    localizer = pydicom.dcmread(write_localizer(tmp_path / "new", seed=1))
    assert localizer.SOPClassUID == CTImageStorage and list(localizer.ImageType) == ["ORIGINAL", "PRIMARY", "LOCALIZER"]
    assert localizer.pixel_array.shape == (64, 48)

    capture = pydicom.dcmread(write_secondary_capture(tmp_path, seed=1))
    assert capture.SOPClassUID == SecondaryCaptureImageStorage and capture.PhotometricInterpretation == "RGB"
    assert capture.pixel_array.shape == (64, 64, 3) and capture.pixel_array.dtype == np.uint8

    source = make_series(tmp_path / "series", SeriesSpec(n_slices=2)).paths[0]
    broken = write_broken_files(tmp_path / "broken", source)
    assert set(broken) == {"truncated", "not_dicom", "no_pixels"}
    assert 0 < broken["truncated"].stat().st_size < source.stat().st_size
    with pytest.raises(ValueError, match="less than expected"):
        pydicom.dcmread(broken["truncated"]).pixel_array
    with pytest.raises(InvalidDicomError):
        pydicom.dcmread(broken["not_dicom"])
    no_pixels = pydicom.dcmread(broken["no_pixels"])
    assert no_pixels.SOPClassUID == CTImageStorage and "PixelData" not in no_pixels
    assert no_pixels.SOPInstanceUID != pydicom.dcmread(source).SOPInstanceUID


def test_phantom_statistics() -> None:
    hu = phantom_hu((6, 128, 128), np.random.default_rng(0))
    assert hu.dtype == np.int16 and hu.min() >= -1024
    for lo, hi, expected, sd in [(-1024, -950, -1000, 10), (-950, -600, -850, 30), (-160, -40, -100, 15),
                                 (-10, 90, 40, 15)]:
        band = hu[(hu >= lo) & (hu < hi)]
        assert band.size > 500 and abs(band.mean() - expected) < 10 and abs(band.std() - sd) < sd / 2
    assert 700 <= np.percentile(hu, 99.9) <= 1300 and (hu > 650).sum() > 100
    assert not np.array_equal(hu[0] < -600, hu[-1] < -600)  # anatomy changes along z


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SeriesSpec(rescale_intercept=0.0), "stored values"),
        (SeriesSpec(signed=True), "BitsStored=12"),
        (SeriesSpec(orientation="sagittal"), "orientation"),
        (SeriesSpec(orientation=(1, 0, 0, 1, 0, 0)), "orthogonal"),
        (SeriesSpec(transfer_syntax="1.2.840.10008.1.2.4.50"), "not supported"),
        (SeriesSpec(transfer_syntax=JPEG2000Lossless, rows=16, cols=16), "Rows and Columns"),
        (SeriesSpec(pixel_padding_value=5000), "outside the stored range"),
        (SeriesSpec(positions_mm=(0.0, 2.5, 2.5)), "duplicate"),
        (SeriesSpec(rescale_intercept=-1024.5), "whole number"),
        (SeriesSpec(bits_stored=17), "bits_stored"),
        (SeriesSpec(tilt_deg=75.0), "tilt_deg"),
        (SeriesSpec(series_description="x" * 65), "64 characters"),
    ],
)
def test_bad_specs_raise_config_error(tmp_path: Path, spec: SeriesSpec, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_series(tmp_path, spec)


def test_missing_encoder_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Unavailable:
        is_available = False
        missing_dependencies = ["pyjpegls - requires pyjpegls>=1.2"]

    monkeypatch.setattr("medload.synthetic.pixels.get_encoder", lambda uid: Unavailable())
    with pytest.raises(ConfigError, match="pyjpegls"):
        make_series(tmp_path, SeriesSpec(transfer_syntax=JPEGLSLossless))


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    make_series(tmp_path, SeriesSpec(n_slices=2), seed=4)
    with pytest.raises(ConfigError, match="exists already"):
        make_series(tmp_path, SeriesSpec(n_slices=2), seed=4)


def test_cli_writes_three_series(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "sample_data" / "make_synthetic.py"
    run = subprocess.run([sys.executable, "-W", "error", str(script), str(tmp_path), "--seed", "2"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    headers = [pydicom.dcmread(p, stop_before_pixels=True) for p in tmp_path.iterdir()]
    assert len({ds.SeriesInstanceUID for ds in headers}) == 3 and len(headers) == 36
    assert {ds.file_meta.TransferSyntaxUID for ds in headers} == {ExplicitVRLittleEndian, RLELossless}
    assert "wrote series" in run.stderr


def test_broken_variants_are_broken_as_described(tmp_path: Path) -> None:
    """Each byte-level damage of medload.synthetic.broken changes what it says, and only that."""
    gen = make_series(tmp_path / "t", SeriesSpec(n_slices=1, rows=16, cols=16), seed=3)
    template = pydicom.dcmread(gen.paths[0])
    data = broken.with_uids(template, "a")
    assert broken.with_uids(template, "a") == data != broken.with_uids(template, "b")
    for target in broken.HEADER_TARGETS:
        flipped = broken.flip_header(data, target, 5)
        assert len(flipped) == len(data) and sum(a != b for a, b in zip(flipped, data)) == 1
    pixel = broken.element_offset(data, 0x7FE00010, b"OW")
    assert struct.unpack("<I", broken.set_pixel_data_length(data, 7)[pixel + 8 : pixel + 12]) == (7,)
    bad_rows = pydicom.dcmread(io.BytesIO(broken.wrong_vr(data, *broken.WRONG_VRS[0])), stop_before_pixels=True)
    assert bad_rows["Rows"].VR == "DS" and bad_rows.SOPInstanceUID == pydicom.dcmread(io.BytesIO(data)).SOPInstanceUID
    bomb = pydicom.dcmread(io.BytesIO(broken.deflate_bomb(template, "c", 3 << 20)))
    assert bomb.file_meta.TransferSyntaxUID.name == "Deflated Explicit VR Little Endian"
    assert len(bomb.PixelData) == 2 << 20 and not any(bomb.PixelData) and bomb.Rows == 16
    j2k = make_series(tmp_path / "j", SeriesSpec(n_slices=1, rows=32, cols=32, transfer_syntax=JPEG2000Lossless), seed=4)
    resized = broken.codestream_size(j2k.paths[0].read_bytes(), 40000, 300)
    siz = resized.find(b"\xff\x4f\xff\x51")
    assert struct.unpack(">II", resized[siz + 8 : siz + 16]) == (40000, 300)
