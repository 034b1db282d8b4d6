"""End-to-end ingest of generated DICOM (medload.synthetic), checked against the generator's ground truth.

Every test writes real DICOM files under ``tmp_path``, ingests them with :func:`medload.ingest.run.ingest`
(through the ``run_ingest`` fixture) and reads the store back. Series are kept small (8-12 slices of
32-48 pixels) so the whole module runs in seconds.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tarfile
import zipfile
from dataclasses import asdict
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from conftest import file_hashes, store_dump
from pydicom import encaps
from pydicom.uid import (
    ExplicitVRBigEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGLSLossless,
    RLELossless,
    generate_uid,
)

from medload import windows as win
from medload.errors import ConfigError
from medload.storage.nifti import export_nifti
from medload.synthetic import (
    GeneratedSeries,
    SeriesSpec,
    make_series,
    make_study,
    write_broken_files,
    write_localizer,
    write_secondary_capture,
)

LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0])

# small series: 8 slices of 32 x 40 (JPEG 2000 needs >= 32 pixels per side)
SMALL = dict(n_slices=8, rows=32, cols=40)


# ---- helpers -------------------------------------------------------------------------------------
def the_volume(report, store, gen: GeneratedSeries | None = None):
    """The one ingested volume of a run (asserting there is exactly one), checked against ``gen``."""
    assert report.counts["ingested"] == 1, (report.series, report.rejects)
    records = store.series()
    assert len(records) == 1
    rec = records[0]
    if gen is not None:
        assert_matches_truth(store, rec, gen)
    return rec


def assert_matches_truth(store, rec, gen: GeneratedSeries, affine_atol: float = 1e-4) -> None:
    """Voxels, dtype, affine, spacing and per-slice positions of ``rec`` equal the ground truth."""
    vol = store.read(rec.key)
    assert vol.dtype == np.int16 and rec.dtype == "int16"
    assert vol.shape == gen.hu.shape == tuple(rec.shape)
    np.testing.assert_array_equal(vol, gen.hu)
    np.testing.assert_allclose(np.array(rec.affine), gen.affine_ras, atol=affine_atol)
    row_spacing, col_spacing = gen.spec.pixel_spacing
    np.testing.assert_allclose(rec.spacing, (col_spacing, row_spacing, gen.spec.slice_spacing), atol=1e-4)
    np.testing.assert_allclose(np.array(rec.positions), gen.ipp, atol=1e-6)


def by_status(report, status: str):
    return [s for s in report.series if s.status == status]


def data_mdb_files(store) -> list[bytes]:
    """Bytes of every shard's data.mdb, in manifest order."""
    return [(store.path / "shards" / f"{s.name}.lmdb" / "data.mdb").read_bytes() for s in store.manifest.shards]


def copy_renamed(paths: list[Path], dest: Path, seed: int) -> list[Path]:
    """Copy files byte-for-byte to ``dest`` under new random names."""
    rng = np.random.default_rng(seed)
    dest.mkdir(parents=True)
    out = []
    for path in paths:
        target = dest / f"{rng.bytes(6).hex()}.img"
        shutil.copyfile(path, target)
        out.append(target)
    return out


