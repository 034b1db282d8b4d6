"""3D patches (medload.data.PatchDataset) against MONAI, on series whose geometry a patch has to undo.

Reference: MONAI's ``SpatialResample`` of the exported NIfTI (``export_nifti``, as ``medload export``
writes it, read with MONAI's ``LoadImage``) onto each sample's affine and shape. Tolerances: the image
within 0.05 HU (medload interpolates in float32, MONAI in float64); the label exactly, except where a
target point lies within 1e-6 voxel of halfway between two source voxels (nearest's tie, which either
side may break) -- the spacings here are chosen so that no point of these samples does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.patch_store import LUNG, SERIES, SPINE, make_patch_store
from monai.transforms import LoadImage, SpatialResample

from medload.data import PatchDataset
from medload.data.patch_geometry import series_index_affine, voxel_to_voxel
from medload.data.resample import source_points
from medload.errors import ConfigError
from medload.storage.nifti import export_nifti
from medload.storage.store import open_store

PATCH = (10, 18, 22)
#: (orientation, spacing): canonical and ITK orientations at spacings no grid here shares, and each
#: series' own orientation and spacing.
GRIDS = [("RAS", (2.1, 1.13, 0.97)), ("LPS", (1.7, 0.77, 1.31)), ("RAS", None), (None, None)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return open_store(make_patch_store(tmp_path_factory.mktemp("patches")))


@pytest.fixture(scope="module")
def exported(store, tmp_path_factory):
    """Each series' image and label as MONAI loads their NIfTI export."""
    folder = tmp_path_factory.mktemp("nifti")
    load = LoadImage(image_only=True, ensure_channel_first=True)
    return {r.key: (load(export_nifti(store, r.key, folder / f"{r.key}.nii.gz")),
                    load(export_nifti(store, r.key, folder / f"{r.key}_label.nii.gz", label=True)))
            for r in store.series()}


def _monai(image, affine: np.ndarray, mode: str, pad: float = 0.0) -> np.ndarray:
    """``image`` resampled by MONAI onto a patch's affine ``(d, h, w)``: MONAI's arrays are ``(x, y, z)``,
    the patch's axes reversed; MONAI pads with 0, so an image is resampled less ``pad`` and given it back."""
    dst = torch.as_tensor(affine[:, [2, 1, 0, 3]])
    out = SpatialResample(mode=mode, padding_mode="zeros")(image - pad, dst_affine=dst, spatial_size=PATCH[::-1])
    return out.numpy()[0].transpose(2, 1, 0) + pad


def _ties(store, key: str, affine: np.ndarray) -> np.ndarray:
    """Where a patch point lies within 1e-6 voxel of halfway between two source voxels."""
    points = source_points(voxel_to_voxel(affine, store.record(key).affine), PATCH)
    return (np.abs(points - np.floor(points) - 0.5) < 1e-6).any(axis=-1)


@pytest.mark.parametrize(("orientation", "spacing"), GRIDS)
def test_every_sample_is_monai_spatial_resample_of_the_nifti_export(store, exported, orientation, spacing):
    ds = PatchDataset(store, PATCH, spacing, orientation, samples_per_epoch=24, seed=3)
    seen = set()
    for i in range(len(ds)):
        sample = ds[i]
        image, label = exported[sample["key"]]
        affine = sample["image"].affine.numpy()
        assert sample["image"].shape == (1, *PATCH) and sample["image"].dtype == torch.float32
        assert np.array_equal(sample["label"].affine.numpy(), affine)
        np.testing.assert_allclose(sample["image"].numpy()[0], _monai(image, affine, "bilinear", pad=-1024.0),
                                   atol=0.05, rtol=0)
        differ = sample["label"].numpy()[0] != _monai(label, affine, "nearest")
        assert not (differ & ~_ties(store, sample["key"], affine)).any(), f"sample {i}: label differs"
        seen.add((sample["key"], sample["foreground"]))
    assert {k for k, _ in seen} == {r.key for r in store.series()}  # every series, ...
    assert {fg for _, fg in seen} == {True, False}                  # ... centred on labels and not


