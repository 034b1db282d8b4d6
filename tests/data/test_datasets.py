"""2.5D/3D datasets, the MONAI reader and the fast loader, against the store and the ground truth."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pydicom
import pytest
import torch
from conftest import DEVICES
from monai.transforms import LoadImaged

from medload import windows as win
from medload.config import IngestConfig
from medload.data import MedloadReader, SlabDataset, SliceDataset, make_loader
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.storage.nifti import export_nifti
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Three series: two 20x24 axial (1 mm and 3 mm, kernels STANDARD and BONE) and one oblique
    16x16; ingested with a stored lung plane. Returns (store path, {key: GeneratedSeries})."""
    root = tmp_path_factory.mktemp("data")
    gens = [
        make_series(root / "src", SeriesSpec(n_slices=9, rows=20, cols=24, slice_spacing=1.0), seed=1, series_number=1),
        make_series(root / "src", SeriesSpec(n_slices=6, rows=20, cols=24, slice_spacing=3.0), seed=2, series_number=2),
        make_series(root / "src", SeriesSpec(n_slices=5, rows=16, cols=16, orientation="oblique"), seed=3,
                    series_number=3),
    ]
    for path in gens[1].paths:
        ds = pydicom.dcmread(path)
        ds.ConvolutionKernel = "BONE"
        ds.save_as(path)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1, windows=("lung",)))
    store = open_store(root / "store")
    by_key = {}
    for rec in store.series():
        (gen,) = [g for g in gens if g.hu.shape == rec.shape and np.allclose(rec.affine, g.affine_ras, atol=1e-4)]
        by_key[rec.key] = gen
    return root / "store", by_key


def _keys_of(by_key, slices: int) -> list[str]:
    return [k for k, g in by_key.items() if g.hu.shape[0] == slices]


def test_slice_items_replicate_edges_and_carry_their_affine(built):
    path, by_key = built
    key = _keys_of(by_key, 9)[0]
    hu = by_key[key].hu
    ds = SliceDataset(open_store(path), context=2, keys=[key])
    assert len(ds) == 9
    for i in range(len(ds)):
        item = ds[i]
        z = item["z"]
        expected = hu[np.clip(np.arange(z - 2, z + 3), 0, 8)]
        assert item["image"].shape == (5, 20, 24) and item["image"].dtype == torch.int16
        assert np.array_equal(item["image"].numpy(), expected)
        # the item affine maps (row, column, channel - k) where the series affine maps (column, row, slice)
        series_affine = np.asarray(by_key[key].affine_ras)
        for ch, r, c in ((2, 0, 0), (0, 3, 5), (4, 19, 23)):
            got = item["image"].affine.numpy() @ np.array([r, c, ch - 2, 1.0])
            assert np.allclose(got, series_affine @ np.array([c, r, z + ch - 2, 1.0]), atol=1e-6)


def test_slab_items_cover_every_slice_and_carry_their_affine(built):
    path, by_key = built
    key = _keys_of(by_key, 9)[0]
    ds = SlabDataset(open_store(path), depth=4, stride=3, keys=[key])
    starts = [ds[i]["z"] for i in range(len(ds))]
    assert starts == [0, 3, 5]  # the last slab ends at the last slice
    for i, z in enumerate(starts):
        item = ds[i]
        assert item["image"].shape == (1, 4, 20, 24)
        assert np.array_equal(item["image"][0].numpy(), by_key[key].hu[z : z + 4])
        got = item["image"].affine.numpy() @ np.array([1, 2, 3, 1.0])  # (slice, row, column)
        assert np.allclose(got, np.asarray(by_key[key].affine_ras) @ np.array([3, 2, z + 1, 1.0]), atol=1e-6)
    with pytest.warns(UserWarning, match="2 of 3 series have fewer than depth=7"):
        assert len(SlabDataset(open_store(path), depth=7)) == 2 + 0  # only the 9-slice series is thick enough


def test_filters_select_series(built):
    path, by_key = built
    store = open_store(path)
    assert len(SliceDataset(store, kernel="BONE")) == 6
    assert len(SliceDataset(store, thickness=(0.5, 1.5))) == 9
    assert len(SliceDataset(store, thickness=(2.0, 3.0))) == 6 + 5  # 3 mm and the oblique 2.5 mm
    assert len(SliceDataset(store, modality="CT")) == len(SliceDataset(store, modality="ct")) == 20  # any case
    assert len(SliceDataset(store, orientation="oblique")) == 5 and len(SliceDataset(store, orientation="axial")) == 15
    with pytest.raises(ConfigError, match="no series"):
        SliceDataset(store, modality="MR")