# ---- 1. ground truth over pixel formats and transfer syntaxes ------------------------------------
GROUND_TRUTH_SPECS = {
    "axial_unsigned_12bit": SeriesSpec(**SMALL),
    "oblique_signed_16bit": SeriesSpec(**SMALL, orientation="oblique", signed=True, bits_stored=16,
                                       rescale_intercept=0.0),
    "per_slice_intercept": SeriesSpec(**SMALL, orientation="oblique", per_slice_intercept=True),
    "slope_2": SeriesSpec(**SMALL, rescale_slope=2.0),
    "padding_signed": SeriesSpec(**SMALL, signed=True, bits_stored=16, rescale_intercept=0.0,
                                 pixel_padding_value=-2000),
    "padding_unsigned": SeriesSpec(**SMALL, pixel_padding_value=0),
    "padding_signed_12bit": SeriesSpec(**SMALL, signed=True, bits_stored=12, rescale_intercept=1024.0,
                                       pixel_padding_value=-2048),
    "big_endian": SeriesSpec(**SMALL, orientation="oblique", signed=True, bits_stored=16, rescale_intercept=0.0,
                             transfer_syntax=ExplicitVRBigEndian),
    "implicit_vr": SeriesSpec(**SMALL, transfer_syntax=ImplicitVRLittleEndian),
    "rle": SeriesSpec(**SMALL, signed=True, bits_stored=16, rescale_intercept=0.0, transfer_syntax=RLELossless),
    "jpeg2000_lossless": SeriesSpec(**SMALL, transfer_syntax=JPEG2000Lossless),
    "jpegls_lossless": SeriesSpec(**SMALL, transfer_syntax=JPEGLSLossless),
    "jpegls_signed": SeriesSpec(**SMALL, signed=True, bits_stored=16, rescale_intercept=0.0,
                                transfer_syntax=JPEGLSLossless),
    "enhanced_native": SeriesSpec(**SMALL, multiframe=True, orientation="oblique", per_slice_intercept=True),
    "enhanced_rle": SeriesSpec(**SMALL, multiframe=True, signed=True, bits_stored=16, rescale_intercept=0.0,
                               transfer_syntax=RLELossless),
    "enhanced_rle_oblique_per_slice": SeriesSpec(**SMALL, multiframe=True, orientation="oblique",
                                                 per_slice_intercept=True, transfer_syntax=RLELossless),
}


@pytest.mark.parametrize("name", list(GROUND_TRUTH_SPECS))
def test_ingest_reproduces_ground_truth(tmp_path: Path, run_ingest, name: str) -> None:
    spec = GROUND_TRUTH_SPECS[name]  # encoders (pylibjpeg-openjpeg, pyjpegls) are dev dependencies
    gen = make_series(tmp_path / "src", spec, seed=11)
    report, store = run_ingest(tmp_path / "src")
    rec = the_volume(report, store, gen)
    assert report.rejects == [] and store.rejects() == []
    assert rec.modality == "CT" and rec.space == "RAS"
    if spec.pixel_padding_value is not None:  # padding pixels (outside the FOV) are counted, and are air
        assert 0 < rec.padding_voxels <= int(np.sum(gen.hu == -1024))


# ---- 2. file names and InstanceNumber never matter ------------------------------------------------
def test_renamed_files_give_a_byte_identical_store(tmp_path: Path, run_ingest) -> None:
    gen = make_series(tmp_path / "a", SeriesSpec(**SMALL, orientation="oblique"), seed=21)
    copy_renamed(gen.paths, tmp_path / "b", seed=5)
    report_a, store_a = run_ingest(tmp_path / "a")
    report_b, store_b = run_ingest(tmp_path / "b")
    the_volume(report_a, store_a, gen)
    the_volume(report_b, store_b, gen)
    assert store_dump(store_a) == store_dump(store_b)
    assert data_mdb_files(store_a) == data_mdb_files(store_b)


def test_permuted_instance_numbers_change_only_the_source_hashes(tmp_path: Path, run_ingest) -> None:
    gen = make_series(tmp_path / "a", SeriesSpec(**SMALL, orientation="oblique"), seed=22)
    original = [int(pydicom.dcmread(p, stop_before_pixels=True).InstanceNumber) for p in gen.paths]
    rng = np.random.default_rng(3)
    while True:
        permuted = [int(v) for v in rng.permutation(original)]
        if all(a != b for a, b in zip(permuted, original)):
            break
    (tmp_path / "b").mkdir()
    for path, number in zip(gen.paths, permuted):
        ds = pydicom.dcmread(path)
        ds.InstanceNumber = number
        ds.save_as(tmp_path / "b" / path.name, enforce_file_format=True)

    report_a, store_a = run_ingest(tmp_path / "a")
    report_b, store_b = run_ingest(tmp_path / "b")
    rec_a, rec_b = the_volume(report_a, store_a, gen), the_volume(report_b, store_b, gen)
    np.testing.assert_array_equal(store_a.read(rec_a.key), store_b.read(rec_b.key))
    assert (rec_a.key, rec_a.digest) == (rec_b.key, rec_b.digest)
    da, db = asdict(rec_a), asdict(rec_b)
    differing = {k for k in da if da[k] != db[k] and k != "shard"}
    assert differing == {"sources"}
    assert len(rec_a.sources) == len(rec_b.sources) == gen.hu.shape[0]
    assert all(a != b for a, b in zip(rec_a.sources, rec_b.sources))  # each file's bytes changed
    # the slice values themselves are byte-identical
    slices = lambda store: [e for e in store_dump(store) if e[0] == b"slices"]  # noqa: E731
    assert slices(store_a) == slices(store_b)