def test_the_patch_affine_is_the_requested_grid(store):
    """Spacing along the axes the orientation code names, the centre on voxel n // 2, whatever the series."""
    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), "LPS", samples_per_epoch=8, seed=1)
    for i in range(len(ds)):
        sample = ds[i]
        affine = sample["image"].affine.numpy()
        np.testing.assert_allclose(affine[:3, :3], [[0, 0, -0.97], [0, -1.13, 0], [2.1, 0, 0]], atol=1e-12)
        np.testing.assert_allclose(affine @ [*(np.array(PATCH) // 2), 1], [*sample["centre"].numpy(), 1])


def test_own_orientation_and_spacing_at_a_labelled_voxel_is_the_stored_grid(store):
    """A foreground patch at the series' own grid copies stored voxels: no interpolation at all."""
    ds = PatchDataset(store, (5, 7, 9), None, None, foreground=1.0, samples_per_epoch=12, seed=2)
    for i in range(len(ds)):
        sample, draw = ds[i], ds.draw(i)
        rec = ds.records[draw.series]
        start = np.rint(voxel_to_voxel(sample["image"].affine.numpy(), rec.affine)[:3, 3]).astype(int)
        image = np.full((5, 7, 9), -1024, np.int16)
        label = np.zeros((5, 7, 9), np.uint8)
        lo, hi = np.maximum(start, 0), np.minimum(start + (5, 7, 9), rec.shape)
        inner = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))
        image[inner] = store.read(rec.key, lo[0], hi[0])[:, lo[1]:hi[1], lo[2]:hi[2]]
        label[inner] = store.read_label(rec.key, lo[0], hi[0])[:, lo[1]:hi[1], lo[2]:hi[2]]
        np.testing.assert_allclose(sample["image"].numpy()[0], image, atol=0.01)
        assert np.array_equal(sample["label"].numpy()[0], label)


def _stored_index(ds: PatchDataset, i: int) -> tuple[np.ndarray, object]:
    centre, draw = ds.centre(i)
    rec = ds.records[draw.series]
    return np.linalg.solve(series_index_affine(rec.affine), [*centre, 1.0])[:3], draw


def test_centres_inside_the_volume_and_foreground_at_the_requested_rate(store):
    """10,000 draws: every centre inside its series; the share drawn on a label within 3 standard errors of
    ``foreground``, each such centre on a voxel of its class, the class chosen uniformly among those
    present (nnU-Net's rule: spine as often as lung, though lung has far more voxels), and the share of
    centres on any labelled voxel what uniform centres add to that."""
    n, f = 10_000, 0.33
    ds = PatchDataset(store, PATCH, (2.0, 1.0, 1.0), foreground=f, samples_per_epoch=n, seed=7)
    labels = [store.read_label(r.key) for r in ds.records]
    assert all(set(np.unique(lab)) == {0, SPINE, LUNG} for lab in labels)  # both classes in every series
    drawn, on_label, spine = 0, 0, 0
    for i in range(n):
        index, draw = _stored_index(ds, i)
        shape = np.array(ds.records[draw.series].shape)
        assert (index > -1e-9).all() and (index < shape - 1 + 1e-9).all(), f"draw {i} centred outside: {index}"
        value = labels[draw.series][tuple(np.rint(index).astype(int))]
        if draw.foreground:
            assert value == draw.class_id and np.allclose(index, np.rint(index))
            drawn += 1
            spine += draw.class_id == SPINE
        on_label += value > 0
    assert abs(drawn / n - f) < 3 * np.sqrt(f * (1 - f) / n)
    assert abs(spine / drawn - 0.5) < 3 * np.sqrt(0.25 / drawn)
    # a uniform centre lands on a labelled voxel with that voxel's share of the volume (edge voxels: half a
    # voxel inside per axis); series are drawn uniformly
    q = np.mean([np.average(lab > 0, weights=_edge_weights(lab.shape)) for lab in labels])
    expected = f + (1 - f) * q
    assert abs(on_label / n - expected) < 3 * np.sqrt(expected * (1 - expected) / n)


def _edge_weights(shape) -> np.ndarray:
    out = np.ones(shape)
    for axis, size in enumerate(shape):
        edge = [slice(None)] * 3
        for k in (0, size - 1):
            edge[axis] = slice(k, k + 1)
            out[tuple(edge)] *= 0.5
    return out


def test_labels_are_never_interpolated(store):
    stored_ids = {0} | {c for r in store.series() for c in store.labels(r.key).class_ids}
    ds = PatchDataset(store, PATCH, (1.37, 0.61, 2.2), "RAS", samples_per_epoch=24, seed=5)
    for i in range(len(ds)):
        label = ds[i]["label"]
        assert label.dtype == torch.uint8
        assert set(torch.unique(label).tolist()) <= stored_ids


def test_deterministic_per_seed_epoch_and_index_in_any_worker(store):
    def batches(ds, workers):
        loader = torch.utils.data.DataLoader(ds, batch_size=3, num_workers=workers)
        return [(b["image"].as_tensor(), b["label"].as_tensor(), b["centre"]) for b in loader]

    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=6, seed=11)
    first = batches(ds, 0)
    assert all(all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(first, batches(ds, 2)))
    assert all(torch.equal(a, b) for a, b in zip(first[0], batches(PatchDataset(
        store, PATCH, (2.1, 1.13, 0.97), samples_per_epoch=6, seed=11), 0)[0]))
    ds.set_epoch(1)
    assert not torch.equal(batches(ds, 0)[0][2], first[0][2])           # a new epoch, new centres
    assert ds.draw(0) != PatchDataset(store, PATCH, samples_per_epoch=6, seed=12).draw(0)
    ds.set_epoch(0)
    assert torch.equal(batches(ds, 0)[0][0], first[0][0])