def test_a_selection_of_nothing_says_what_each_filter_matched(built):
    store = open_store(built[0])
    with pytest.raises(ConfigError, match=r"modality='MR' matched 0 of 3 \(stored modalities: CT\); "
                                          r"thickness=\(0.5, 0.8\) matched 0 of 3 \(stored thicknesses: 1.0, 2.5, 3.0 mm\)"):
        SliceDataset(store, modality="MR", thickness=(0.5, 0.8))
    with pytest.raises(ConfigError, match=r"kernel='BONE' matched 1 of 3 \(stored kernels: BONE, STANDARD\); "
                                          r"thickness=\(0.5, 1.5\) matched 1 of 3 .*; each matches some series, but "
                                          "no series matches all of them"):
        SlabDataset(store, depth=2, kernel="BONE", thickness=(0.5, 1.5))
    with pytest.raises(ConfigError, match=r"keys \(1 key\(s\) or prefixes\) matched 0 of 3"):
        store.items(context=0, keys="ffff")
    with pytest.raises(ConfigError, match="thickness is a range"):
        SliceDataset(store, thickness=(3.0, 1.0))


def test_a_cuda_device_the_machine_lacks_is_refused_when_the_loader_is_made(built):
    ds = SliceDataset(open_store(built[0]), context=0, keys=_keys_of(built[1], 9))
    missing = torch.cuda.device_count()  # one past the last GPU, on any machine
    with pytest.raises(ConfigError, match=f"cuda:{missing}"):
        make_loader(ds, 2, device=f"cuda:{missing}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU has a device='cuda'")
def test_device_cuda_without_a_gpu_is_a_config_error_not_a_failing_first_batch(built):
    ds = SliceDataset(open_store(built[0]), context=0, keys=_keys_of(built[1], 9))
    with pytest.raises(ConfigError, match="torch sees no CUDA device here.*device='cpu'"):
        make_loader(ds, 2, device="cuda")


def test_batches_equal_items_and_mixed_sizes_are_refused(built):
    path, by_key = built
    ds = SliceDataset(open_store(path), context=1, keys=_keys_of(by_key, 9) + _keys_of(by_key, 6))
    batch = ds.read_samples([0, 4, 10, 14])
    assert batch["image"].shape == (4, 3, 20, 24)
    for b, i in enumerate([0, 4, 10, 14]):
        assert np.array_equal(batch["image"][b], ds[i]["image"].numpy())
    mixed = SliceDataset(open_store(path), context=1)
    sizes = {tuple(mixed[i]["image"].shape[1:]) for i in range(len(mixed))}
    assert sizes == {(20, 24), (16, 16)}
    with pytest.raises(ConfigError, match="mixes matrix sizes"):
        mixed.read_samples(list(range(len(mixed))))


def test_stored_planes_are_read_instead_of_hu(built):
    path, by_key = built
    key = _keys_of(by_key, 6)[0]
    ds = SliceDataset(open_store(path), context=0, plane="lung", keys=[key])
    assert ds[3]["image"].dtype == torch.uint8
    assert np.array_equal(ds[3]["image"][0].numpy(), win.to_uint8(by_key[key].hu[3], win.get("lung")))