# ---- 3. dcm2niix as the geometry oracle ----------------------------------------------------------
@pytest.mark.dcm2niix
@pytest.mark.parametrize("shape", [(40, 40), (48, 32)], ids=["square", "non_square"])
def test_export_agrees_with_dcm2niix(tmp_path: Path, run_ingest, shape: tuple[int, int]) -> None:
    rows, cols = shape
    spec = SeriesSpec(n_slices=10, rows=rows, cols=cols, orientation="oblique", pixel_spacing=(0.7, 0.9),
                      slice_spacing=2.0)
    src, ref_dir = tmp_path / "src", tmp_path / "ref"
    ref_dir.mkdir()
    gen = make_series(src, spec, seed=31 + rows)
    report, store = run_ingest(src)
    rec = the_volume(report, store, gen)
    ours = nib.load(export_nifti(store, rec.key, tmp_path / "ours.nii"))
    subprocess.run(["dcm2niix", "-z", "n", "-b", "n", "-f", "ref", "-o", str(ref_dir), str(src)],
                   check=True, capture_output=True, timeout=60)
    theirs = nib.load(ref_dir / "ref.nii")
    ours_c, theirs_c = nib.as_closest_canonical(ours), nib.as_closest_canonical(theirs)
    assert ours_c.shape == theirs_c.shape
    np.testing.assert_array_equal(np.asarray(ours_c.dataobj, dtype=np.float64), theirs_c.get_fdata())
    np.testing.assert_allclose(ours_c.affine, theirs_c.affine, atol=1e-3)


# ---- 4. several series and non-volumes in one folder ---------------------------------------------
def test_study_folder_with_localizer_and_secondary_capture(tmp_path: Path, run_ingest) -> None:
    src = tmp_path / "study"
    gens = make_study(src, [
        SeriesSpec(**SMALL),
        SeriesSpec(n_slices=10, rows=36, cols=36, orientation="oblique", slice_spacing=1.25),
        SeriesSpec(n_slices=6, rows=40, cols=32, signed=True, bits_stored=16, rescale_intercept=0.0,
                   series_description="second recon"),
    ], seed=41)
    localizer = write_localizer(src, seed=42, study_uid=gens[0].study_uid)
    capture = write_secondary_capture(src, seed=43, study_uid=gens[0].study_uid)
    report, store = run_ingest(src)

    assert report.counts["ingested"] == 3
    assert len(store.series()) == 3
    by_positions = {tuple(map(tuple, np.round(g.ipp, 3))): g for g in gens}
    for rec in store.series():
        gen = by_positions[tuple(map(tuple, np.round(np.array(rec.positions), 3)))]
        assert_matches_truth(store, rec, gen)

    skipped = report.quarantined("skipped")
    loc = [r for r in skipped if "localizer" in r.reason.lower()]
    sc = [r for r in skipped if "secondary capture" in r.reason.lower()]
    assert loc and sc, skipped
    assert any(localizer.name in r.source or any(localizer.name in s for s in r.sources) for r in loc)
    assert any(capture.name in r.source for r in sc)
    assert report.quarantined("rejected") == []
    stored = store.rejects()
    assert {r.status for r in stored} == {"skipped"}
    assert any("localizer" in r.reason.lower() for r in stored)
    assert any("secondary capture" in r.reason.lower() for r in stored)