def test_one_range_read_of_the_slices_the_patch_reaches(store, monkeypatch):
    """Each sample reads one slice range of the image and of the label, no wider than the patch's extent
    plus one slice each side."""
    reads: list[tuple[str, int, int]] = []
    for name in ("planes", "read_label"):
        real = getattr(store, name)
        monkeypatch.setattr(store, name, lambda key, z0=0, z1=None, *, _real=real, _name=name, **kw: (
            reads.append((_name, z0, z1)), _real(key, z0, z1, **kw))[1])
    ds = PatchDataset(store, PATCH, (2.1, 1.13, 0.97), foreground=0.0, samples_per_epoch=8, seed=4)
    for i in range(len(ds)):
        reads.clear()
        sample = ds[i]
        rec = store.record(sample["key"])
        points = source_points(voxel_to_voxel(sample["image"].affine.numpy(), rec.affine), PATCH)[..., 0]
        lo, hi = max(int(np.floor(points.min())), 0), min(int(np.floor(points.max())) + 2, rec.shape[0])
        assert reads == [("planes", lo, hi), ("read_label", lo, hi)]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"orientation": "RAX"}, "orientation 'RAX'"), ({"orientation": "RRS"}, "one of R/L, A/P and S/I"),
    ({"patch": (0, 4, 4)}, "patch size must be >= 1"), ({"patch": (4, 4)}, "three sizes"),
    ({"spacing": (1.0, -1.0, 1.0)}, "spacing must be positive"), ({"foreground": 1.5}, "probability"),
    ({"keys": ["ffff"]}, "no series"), ({"samples_per_epoch": 0}, "samples_per_epoch must be >= 1"),
])
def test_bad_arguments_say_what_to_change(store, kwargs, message):
    args = {"patch": PATCH, **kwargs}
    with pytest.raises(ConfigError, match=message):
        PatchDataset(store, **args)[0]


def test_every_series_in_the_store_is_one_of_these_geometries(store):
    """The fixture holds what its names say (a guard on tests/helpers/patch_store.py)."""
    assert len(store.series()) == len(SERIES)
    slice_axes = {tuple(np.round(np.asarray(r.affine)[:3, 2] / np.linalg.norm(np.asarray(r.affine)[:3, 2]), 1))
                  for r in store.series()}
    assert (0.0, 0.0, -1.0) in slice_axes   # feet-first: slices run head to foot
    assert (1.0, 0.0, 0.0) in slice_axes    # sagittal
