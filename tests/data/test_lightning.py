"""The Lightning DataModule: Trainer.fit over medload datasets, epochs that reshuffle, a split by patient."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
import torch

lightning = pytest.importorskip("lightning", reason="PyTorch Lightning is an optional extra (medload[lightning])")

from helpers.labelled_store import COLS, ROWS, make_labelled_store, make_partly_labelled_store  # noqa: E402
from helpers.patch_store import make_patch_store  # noqa: E402

from medload.data import DistributedPatientSampler, PatchDataset, SliceDataset, UniformSampler  # noqa: E402
from medload.errors import ConfigError, MedloadError  # noqa: E402
from medload.lightning import StoreDataModule, split_patients  # noqa: E402
from medload.storage.store import open_store  # noqa: E402


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return make_labelled_store(tmp_path_factory.mktemp("lightning"))


class TinySegmenter(lightning.LightningModule):
    """One convolution, foreground vs background; records what each step saw."""

    def __init__(self, channels: int, dims: int) -> None:
        super().__init__()
        self.net = (torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d)(channels, 1, 3, padding=1)
        self.seen: dict[str, list] = {"train": [], "val": []}

    def _step(self, batch, stage: str) -> torch.Tensor:
        self.seen[stage].append((self.current_epoch, tuple(batch["image"].shape), tuple(batch["label"].shape),
                                 batch.get("centre"), batch["index"].tolist()))
        logits = self.net(batch["image"])
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, (batch["label"] > 0).float())

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(**kwargs) -> lightning.Trainer:
    return lightning.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, **kwargs)


@pytest.mark.parametrize("kind", ["2.5d", "3d"])
def test_trainer_fit_runs_two_steps_over_the_store(store_path, kind):
    options = dict(context=1) if kind == "2.5d" else dict(depth=3, stride=2)
    data = StoreDataModule(store_path, batch_size=4, window="soft_tissue", augment=True, val_fraction=0.2, seed=3,
                           **options)
    model = TinySegmenter(channels=3 if kind == "2.5d" else 1, dims=2 if kind == "2.5d" else 3)
    trainer = _trainer(max_steps=2)
    trainer.fit(model, datamodule=data)
    assert trainer.global_step == 2 and len(model.seen["train"]) == 2
    image, label = ((4, 3, ROWS, COLS), (4, 1, ROWS, COLS)) if kind == "2.5d" else ((4, 1, 3, ROWS, COLS),) * 2
    assert all(seen[1:3] == (image, label) for seen in model.seen["train"])
    assert model.seen["val"] and all(seen[1][1:] == image[1:] for seen in model.seen["val"])  # the sanity check
    train_patients = set(data.train_dataset.index.patients.tolist())
    assert {r.patient for r in data.train_dataset.records}.isdisjoint(r.patient for r in data.val_dataset.records)
    assert len(train_patients) == 4 and len({r.patient for r in data.val_dataset.records}) == 1  # 0.2 of 5
    assert sorted(data.split.train + data.split.val) == sorted(r.key for r in open_store(store_path).series())


@pytest.fixture(scope="module")
def partly_path(tmp_path_factory):
    """9 patients, 6 labelled (see labelled_store.make_partly_labelled_store)."""
    return make_partly_labelled_store(tmp_path_factory.mktemp("partly"))


def test_the_docs_one_liner_fits_and_validates_a_partly_labelled_store(partly_path):
    """`Trainer().fit(model, datamodule=StoreDataModule(store, window=...))`: the labelled series, every batch
    with a "label" (a KeyError in the validation step before)."""
    data = StoreDataModule(partly_path, window="soft_tissue")  # the one-liner: no class map
    with pytest.warns(UserWarning, match="mean different classes"):  # said, and every batch still has its label
        _trainer(max_steps=1).fit(TinySegmenter(channels=3, dims=2), datamodule=data)

    store = open_store(partly_path)
    labelled = {r.key for r in store.series() if store.labels(r.key) is not None}
    data = StoreDataModule(partly_path, window="soft_tissue", classes=["liver", "spleen"])
    model = TinySegmenter(channels=3, dims=2)
    trainer = _trainer(max_epochs=1)
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data)
    assert data.dataset_options["labels"] == "only" and len(labelled) == 6
    assert {r.key for r in (*data.train_dataset.records, *data.val_dataset.records)} == labelled
    assert len(model.seen["train"]) == len(data.train_dataloader()) and model.seen["val"]
    assert data.train_dataset.class_names == {1: "liver", 2: "spleen"}
    everything = StoreDataModule(partly_path, labels=False)
    everything.setup("fit")
    assert len(everything.split.train) + len(everything.split.val) == 9 and not everything.train_dataset.labels


def test_epochs_reshuffle_as_the_seeded_sampler_orders_and_validation_is_sequential(store_path):
    data = StoreDataModule(open_store(store_path), context=0, batch_size=5, val_fraction=0.4, seed=1)
    model = TinySegmenter(channels=1, dims=2)
    _trainer(max_epochs=2, num_sanity_val_steps=0).fit(model, datamodule=data)
    n = len(data.train_dataset)
    orders = [[i for epoch, *_, batch in model.seen["train"] if epoch == e for i in batch] for e in (0, 1)]
    expected = UniformSampler(n, seed=1)
    for epoch, order in enumerate(orders):
        expected.set_epoch(epoch)
        assert order == list(expected)  # Lightning's set_epoch reached the sampler
    assert orders[0] != orders[1] and sorted(orders[0]) == list(range(n))
    val = [i for epoch, *_, batch in model.seen["val"] if epoch == 0 for i in batch]
    assert val == list(range(len(data.val_dataset)))  # every validation sample, in order


def test_the_distributed_sampler_takes_the_trainers_ranks_and_a_callable_builds_any_sampler(store_path):
    data = StoreDataModule(store_path, context=0, batch_size=6, sampler="distributed", seed=2)
    model = TinySegmenter(channels=1, dims=2)
    _trainer(max_epochs=1, num_sanity_val_steps=0).fit(model, datamodule=data)
    expected = DistributedPatientSampler.from_dataset(data.train_dataset, rank=0, world_size=1, seed=2)
    assert [i for *_, batch in model.seen["train"] for i in batch] == list(expected)

    picked = []
    data = StoreDataModule(store_path, context=0, batch_size=6, val_fraction=0,
                           sampler=lambda ds: picked.append(ds) or UniformSampler.from_dataset(ds, num_samples=6))
    model = TinySegmenter(channels=1, dims=2)
    trainer = _trainer(max_epochs=1)
    trainer.fit(model, datamodule=data)
    assert picked == [data.train_dataset] and data.val_dataset is None and trainer.global_step == 1
    assert not model.seen["val"] and len(data.train_dataset) == 36  # val_fraction=0: every patient trains


def test_split_patients_never_puts_a_patient_on_both_sides(store_path):
    ds = SliceDataset(open_store(store_path), context=0)
    patient_of = {r.key: r.patient for r in ds.records}
    splits = {}
    for seed in range(6):
        for fraction in (0.1, 0.2, 0.5, 0.7):
            split = split_patients(ds, fraction, seed=seed)
            train, val = {patient_of[k] for k in split.train}, {patient_of[k] for k in split.val}
            assert train and val and train.isdisjoint(val) and len(train | val) == 5
            assert len(val) == max(1, round(fraction * 5)) and len(split.train) + len(split.val) == 6
            assert split_patients(ds.index, fraction, seed=seed) == split  # the same from the index, every time
            splits.setdefault(fraction, set()).add(split.val)
    assert len(splits[0.2]) > 1  # the seed chooses
    assert split_patients(ds, 0, seed=0).val == ()
    for bad in (1.0, -0.1, 0.95):  # 0.95 of 5 patients leaves none to train
        with pytest.raises(ConfigError, match="val_fraction"):
            split_patients(ds, bad)
    with pytest.raises(ConfigError, match="SampleIndex"):
        split_patients(np.zeros(3), 0.2)


@pytest.fixture(scope="module")
def patch_store_path(tmp_path_factory):
    """4 patients, one oblique, anisotropic or feet-first series each, labelled (tests/helpers/patch_store.py)."""
    return make_patch_store(tmp_path_factory.mktemp("lightning-patches"))


def test_the_patch_option_fits_on_new_draws_each_epoch_and_validates_on_a_fixed_set(patch_store_path):
    data = StoreDataModule(patch_store_path, patch=(6, 12, 10), spacing=(2.5, 1.5, 1.5), axcodes="RAS",
                           foreground=0.5, patches_per_epoch=4, batch_size=2, window="soft_tissue", augment=True,
                           val_fraction=0.25, seed=5)
    model = TinySegmenter(channels=1, dims=3)
    trainer = _trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data)
    assert isinstance(data.train_dataset, PatchDataset) and isinstance(data.val_dataset, PatchDataset)
    assert trainer.global_step == 4 and all(seen[1:3] == ((2, 1, 6, 12, 10),) * 2 for seen in model.seen["train"])
    train_patients = {r.patient for r in data.train_dataset.records}
    assert len(train_patients) == 3 and train_patients.isdisjoint(r.patient for r in data.val_dataset.records)
    centres = {e: torch.cat([seen[3] for seen in model.seen["train"] if seen[0] == e]) for e in (0, 1)}
    for epoch in (0, 1):  # each epoch's batches are that epoch's seeded draws: Lightning's set_epoch reached them
        data.train_dataset.set_epoch(epoch)
        assert torch.equal(centres[epoch], torch.stack([data.train_dataset[i]["centre"] for i in range(4)]))
    assert not torch.equal(centres[0], centres[1])
    val = [(tuple(i), c) for *_, c, i in model.seen["val"]]  # after two epochs of fit, and in validate()
    assert len(val) == 3 and all(v[0] == val[0][0] and torch.equal(v[1], val[0][1]) for v in val)
    assert len(data.val_dataset) == 2  # patches_per_epoch * val_fraction, at least a batch


def test_bad_arguments_say_what_to_pass(store_path):
    with pytest.raises(ConfigError, match="not both"):
        StoreDataModule(store_path, context=1, depth=4)
    with pytest.raises(ConfigError, match="not both"):
        StoreDataModule(store_path, depth=4, patch=(8, 8, 8))
    with pytest.raises(ConfigError, match="drop classes= and plane="):
        StoreDataModule(store_path, patch=(8, 8, 8), classes=["liver"])
    with pytest.raises(ConfigError, match="patch= draws its own patches"):
        StoreDataModule(store_path, patch=(8, 8, 8), sampler="foreground")
    patches = StoreDataModule(store_path, patch=(8, 8, 8), spacing=(1.0, -1.0, 1.0))
    with pytest.raises(ConfigError, match="spacing must be positive"):
        patches.setup("fit")
    with pytest.raises(ConfigError, match="sampler must be one of"):
        StoreDataModule(store_path, sampler="random")
    with pytest.raises(ConfigError, match="augment must be"):
        StoreDataModule(store_path, augment="yes")
    with pytest.raises(ConfigError, match="setup"):
        StoreDataModule(store_path).train_dataloader()
    data = StoreDataModule(store_path, context=0, labels=False, sampler="foreground")
    data.setup("fit")
    with pytest.raises(ConfigError, match="needs labels"):
        data.train_dataloader()


def test_without_lightning_the_import_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "medload.lightning")
    with pytest.raises(MedloadError, match=r"pip install .*\[lightning\]'"):  # from the index, or the checkout
        importlib.import_module("medload.lightning")