# ---- 5. broken files are quarantined, the good series still ingests -------------------------------
def test_broken_files_are_quarantined_with_reason_and_hash(tmp_path: Path, run_ingest) -> None:
    src = tmp_path / "src"
    gen = make_series(src, SeriesSpec(**SMALL), seed=51)
    broken = write_broken_files(src, gen.paths[0])
    report, store = run_ingest(src)
    the_volume(report, store, gen)

    expected = {"truncated": "truncated", "not_dicom": "not dicom: text", "no_pixels": "no pixel data"}
    for records in (report.rejects, store.rejects()):
        by_name = {}
        for r in records:
            for kind, path in broken.items():
                if path.name in r.source:
                    by_name[kind] = r
        assert set(by_name) == set(broken), records
        for kind, r in by_name.items():
            assert r.status == ("ignored" if kind == "not_dicom" else "rejected"), r
            assert expected[kind] in r.reason.lower(), r
            assert r.sha256 == hashlib.sha256(broken[kind].read_bytes()).hexdigest()


def _overflowing_rle(path: Path, out: Path) -> Path:
    """Rewrite an RLE Lossless file so its first segment decodes to more bytes than Rows x Columns.

    The RLE header (segment count and offsets) is kept; the first segment's bytes become replicate runs
    (control byte 0x81: repeat the next byte 128 times), as a damaged or hostile file may hold.
    """
    ds = pydicom.dcmread(path)
    (frame,) = list(encaps.generate_frames(ds.PixelData, number_of_frames=1))
    offsets = np.frombuffer(frame[:64], dtype="<u4")
    start, end = int(offsets[1]), int(offsets[2])
    length = (end - start) // 2 * 2
    damaged = frame[:start] + b"\x81\x00" * (length // 2) + frame[start + length:]
    assert len(damaged) == len(frame)
    ds.PixelData = encaps.encapsulate([damaged])
    ds.save_as(out, enforce_file_format=True)
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_damaged_compressed_slice_rejects_only_its_series(tmp_path: Path, run_ingest, workers: int) -> None:
    """A decoder failing on damaged pixel data must not stop the run, in-process or in workers."""
    src = tmp_path / "src"
    damaged_series = make_series(src, SeriesSpec(**SMALL, transfer_syntax=RLELossless), seed=57)
    good = make_series(src, SeriesSpec(**SMALL), seed=58, series_number=2)
    victim = damaged_series.paths[2]
    _overflowing_rle(victim, tmp_path / "damaged.dcm")
    shutil.move(tmp_path / "damaged.dcm", victim)

    report, store = run_ingest(src, workers=workers)
    assert sorted(s.status for s in report.series) == ["ingested", "rejected"]
    rec = the_volume(report, store, good)
    assert rec.positions  # the good series is complete
    (bad,) = [r for r in store.rejects() if r.status == "rejected"]
    assert bad.stage == "decode" and victim.name in bad.source
    assert bad.sha256 == hashlib.sha256(victim.read_bytes()).hexdigest()


# ---- 6. policies: gaps, irregular spacing, tilt, duplicates, one slice ---------------------------
def _rejected_reason(report) -> str:
    (outcome,) = report.series
    assert outcome.status == "rejected", outcome
    return outcome.reason


def test_gap_is_rejected(tmp_path: Path, run_ingest) -> None:
    make_series(tmp_path / "src", SeriesSpec(rows=32, cols=32, positions_mm=(0, 2.5, 5.0, 10.0, 12.5, 15.0)), seed=61)
    report, store = run_ingest(tmp_path / "src")
    reason = _rejected_reason(report)
    assert "irregular spacing" in reason and "gap" in reason
    assert "1 slice(s) missing" in reason
    assert store.series() == []
    assert any(r.status == "rejected" and "gap" in r.reason for r in store.rejects())


def test_irregular_spacing_is_rejected(tmp_path: Path, run_ingest) -> None:
    make_series(tmp_path / "src", SeriesSpec(rows=32, cols=32, positions_mm=(0, 2.5, 5.5, 7.5)), seed=62)
    report, store = run_ingest(tmp_path / "src")
    reason = _rejected_reason(report)
    assert reason.startswith("irregular spacing") and "(gap)" not in reason and "missing" not in reason
    assert store.series() == []


def test_gantry_tilt_rejected_by_default(tmp_path: Path, run_ingest) -> None:
    make_series(tmp_path / "src", SeriesSpec(**SMALL, tilt_deg=15.0), seed=63)
    report, store = run_ingest(tmp_path / "src", tilt_policy="reject")
    assert "gantry tilt" in _rejected_reason(report)
    assert store.series() == []


def test_gantry_tilt_kept_sheared(tmp_path: Path, run_ingest) -> None:
    gen = make_series(tmp_path / "src", SeriesSpec(**SMALL, tilt_deg=15.0), seed=63)
    report, store = run_ingest(tmp_path / "src", tilt_policy="shear")
    rec = the_volume(report, store, gen)
    sheared = [f for f in rec.flags if f.startswith("sheared_")]
    assert len(sheared) == 1
    angle = float(re.search(r"sheared_([0-9.]+)deg", sheared[0]).group(1))
    assert angle == pytest.approx(15.0, abs=0.05)
    affine = np.array(rec.affine)
    for k, ipp in enumerate(gen.ipp):
        np.testing.assert_allclose((affine @ [0, 0, k, 1])[:3], LPS_TO_RAS @ ipp, atol=1e-3)


def test_identical_duplicate_is_collapsed(tmp_path: Path, run_ingest) -> None:
    gen = make_series(tmp_path / "src", SeriesSpec(**SMALL), seed=64)
    shutil.copyfile(gen.paths[3], tmp_path / "src" / "copy_of_slice_3.dcm")
    report, store = run_ingest(tmp_path / "src")
    rec = the_volume(report, store, gen)
    assert rec.shape[0] == gen.hu.shape[0]
    assert "duplicates_collapsed" in rec.flags


def test_conflicting_duplicate_rejects_the_series(tmp_path: Path, run_ingest) -> None:
    gen = make_series(tmp_path / "src", SeriesSpec(**SMALL), seed=65)
    ds = pydicom.dcmread(gen.paths[4])
    pixels = ds.pixel_array.copy()
    pixels[10:20, 10:20] += 7
    ds.PixelData = pixels.astype(np.uint16).tobytes()
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid(entropy_srcs=["conflict"])
    conflict = tmp_path / "src" / "conflicting.dcm"
    ds.save_as(conflict, enforce_file_format=True)

    report, store = run_ingest(tmp_path / "src")
    reason = _rejected_reason(report)
    assert "conflicting duplicates" in reason
    assert store.series() == []
    for records in (report.rejects, store.rejects()):
        hits = [r for r in records if "conflicting duplicates" in r.reason]
        assert hits and all(r.status == "rejected" for r in hits)
        assert any(conflict.name in r.source or conflict.name in r.reason for r in hits)
    # nothing of that series reached the store: no slices, no record, no index entry
    key = bytes.fromhex(report.series[0].key)
    assert [e for e in store_dump(store) if e[0] != b"rejects" and (e[1].startswith(key) or e[2] == key)] == []


def test_single_slice_series(tmp_path: Path, run_ingest) -> None:
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=1, rows=32, cols=40, slice_spacing=3.0,
                                                   orientation="oblique"), seed=66)
    report, store = run_ingest(tmp_path / "src")
    rec = the_volume(report, store, gen)
    assert rec.shape[0] == 1
    assert "single_slice" in rec.flags
    assert "z_spacing_from_slice_thickness" in rec.flags
    assert rec.spacing[2] == pytest.approx(3.0)