def test_loadimaged_with_medload_reader_equals_store_read_and_export(built, tmp_path):
    """The MONAI route's slab is (slices, rows, columns): NibabelReader's (x, y, z) of the NIfTI export,
    transposed, with an affine that maps each voxel to the same point."""
    path, by_key = built
    store = open_store(path)
    load = LoadImaged(keys=["image"], reader=MedloadReader())
    for rec in store.series():
        (item,) = [it for it in store.items(depth=rec.shape[0]) if rec.key in it["image"]]
        loaded = load(item)["image"]
        assert np.array_equal(loaded.numpy(), store.read(rec.key))
        nifti = export_nifti(store, rec.key, tmp_path / f"{rec.key}.nii.gz")
        reference = LoadImaged(keys=["image"], reader="NibabelReader")({"image": str(nifti)})["image"]
        assert np.array_equal(loaded.numpy(), reference.numpy().transpose(2, 1, 0))
        for s, r, c in ((0, 0, 0), (rec.shape[0] - 1, 3, 5), (1, rec.shape[1] - 1, rec.shape[2] - 1)):
            assert np.allclose(loaded.affine.numpy() @ [s, r, c, 1], reference.affine.numpy() @ [c, r, s, 1], atol=1e-4)
    # a slab further down the series: the affine moves to its first slice
    key = _keys_of(by_key, 9)[0]
    (slab,) = [it for it in store.items(depth=4, stride=3) if key in it["image"] and "z0=3&" in it["image"]]
    loaded = load(slab)["image"]
    assert np.allclose(loaded.affine.numpy() @ [0, 0, 0, 1], np.asarray(by_key[key].affine_ras) @ [0, 0, 3, 1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("workers", "method", "pin"), [(0, None, None), (2, "fork", None), (2, "spawn", False)])
def test_loader_yields_windowed_float_batches(built, workers, method, pin, device):
    path, by_key = built
    key = _keys_of(by_key, 9)[0]
    ds = SliceDataset(open_store(path, "4MB"), context=1, keys=[key])
    loader = make_loader(ds, batch_size=4, num_workers=workers, device=device, window="soft_tissue", shuffle=False,
                         multiprocessing_context=None if method is None else mp.get_context(method), pin_memory=pin)
    batches = list(loader)
    assert [b["image"].shape[0] for b in batches] == [4, 4, 1]
    assert {b["image"].device.type for b in batches} == {b["index"].device.type for b in batches} == {device}
    image = torch.cat([b["image"] for b in batches]).cpu().numpy()
    order = np.concatenate([b["index"].cpu().numpy() for b in batches])
    hu = np.stack([ds[i]["image"].numpy() for i in order]).astype(np.float32)
    assert image.dtype == np.float32
    assert np.allclose(image, np.clip((hu + 160) / 400, 0, 1), atol=1e-6)


def _epochs(loader, epochs: int = 2) -> list[dict]:
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += [{k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()} for b in loader]
    return out


@pytest.mark.parametrize("cache", ["0", "64MB"])
@pytest.mark.parametrize("kind", ["slices", "slabs", "plane"])
def test_zero_workers_cast_as_they_read_and_equal_the_slot_path_bit_for_bit(built, kind, cache):
    """With num_workers=0 on the CPU each slice is cast straight into the float batch (from the L1's own
    arrays when it holds them, the second epoch here); with a worker it goes through the int16 slot."""
    path, by_key = built
    keys = _keys_of(by_key, 9) + _keys_of(by_key, 6)
    store = open_store(path, cache)
    ds = {"slices": lambda: SliceDataset(store, context=2, keys=keys),     # edges replicated
          "slabs": lambda: SlabDataset(store, depth=4, stride=3, keys=keys),
          "plane": lambda: SliceDataset(store, context=1, plane="lung", keys=keys)}[kind]()
    window = None if kind == "plane" else "soft_tissue"
    direct = make_loader(ds, batch_size=3, num_workers=0, window=window, shuffle=True, seed=3)
    assert direct.loader.dataset.cast_to is not None  # the path under test
    slotted = make_loader(ds, batch_size=3, num_workers=1, window=window, shuffle=True, seed=3,
                          multiprocessing_context=mp.get_context("fork"))
    a, b = _epochs(direct), _epochs(slotted)
    assert len(a) == len(b) == 2 * len(direct)
    for x, y in zip(a, b):
        assert torch.equal(x["index"], y["index"]) and torch.equal(x["image"], y["image"])
    reference = np.stack([ds[i]["image"].numpy() for i in a[0]["index"].tolist()]).astype(np.float32)
    expected = reference / 255 if kind == "plane" else np.clip((reference + 160) / 400, 0, 1)
    assert np.allclose(a[0]["image"].numpy(), expected, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [0, 2])
def test_stored_dtype_batches_pass_through_unwindowed(built, workers, device):
    """dtype=torch.int16 (uint8 for a plane): what a GPU pipeline that windows in the model is sent."""
    path, by_key = built
    keys = _keys_of(by_key, 9)
    for plane, dtype in ((None, torch.int16), ("lung", torch.uint8)):
        ds = SliceDataset(open_store(path, "4MB"), context=1, plane=plane, keys=keys)
        loader = make_loader(ds, batch_size=4, num_workers=workers, device=device, dtype=dtype, shuffle=True, seed=2)
        held = list(loader)  # kept: each batch must be a copy of its own, not a view of a reused slot
        assert [(b["image"].dtype, b["image"].device.type) for b in held] == [(dtype, device)] * 3
        for b in held:
            expected = np.stack([ds[i]["image"].numpy() for i in b["index"].tolist()])
            assert np.array_equal(b["image"].cpu().numpy(), expected)
    with pytest.raises(ConfigError, match="drop window"):
        make_loader(ds, batch_size=2, dtype=torch.uint8, window="lung")
    with pytest.raises(ConfigError, match="stored torch.uint8"):
        make_loader(ds, batch_size=2, dtype=torch.int16)
    with pytest.raises(ConfigError, match="augmentation needs float"):
        make_loader(ds, batch_size=2, dtype=torch.uint8, augment=lambda image, label: (image, label))


def test_loader_scales_stored_planes_and_refuses_a_second_window(built):
    path, by_key = built
    ds = SliceDataset(open_store(path), context=0, plane="lung", keys=_keys_of(by_key, 6))
    batch = next(iter(make_loader(ds, batch_size=6, shuffle=False)))
    assert np.allclose(batch["image"].numpy(), np.stack([ds[i]["image"].numpy() for i in range(6)]) / 255.0)
    with pytest.raises(ConfigError, match="already windowed"):
        make_loader(ds, batch_size=2, window="lung")


class _MemoryReportingDataset(SliceDataset):
    """Records each worker's resident set size in a shared tensor (test instrumentation)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rss = torch.zeros(2, dtype=torch.int64).share_memory_()

    def read_batch(self, indices, image, label) -> None:
        super().read_batch(indices, image, label)
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        worker = torch.utils.data.get_worker_info().id
        self.rss[worker] = max(int(self.rss[worker]), resident)


def test_worker_memory_stays_flat_over_epochs(built):
    path, by_key = built
    ds = _MemoryReportingDataset(open_store(path, "1MB"), context=1, keys=_keys_of(by_key, 9) + _keys_of(by_key, 6))
    loader = make_loader(ds, batch_size=2, num_workers=2, window="brain", multiprocessing_context=mp.get_context("fork"))
    per_epoch = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert sum(b["image"].shape[0] for b in loader) == 15
        per_epoch.append(ds.rss.tolist())
    assert all(r > 0 for r in per_epoch[0])
    for first, last in zip(per_epoch[0], per_epoch[2]):
        assert last - first < 16 << 20, per_epoch  # generous: no growth per epoch


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_slots_wrap_around_many_times_without_mixing_batches(built, method):
    """15 one-sample batches through 5 slots (2 workers x prefetch 2, plus 1): every batch still holds exactly
    its own sample."""
    path, by_key = built
    ds = SliceDataset(open_store(path), context=1, keys=_keys_of(by_key, 9) + _keys_of(by_key, 6))
    loader = make_loader(ds, batch_size=1, num_workers=2, window=None, shuffle=True, seed=5,
                         multiprocessing_context=mp.get_context(method))
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = []
        for batch in loader:
            i = int(batch["index"][0])
            assert np.array_equal(batch["image"][0].numpy(), ds[i]["image"].numpy().astype(np.float32))
            seen.append(i)
        assert sorted(seen) == list(range(15))


def test_cpu_batches_reuse_buffers_the_caller_dropped_but_never_ones_it_holds(built):
    path, by_key = built
    ds = SliceDataset(open_store(path), context=1, keys=_keys_of(by_key, 9) + _keys_of(by_key, 6))
    loader = make_loader(ds, batch_size=1, window="soft_tissue", shuffle=False)
    addresses = set()
    for batch in loader:  # each batch dropped before the next: a couple of buffers serve them all
        addresses.add(batch["image"].data_ptr())
    assert len(addresses) <= 2
    held = list(loader)  # every batch kept: none may be overwritten by a later one
    assert len({b["image"].data_ptr() for b in held}) == len(held) == 15
    for b in held:
        i = int(b["index"][0])
        assert np.allclose(b["image"][0].numpy(), np.clip((ds[i]["image"].numpy() + 160) / 400, 0, 1), atol=1e-6)
    view = held[0]["image"][:, :1]  # a view keeps its buffer alive too
    del held
    fresh = [b["image"].data_ptr() for b in loader]
    assert view.data_ptr() not in fresh


def test_monai_compose_presets_load_window_and_augment(built):
    from medload.data.transforms import train_transforms, val_transforms

    path, by_key = built
    store = open_store(path)
    key = _keys_of(by_key, 9)[0]
    items = [it for it in store.items(context=1) if key in it["image"]]
    val = val_transforms("soft_tissue", keys=("image",))(items[4])["image"]
    hu = store.read(key, 3, 6).astype(np.float32)  # (channels, rows, columns), as the datasets give it
    assert val.shape == (3, 20, 24) and np.allclose(val.numpy(), np.clip((hu + 160) / 400, 0, 1), atol=1e-6)
    first = train_transforms("soft_tissue", keys=("image",), seed=3)(items[4])["image"]
    again = train_transforms("soft_tissue", keys=("image",), seed=3)(items[4])["image"]
    assert first.shape == (3, 20, 24) and np.array_equal(first.numpy(), again.numpy())
