"""Exploring a store: the catalog and its filters feeding datasets, plots, and ``medload view`` PNGs."""

from __future__ import annotations

import doctest
import subprocess
import sys

import matplotlib
import numpy as np
import pydicom
import pytest
from conftest import PHILIPS
from PIL import Image

from medload import viz
from medload import windows as win
from medload.config import IngestConfig
from medload.data import SlabDataset, SliceDataset
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.catalog import COLUMNS
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_rtstruct, make_series

matplotlib.use("Agg")
CFG = IngestConfig(workers=1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Three synthetic series: 1 mm B30f (labelled by an RTSTRUCT: a 'liver' square on slices 2-4),
    3 mm B30f and 1 mm B70f from another scanner. Returns (store, {kernel, thickness: key})."""
    root = tmp_path_factory.mktemp("explore")
    gens = {
        ("B30f", 1.0): make_series(root / "src" / "a", SeriesSpec(n_slices=8, rows=32, cols=40, slice_spacing=1.0), seed=1),
        ("B30f", 3.0): make_series(root / "src" / "b", SeriesSpec(n_slices=5, rows=32, cols=40, slice_spacing=3.0), seed=2),
        ("B70f", 1.0): make_series(root / "src" / "c", SeriesSpec(n_slices=6, rows=20, cols=24, slice_spacing=1.0), seed=3,
                                   patient_id="SYN-0002"),
    }
    for (kernel, _), gen in gens.items():
        for path in gen.paths:
            ds = pydicom.dcmread(path)
            ds.ConvolutionKernel = kernel
            ds.Manufacturer, ds.ManufacturerModelName = ("SIEMENS", "SOMATOM") if kernel == "B30f" else ("GE", "Revolution")
            ds.save_as(path)
    square = np.array([[9.5, 7.5], [20.5, 7.5], [20.5, 15.5], [9.5, 15.5]])  # (column, row) corners
    make_rtstruct(gens["B30f", 1.0], {"Liver": [(z, [square]) for z in (2, 3, 4)]}, root / "src" / "a" / "rt.dcm")
    ingest(root / "src", root / "store", config=CFG, roi_map={"liver": ["Liver"]})
    store = open_store(root / "store")
    keys = {}
    for rec in store.series():
        (match,) = [k for k, g in gens.items() if g.hu.shape == rec.shape and np.allclose(rec.affine, g.affine_ras, atol=1e-4)]
        keys[match] = rec.key
    return store, keys


def test_catalog_has_a_row_per_series_with_scanner_geometry_labels_and_pseudonyms(built):
    store, keys = built
    cat = store.catalog()
    assert tuple(cat.columns) == COLUMNS and len(cat) == 3
    assert list(cat.key) == sorted(keys.values())
    row = cat.set_index("key").loc[keys["B30f", 1.0]]
    rec = store.record(keys["B30f", 1.0])
    assert (row.kernel, row.manufacturer, row.model, row.modality) == ("B30f", "SIEMENS", "SOMATOM", "CT")
    assert (row.slices, row.rows, row.columns) == rec.shape == (8, 32, 40)
    assert (row.spacing_x, row.spacing_y, row.spacing_z) == pytest.approx(rec.spacing)
    assert row.slice_thickness == 1.0 and row.labelled and row.label_classes == ("liver",)
    assert (row.patient, row.study, row.shard) == (rec.patient, rec.study, rec.shard)
    assert "SYN-0001" not in set(cat.patient) and cat.patient.nunique() == 2  # pseudonyms, one per patient
    assert cat.labelled.sum() == 1 and cat.set_index("key").loc[keys["B70f", 1.0]].label_classes == ()
    assert cat.slices.dtype == np.int64 and cat.slice_thickness.dtype == np.float64


def test_catalog_filters_feed_datasets(built):
    store, keys = built
    cat = store.catalog()
    b30 = cat.query("kernel == 'B30f'")
    ds = SliceDataset(store, context=1, keys=b30.key)
    assert set(ds.index.keys) == {keys["B30f", 1.0], keys["B30f", 3.0]} and len(ds) == 8 + 5
    assert len(SliceDataset(store, context=1, keys=b30)) == 13  # the filtered frame itself
    thin = cat[(cat.slice_thickness <= 1.5) & (cat.rows == 32)]
    assert SliceDataset(store, keys=thin.key).index.keys == (keys["B30f", 1.0],)
    assert SliceDataset(store, keys=keys["B70f", 1.0][:6]).index.keys == (keys["B70f", 1.0],)  # one prefix, not letters
    assert len(SlabDataset(store, depth=4, keys=cat[cat.labelled].key, labels=True)) == 2
    assert SliceDataset(store, kernel=cat.kernel.unique()).index.keys == tuple(sorted(keys.values()))
    with pytest.raises(ConfigError, match="no series"):
        SliceDataset(store, keys=cat.query("kernel == 'nope'").key)
    with pytest.raises(ConfigError, match="'key' column"):
        SliceDataset(store, keys=cat[["kernel"]])


def test_import_medload_loads_neither_pandas_nor_matplotlib():
    code = "import sys, medload; print(sorted({'pandas', 'matplotlib'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


def test_render_windows_and_tints():
    (example,) = doctest.DocTestFinder().find(viz.render, globs={"render": viz.render, "np": np})
    assert doctest.DocTestRunner().run(example).failed == 0
    hu = np.array([[-1000, 0, 40, 3000]], dtype=np.int16)
    assert np.array_equal(viz.render(hu, "lung")[..., 1], win.to_uint8(hu, win.get("lung")))
    assert np.array_equal(viz.render(np.array([[0.0, 0.5, 2.0]]), None)[0, :, 0], [0, 128, 255])  # 0..1 batches
    label = np.array([[0, 1, 0, 2]])
    rgb = viz.render(hu, "soft_tissue", label, alpha=1.0)
    assert (rgb[0, 0] == 0).all() and (rgb[0, 2] == 128).all()  # background stays grey
    assert len({tuple(rgb[0, 1]), tuple(rgb[0, 3])}) == 2 and rgb[0, 1, 0] != rgb[0, 1, 2]  # two colours
    target = viz.render(np.zeros((1, 2), np.float32), None, np.array([[0.0, 1.0]]))  # a float target, as in training
    assert (target[0, 0] == 0).all() and target[0, 1].any()
    with pytest.raises(ConfigError, match="label shape"):
        viz.render(hu, "lung", label[:, :3])
    with pytest.raises(ConfigError, match="one \\(H, W\\) image"):
        viz.render(hu[None], "lung")


def test_plots_draw_slices_samples_montages_and_histograms(built):
    import matplotlib.pyplot as plt

    store, keys = built
    key = keys["B30f", 1.0]
    ax = viz.show_slice(store, key, 3, window="bone", label=True)
    assert "z=3 bone" in ax.get_title() and [t.get_text() for t in ax.get_legend().get_texts()] == ["liver"]
    fig = viz.show_sample(SliceDataset(store, context=2, keys=[key])[3], window="soft_tissue")
    assert len(fig.axes) == 5 and "z=3" in fig.texts[0].get_text()
    fig = viz.show_sample(SlabDataset(store, depth=4, keys=[key])[0], window="lung")
    assert len(fig.axes) == 4
    ax = viz.montage(store, key, window="brain", count=5, columns=3)
    assert ax.images[0].get_array().shape == (2 * 32, 3 * 40, 3) and len(ax.texts) == 5
    ax = viz.hu_histogram(store, key, windows=("lung", "bone"))
    assert len(ax.get_legend().get_texts()) == 2
    plt.close("all")


def _medload(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True)


def _png(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.fixture(scope="module")
def philips(tmp_path_factory):
    """The real sample study, ingested; returns (store, key)."""
    path = tmp_path_factory.mktemp("philips") / "store"
    ingest(PHILIPS / "dicom", path, config=CFG)
    store = open_store(path)
    return store, store.series()[0].key


def test_view_writes_the_window_of_a_real_slice(philips, tmp_path):
    """Each pixel is the window's grey level of its voxel; so the windows order their dark and white
    fractions as their bounds do, and air is black in soft tissue but mid-grey in lung."""
    store, key = philips
    hu = store.read(key, 10, 11)[0]
    pngs = {}
    for name in ("brain", "soft_tissue", "lung", "bone"):
        out = tmp_path / f"{name}.png"
        proc = _medload("view", store.path, key[:8], "--z", 10, "--window", name, "-o", out)
        assert proc.returncode == 0, proc.stderr
        pngs[name] = _png(out)
        assert pngs[name].shape == (512, 512, 3) and np.array_equal(pngs[name][..., 0], win.to_uint8(hu, win.get(name)))
        assert np.array_equal(pngs[name][..., 0], pngs[name][..., 2])  # grey: no label
    air = hu < -900
    assert air.mean() > 0.3
    assert (pngs["soft_tissue"][air] == 0).all() and (pngs["bone"][air] == 0).all()
    darkest, brightest = win.to_uint8(np.array([-1024, -900]), win.get("lung"))  # air: 55..77 of 255 in lung
    assert darkest <= pngs["lung"][air].min() and pngs["lung"][air].max() <= brightest and darkest > 50
    mean = {n: p.mean() for n, p in pngs.items()}
    assert mean["lung"] > mean["brain"] > mean["soft_tissue"] > mean["bone"]
    white = {n: (p[..., 0] == 255).mean() for n, p in pngs.items()}
    assert white["brain"] >= white["lung"] >= white["soft_tissue"] >= white["bone"] and white["brain"] > white["bone"]
    proc = _medload("view", store.path, key[:8], "--montage", 6, "--window", "350/50", "-o", tmp_path / "m.png")
    assert proc.returncode == 0 and _png(tmp_path / "m.png").shape == (512, 6 * 512, 3)


def test_view_tints_labels_and_explains_bad_requests(built, tmp_path):
    store, keys = built
    key = keys["B30f", 1.0]
    out = tmp_path / "label.png"
    assert _medload("view", store.path, key, "--z", 3, "--label", "-o", out).returncode == 0
    rgb = _png(out).astype(int)
    tinted = (rgb[..., 0] != rgb[..., 1]) | (rgb[..., 1] != rgb[..., 2])
    assert np.array_equal(tinted, store.read_label(key, 3, 4)[0] > 0)
    proc = _medload("view", store.path, keys["B70f", 1.0], "--label", "-o", out)
    assert proc.returncode == 2 and "has no labels" in proc.stderr
    proc = _medload("view", store.path, key, "--z", 99, "-o", out)
    assert proc.returncode == 2 and "outside series" in proc.stderr
    proc = _medload("view", store.path, key, "--window", "wide", "-o", out)
    assert proc.returncode == 2 and "unknown window 'wide'" in proc.stderr