# ---- 7. pre-windowed planes ----------------------------------------------------------------------
def test_stored_windows_equal_to_uint8_of_ground_truth(tmp_path: Path, run_ingest) -> None:
    gen = make_series(tmp_path / "src", SeriesSpec(**SMALL, orientation="oblique"), seed=71)
    report, store = run_ingest(tmp_path / "src", windows=("lung", "soft_tissue"))
    rec = the_volume(report, store, gen)
    assert set(rec.windows) == {"lung", "soft_tissue"}
    for name in ("lung", "soft_tissue"):
        planes = store.read(rec.key, plane=name)
        assert planes.dtype == np.uint8
        np.testing.assert_array_equal(planes, win.to_uint8(gen.hu, win.get(name)))
        np.testing.assert_array_equal(store.read(rec.key, 2, 5, plane=name), planes[2:5])


@pytest.mark.parametrize("name", sorted(win.PRESETS))
def test_to_uint8_equals_monai_scale_intensity_range(name: str) -> None:
    """Equal to MONAI's float32 pipeline, ties included: ScaleIntensityRange on a float32 tensor, then
    ``round(x * 255)`` in float32 (torch rounds half to even, like numpy)."""
    import torch
    from monai.transforms import ScaleIntensityRange

    window = win.get(name)
    lo, hi = window.bounds
    hu = np.arange(-2000, 4001, dtype=np.int16).reshape(1, -1)
    scaled = ScaleIntensityRange(a_min=lo, a_max=hi, b_min=0.0, b_max=1.0, clip=True)(torch.from_numpy(hu.astype(np.float32)))
    assert scaled.dtype == torch.float32
    expected = torch.round(torch.as_tensor(scaled) * 255).to(torch.uint8).numpy()
    np.testing.assert_array_equal(win.to_uint8(hu, window), expected)
    assert win.to_uint8(hu, window).min() == 0 and win.to_uint8(hu, window).max() == 255


