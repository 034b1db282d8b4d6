"""Plausibility of decoded CT (medload.ingest.plausibility): corrupt pixels that still decode are caught,
real scans are not, and the policy (reject, flag, off) decides what happens to the series."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pydicom
import pytest
from conftest import PHILIPS

from medload.ingest.plausibility import HU_RANGE, outlier_slice, series_problem, thumbnail, value_problem
from medload.synthetic import SeriesSpec, make_series
from medload.synthetic.broken import element_offset


def _philips_hu() -> list[np.ndarray]:
    """The real Philips head series (S2010) as HU, in slice order."""
    dss = [pydicom.dcmread(p) for p in sorted((PHILIPS / "dicom" / "S2010").iterdir())]
    dss.sort(key=lambda d: float(d.ImagePositionPatient[2]))
    return [d.pixel_array.astype(np.int16) * int(d.RescaleSlope) + int(d.RescaleIntercept) for d in dss]


def test_real_scans_are_plausible():
    hu = _philips_hu()
    assert all(value_problem(plane) is None for plane in hu)
    assert outlier_slice([thumbnail(plane) for plane in hu]) is None


def test_values_no_scanner_writes_are_caught_but_a_fill_value_is_not():
    plane = np.full((64, 64), 40, dtype=np.int16)
    plane[:8] = -32768                       # undeclared padding outside the field of view: one value
    plane[-1, :2] = HU_RANGE[1]              # saturated metal
    assert value_problem(plane) is None
    rng = np.random.default_rng(0)
    plane[20, :10] = rng.integers(-32768, HU_RANGE[0], 10)  # scattered corrupt values
    assert "outside -10240..30710 HU" in value_problem(plane)


def test_a_slice_unlike_its_neighbours_is_found_at_any_position():
    hu = _philips_hu()
    rng = np.random.default_rng(1)
    for z in (0, 13, len(hu) - 1):
        damaged = list(hu)
        damaged[z] = rng.integers(-1024, 3072, hu[z].shape).astype(np.int16)
        found = series_problem([None] * len(hu), [thumbnail(p) for p in damaged])
        assert found is not None and found[0] == z and "differs from its neighbours" in found[1]


@pytest.fixture
def corrupt_series(tmp_path: Path) -> Path:
    """A good series of 10 slices but one, whose stored values are random bytes (12 bits kept)."""
    gen = make_series(tmp_path / "src", SeriesSpec(n_slices=10, rows=32, cols=32), seed=5)
    data = gen.paths[6].read_bytes()
    first = element_offset(data, 0x7FE00010, b"OW") + 12
    noise = np.random.default_rng(2).bytes(32 * 32 * 2)
    gen.paths[6].write_bytes(data[:first] + noise + data[first + len(noise) :])
    return tmp_path / "src"


@pytest.mark.parametrize("policy", ["reject", "flag", "off"])
def test_the_policy_rejects_flags_or_ignores(corrupt_series, run_ingest, policy):
    report, store = run_ingest(corrupt_series, plausibility=policy)
    if policy == "reject":
        (record,) = report.quarantined("rejected")
        assert record.stage == "plausibility" and record.source.endswith(".dcm") and record.sha256
        assert record.reason.startswith("slice 6: differs from its neighbours") and not store.series()
    else:
        (rec,) = store.series()
        assert ("implausible_slice_6" in rec.flags) == (policy == "flag")
