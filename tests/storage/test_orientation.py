"""The plane of each series -- axial, coronal, sagittal, oblique -- in the catalog, `medload ls`, the datasets'
and Store.items' orientation= filter, and the 10 degree tolerance it is named with."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

from medload.config import IngestConfig
from medload.data import SliceDataset
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.orientation import TOLERANCE_DEGREES, plane_of, series_orientation
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series


def _tilted(degrees: float) -> tuple[float, ...]:
    """ImageOrientationPatient of an axial plane tilted ``degrees`` about the patient's left-right axis."""
    a = math.radians(degrees)
    return (1.0, 0.0, 0.0, 0.0, math.cos(a), math.sin(a))


#: series number -> (ImageOrientationPatient, the plane it is in, slices)
PLANES = {1: ((1.0, 0.0, 0.0, 0.0, 1.0, 0.0), "axial", 4),
          2: ((0.0, 1.0, 0.0, 0.0, 0.0, -1.0), "sagittal", 5),   # rows along P, columns down: normal along x
          3: ((1.0, 0.0, 0.0, 0.0, 0.0, -1.0), "coronal", 6),    # rows along L, columns down: normal along y
          4: (_tilted(6.0), "axial", 7),                           # within the tolerance
          5: (_tilted(20.0), "oblique", 8)}                        # a gantry-tilt-like 20 degrees


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("planes")
    for number, (cosines, _, slices) in PLANES.items():
        make_series(root / "src" / f"s{number}", SeriesSpec(n_slices=slices, rows=12, cols=14, orientation=cosines),
                    seed=number, series_number=number)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"


def _plane_by_slices(store) -> dict[int, str]:
    return {rec.shape[0]: series_orientation(rec) for rec in store.series()}


def test_each_series_is_named_after_the_plane_of_its_slices(store_path):
    store = open_store(store_path)
    assert _plane_by_slices(store) == {slices: plane for _, plane, slices in PLANES.values()}
    cat = store.catalog()
    assert dict(zip(cat.slices, cat.orientation)) == _plane_by_slices(store)
    assert len(cat.query("orientation == 'axial'")) == 2  # the catalog filters on it


def test_the_orientation_filter_selects_series_by_plane_and_says_what_is_stored(store_path):
    store = open_store(store_path)
    assert len(SliceDataset(store, context=0, orientation="axial")) == 4 + 7
    assert len(SliceDataset(store, context=0, orientation=["Sagittal", "coronal"])) == 5 + 6  # any case
    assert len(SliceDataset(store, context=0, orientation="oblique")) == 8
    assert [it["z"] for it in store.items(context=0, orientation="coronal")] == list(range(6))
    with pytest.raises(ConfigError, match="orientation 'transverse': choose from axial, coronal, sagittal, oblique"):
        SliceDataset(store, orientation="transverse")
    with pytest.raises(ConfigError, match=r"thickness=\(9.0, 9.5\) matched 0 of 5 \(stored thicknesses: 2.5 mm\); "
                                          r"orientation='sagittal' matched 1 of 5 \(stored orientations: axial, "
                                          r"coronal, oblique, sagittal\)"):
        SliceDataset(store, orientation="sagittal", thickness=(9.0, 9.5))


def test_medload_ls_shows_the_plane(store_path):
    out = subprocess.run([sys.executable, "-m", "medload.cli", "ls", str(store_path)], capture_output=True, text=True,
                         check=True, env=os.environ.copy()).stdout
    planes = sorted(line.split()[3] for line in out.splitlines())
    assert planes == sorted(plane for _, plane, _ in PLANES.values())


@pytest.mark.parametrize(("degrees", "plane"), [(0.0, "axial"), (TOLERANCE_DEGREES - 0.1, "axial"),
                                                (TOLERANCE_DEGREES + 0.1, "oblique"), (45.0, "oblique"),
                                                (90.0 - TOLERANCE_DEGREES + 0.1, "coronal")])
def test_the_tolerance_is_the_angle_between_the_slice_normal_and_the_nearest_patient_axis(degrees, plane):
    a = math.radians(degrees)
    affine = np.eye(4)
    affine[:3, 1] = [0.0, math.cos(a), math.sin(a)]  # rows tilt from y towards z: the normal from z towards -y
    affine[:3, :3] *= 0.7  # spacing does not change the plane
    assert plane_of(affine) == plane