# ---- 8. determinism across worker counts and archives --------------------------------------------
def test_two_workers_equal_one_worker(tmp_path: Path, run_ingest) -> None:
    src = tmp_path / "src"
    make_study(src, [SeriesSpec(**SMALL), SeriesSpec(**SMALL, orientation="oblique", multiframe=True)], seed=81)
    write_localizer(src, seed=82)
    report_1, store_1 = run_ingest(src, workers=1)
    report_2, store_2 = run_ingest(src, workers=2)
    assert report_1.counts == report_2.counts
    assert report_1.counts["ingested"] == 2
    assert store_dump(store_1) == store_dump(store_2)


def test_zip_and_tar_gz_equal_the_folder(tmp_path: Path, run_ingest) -> None:
    src = tmp_path / "src"
    gen = make_series(src, SeriesSpec(**SMALL, orientation="oblique"), seed=83)
    zip_path, tgz_path = tmp_path / "series.zip", tmp_path / "series.tar.gz"
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in gen.paths:
            archive.write(path, f"export/{path.name}")
    with tarfile.open(tgz_path, "w:gz") as archive:
        for path in gen.paths:
            archive.add(path, f"export/{path.name}")

    report_dir, store_dir = run_ingest(src)
    rec_dir = the_volume(report_dir, store_dir, gen)
    for archive_path in (zip_path, tgz_path):
        report, store = run_ingest(archive_path)
        rec = the_volume(report, store, gen)
        assert (rec.key, rec.digest, rec.shape) == (rec_dir.key, rec_dir.digest, rec_dir.shape)
        assert rec.to_json() == rec_dir.to_json()
        assert store_dump(store) == store_dump(store_dir)


def test_files_the_header_pass_sniffs_are_quarantined_and_expanded_as_discovery_would(tmp_path: Path,
                                                                                        run_ingest) -> None:
    """The local ingest discovers files without reading them (``discover(sniff=False)``) and its header
    workers sniff them: what it quarantines at the discover stage, the files and bytes it counts, and what it
    stores equal what discovery finds sniffing each file itself, archives in the folder included."""
    from medload.ingest.discover import DiscoveryProblem, discover

    src = tmp_path / "src"
    make_series(src / "plain", SeriesSpec(**SMALL), seed=86)
    zipped = make_series(tmp_path / "zipped", SeriesSpec(**SMALL, orientation="oblique"), seed=87)
    with zipfile.ZipFile(src / "export.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for path in zipped.paths:
            archive.write(path, f"export/{path.name}")
        archive.writestr("export/notes.txt", "not an image")
    with tarfile.open(src / "empty.tar.gz", "w:gz"):
        pass
    (src / "README.txt").write_text("a study export")
    (src / "zeros.dcm").write_bytes(bytes(4096))
    (src / "empty.dcm").write_bytes(b"")
    found = list(discover(src, spool_dir=tmp_path / "spool"))
    refs = [f for f in found if not isinstance(f, DiscoveryProblem)]
    problems = sorted((p.status, p.reason, p.display) for p in found if isinstance(p, DiscoveryProblem))
    assert len(problems) == 5 and len(refs) == 2 * SMALL["n_slices"]

    for workers in (1, 2):
        report, store = run_ingest(src, workers=workers)
        assert report.counts["ingested"] == 2 and report.files == len(refs)
        assert report.bytes == sum(r.size for r in refs)
        assert sorted((r.status, r.reason, r.source) for r in report.rejects if r.stage == "discover") == problems
        assert len(store.series()) == 2


def test_sources_whose_files_are_none_of_them_dicom_are_refused_after_the_header_pass(tmp_path: Path) -> None:
    """Discovery no longer reads the files: a folder of text and zeros still stops the ingest with the
    error naming what it holds, and leaves no store behind."""
    from medload.config import IngestConfig
    from medload.errors import NoDicomError
    from medload.ingest.run import ingest

    src = tmp_path / "docs"
    src.mkdir()
    (src / "notes.txt").write_text("nothing to see")
    (src / "blank.dcm").write_bytes(bytes(2048))
    with pytest.raises(NoDicomError, match=r"no DICOM found .*1 ignored.*1 rejected"):
        ingest(src, tmp_path / "store", config=IngestConfig(workers=2))
    assert not (tmp_path / "store").exists()


# ---- 9. idempotence --------------------------------------------------------------------------------
def test_reingest_is_idempotent_and_adds_only_new_series(tmp_path: Path, run_ingest) -> None:
    src = tmp_path / "src"
    gens = make_study(src, [SeriesSpec(**SMALL), SeriesSpec(**SMALL, orientation="oblique")], seed=91)
    write_broken_files(src / "junk", gens[0].paths[0])  # quarantine records must not be written twice either
    store_path = tmp_path / "store"
    report, store = run_ingest(src, store_path)
    assert report.counts["ingested"] == 2
    assert len(store.rejects()) == 3
    store.close()  # see test_ingest_into_a_store_this_process_is_reading
    before = file_hashes(store_path)
    assert any(name.endswith("data.mdb") for name in before)

    report, store = run_ingest(src, store_path)
    assert [s.status for s in report.series] == ["present", "present"]
    assert file_hashes(store_path) == before
    assert len(store.rejects()) == 3
    store.close()

    more = tmp_path / "more"
    shutil.copytree(src, more)
    new = make_series(more, SeriesSpec(**SMALL, signed=True, bits_stored=16, rescale_intercept=0.0), seed=92,
                      study_uid=gens[0].study_uid, series_number=3)
    report, store = run_ingest(more, store_path)
    assert sorted(s.status for s in report.series) == ["ingested", "present", "present"]
    (ingested,) = by_status(report, "ingested")
    assert len(store.series()) == 3
    assert_matches_truth(store, store.record(ingested.key), new)


def test_ingest_into_a_store_this_process_is_reading(tmp_path: Path, run_ingest) -> None:
    """Notebook workflow: ingest, look at the store, ingest more into it from the same process.

    The writer must not trip over the reader's LMDB environment (py-lmdb refuses to open one
    environment twice in a process); a reader that refreshes then sees both series.
    """
    first = make_series(tmp_path / "one", SeriesSpec(**SMALL), seed=95)
    second = make_series(tmp_path / "two", SeriesSpec(**SMALL, orientation="oblique"), seed=96)
    store_path = tmp_path / "store"
    _, store = run_ingest(tmp_path / "one", store_path)
    assert len(store.series()) == 1  # opens the published shard in this process
    report, _ = run_ingest(tmp_path / "two", store_path)
    assert report.counts["ingested"] == 1
    store.refresh()
    assert len(store.series()) == 2
    for gen in (first, second):
        (rec,) = [r for r in store.series() if np.allclose(np.array(r.positions), gen.ipp)]
        assert_matches_truth(store, rec, gen)


# ---- 10. privacy ---------------------------------------------------------------------------------
def test_no_identifier_reaches_any_store_file(tmp_path: Path, run_ingest) -> None:
    src = tmp_path / "src"
    gens = [
        make_series(src, SeriesSpec(**SMALL), seed=101, patient_id="PRIVID-73519", patient_name="Privacy^Patricia"),
        make_series(src, SeriesSpec(**SMALL, multiframe=True, orientation="oblique"), seed=102,
                    patient_id="PRIVID-73519", patient_name="Privacy^Patricia", series_number=2),
    ]
    study_uid = gens[0].study_uid
    write_localizer(src, seed=103, study_uid=study_uid)
    write_secondary_capture(src, seed=104, study_uid=study_uid)
    write_broken_files(src / "broken", gens[0].paths[0])
    # a third series arrives in a compressed tar, whose members are spooled inside the store while ingesting
    packed = make_series(tmp_path / "packed", SeriesSpec(**SMALL), seed=105, study_uid=study_uid,
                         patient_id="PRIVID-73519", patient_name="Privacy^Patricia", series_number=3)
    with tarfile.open(tmp_path / "more.tar.gz", "w:gz") as archive:
        for path in packed.paths:
            archive.add(path, f"export/{path.name}")
    report, store = run_ingest([src, tmp_path / "more.tar.gz"], windows=("lung",))
    assert report.counts["ingested"] == 3
    assert list((store.path / "staging").iterdir()) == []  # the spool is gone

    secrets: set[str] = set()
    for path in sorted(src.rglob("*.dcm")) + packed.paths:
        try:
            ds = pydicom.dcmread(path, stop_before_pixels=True)
        except Exception:
            continue  # the note that is not DICOM
        for keyword in ("PatientName", "PatientID", "PatientBirthDate", "AccessionNumber",
                        "StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID", "FrameOfReferenceUID"):
            value = str(ds.get(keyword, "") or "")
            if value:
                secrets.add(value)
    assert {"Privacy^Patricia", "PRIVID-73519", study_uid} <= secrets
    assert len(secrets) > 20  # every instance UID is in the list
    files = [p for p in store.path.rglob("*") if p.is_file()]
    assert any(p.name == "data.mdb" for p in files)
    for path in files:
        data = path.read_bytes()
        leaked = sorted(s for s in secrets if s.encode() in data)
        assert leaked == [], f"{path.relative_to(store.path)} contains {leaked}"


def test_deflated_transfer_syntax_is_decoded_through_pydicom(tmp_path: Path, run_ingest) -> None:
    """Deflated Explicit VR LE: file offsets mean nothing after inflation, so pixels come from pydicom."""
    gen = make_series(tmp_path / "plain", SeriesSpec(**SMALL), seed=21)
    (tmp_path / "deflated").mkdir()
    for path in gen.paths:
        ds = pydicom.dcmread(path)
        ds.file_meta.TransferSyntaxUID = pydicom.uid.DeflatedExplicitVRLittleEndian
        ds.save_as(tmp_path / "deflated" / path.name)
    report, store = run_ingest(tmp_path / "deflated")
    rec = the_volume(report, store, gen)
    assert np.array_equal(store.read(rec.key), gen.hu)


def test_custom_window_planes_are_read_by_their_width_and_level(tmp_path: Path, run_ingest) -> None:
    gen = make_series(tmp_path / "src", SeriesSpec(**SMALL), seed=31)
    report, store = run_ingest(tmp_path / "src", windows=("350/50",))
    rec = the_volume(report, store, gen)
    expected = win.to_uint8(gen.hu, win.get("350/50"))
    assert np.array_equal(store.read(rec.key, plane="350/50"), expected)
    with pytest.raises(ConfigError, match="no stored 'lung' planes"):
        store.read(rec.key, plane="lung")
