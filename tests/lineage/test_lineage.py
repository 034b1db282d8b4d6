"""Lineage records on real stores: what ``dataset.lineage()`` / ``loader.lineage()`` record, ``save``/``load``,
and ``medload lineage check`` against a store left alone, one whose series was ingested again with other
pixels, one that lost labels, a shard that cannot be read, series removed by ``repair``, and ``compact``;
``export-nnunet`` and ``StoreDataModule`` write records that check; no raw identifier is in a record."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pydicom
import pytest
import torch
from conftest import PHILIPS
from helpers.identifiers import IDENTIFYING, UIDS, _dicom_files, _pattern, _raw_values
from helpers.labelled_store import add_bone_mask, make_labelled_store

import medload.lineage
from medload.config import IngestConfig
from medload.data import SliceDataset, UniformSampler, make_loader
from medload.data.augment import AugmentConfig, BatchAugment
from medload.data.patches import PatchDataset
from medload.ingest.repair import repair_store
from medload.ingest.run import ingest
from medload.lineage import LineageError, check
from medload.storage.manifest import read_manifest, shard_path
from medload.storage.store import open_store

CFG = IngestConfig(workers=1)
FG = {"fg": ["Liver", "class_1"]}  # the RTSTRUCTs' and the bone mask's class 1, one class


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "medload.cli", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Four synthetic series of three patients with RTSTRUCT labels (src/p0s0, p0s1, p1s0, p2s0: the first
    shards, as many as the ingest's tasks wrote), then the sample study with a bone mask (real DICOM) in later
    shards."""
    root = tmp_path_factory.mktemp("lineage")
    make_labelled_store(root, patients=3)
    add_bone_mask(root / "store", root / "masks")
    return root


@pytest.fixture
def store(built, tmp_path) -> Path:
    """A private copy of the built store."""
    shutil.copytree(built / "store", tmp_path / "store")
    return tmp_path / "store"


def _key_of(folder: Path, scratch: Path) -> str:
    """The series key the DICOM in ``folder`` gets (the same pseudonymisation key: the same series key)."""
    ingest(folder, scratch, config=CFG)
    return open_store(scratch).series()[0].key


def _first_shard_keys(store: Path) -> list[str]:
    return sorted(r.key for r in open_store(store).series() if r.shard == read_manifest(store).shards[0].name)


def test_a_record_names_every_series_with_its_digests_and_the_inputs(built, tmp_path):
    st = open_store(built / "store")
    ds = SliceDataset(st, context=1, labels="only", modality="CT", classes=FG)
    loader = make_loader(ds, batch_size=2, sampler=UniformSampler.from_dataset(ds, seed=7),
                         augment=BatchAugment(AugmentConfig(flip_prob=0.25), seed=5), window="soft_tissue")
    record = loader.lineage(split={"seed": 3})
    assert [s.key for s in record.series] == sorted(r.key for r in st.series())
    assert [s.digest for s in record.series] == [st.record(s.key).digest for s in record.series]
    assert [s.label for s in record.series] == [st.labels(s.key).digest for s in record.series]
    dataset, loader_in = record.inputs["dataset"], record.inputs["loader"]
    assert dataset["kind"] == "SliceDataset" and dataset["context"] == 1 and dataset["filters"] == {"modality": "CT"}
    assert dataset["classes"] == FG
    assert dataset["samples"] == len(ds) and record.inputs["split"] == {"seed": 3}
    assert loader_in["sampler"] == {"kind": "UniformSampler", "n": len(ds), "num_samples": len(ds),
                                    "replacement": False, "seed": 7}
    assert loader_in["augment"]["seed"] == 5 and loader_in["augment"]["config"]["flip_prob"] == 0.25
    next(iter(loader))  # a batch later the sampler has a position in its epoch: how it was set up is unchanged
    assert loader.lineage(split={"seed": 3}).inputs == record.inputs
    assert loader_in["window"] == {"name": "soft_tissue", "width": 400.0, "level": 40.0}
    assert record.store["key_fingerprint"] == st.manifest.key_fingerprint and record.store["series"] == 5
    assert set(record.software) >= {"medload", "torch", "monai", "python"} and record.created.endswith("Z")

    path = medload.lineage.save(record, tmp_path / "lineage.json")
    assert json.loads(path.read_text())["digest"] == record.digest == medload.lineage.load(path).digest
    assert SliceDataset(st, labels=False).lineage().series[0].label is None  # labels unused: not recorded
    patches = PatchDataset(st, patch=(4, 8, 8), labels=False, samples_per_epoch=2).lineage()
    assert all(s.label is not None for s in patches.series if st.labels(s.key))  # patches centred on labels

    edited = json.loads(path.read_text())
    edited["inputs"]["split"]["seed"] = 4
    path.write_text(json.dumps(edited))
    with pytest.raises(LineageError, match="edited after medload wrote it"):
        medload.lineage.load(path)


def test_check_passes_on_an_unchanged_store(built, tmp_path):
    path = medload.lineage.save(SliceDataset(open_store(built / "store"), labels="only", classes=FG).lineage(), tmp_path / "r.json")
    proc = cli("lineage", "check", path, built / "store")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith(f"ok: all 5 series of lineage record {medload.lineage.load(path).digest[:12]} "
                                        "hold the recorded data")


def _with_other_pixels(src: Path, out: Path) -> Path:
    """The CT slices of ``src`` with 50 HU added to a corner of each: same UIDs, other pixels."""
    out.mkdir(parents=True)
    for path in sorted(src.glob("*.dcm")):
        ds = pydicom.dcmread(path)
        if ds.Modality == "CT":
            pixels = ds.pixel_array.copy()
            pixels[:4, :4] += 50
            ds.PixelData = pixels.tobytes()
            ds.save_as(out / path.name)
    return out


def test_check_names_the_series_ingested_again_with_other_pixels(built, store, tmp_path):
    st = open_store(store)
    path = medload.lineage.save(SliceDataset(st, labels="only", classes=FG).lineage(), tmp_path / "r.json")
    changed = _with_other_pixels(built / "src" / "p1s0", tmp_path / "changed")
    key = _key_of(changed, tmp_path / "scratch")
    proc = cli("ingest", changed, store, "--force", key, "--workers", "1", "--no-progress")
    assert proc.returncode == 0 and "1 replaced" in proc.stdout, proc.stdout + proc.stderr

    proc = cli("lineage", "check", path, store)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == [f"changed  {key}"]
    assert lines[-1] == f"{store}: CHANGED: 1 changed of the 5 series of lineage record {medload.lineage.load(path).digest[:12]}"
    result = json.loads(cli("lineage", "check", path, store, "--json").stdout)
    assert not result["ok"] and [(c["key"], c["what"]) for c in result["changes"]] == [(key, "changed")]


def test_labels_dropped_by_a_forced_ingest_are_named_and_compact_keeps_the_rest(built, store, tmp_path):
    """The same pixels ingested again with --force, without their RTSTRUCT: the voxels check, the labels that
    went with the old copy do not; ``compact`` then frees the old copy and the store still holds the recorded
    voxels."""
    st = open_store(store)
    with_labels, without = SliceDataset(st, labels="only", classes=FG).lineage(), SliceDataset(st, labels=False).lineage()
    images = tmp_path / "images"
    shutil.copytree(built / "src" / "p2s0", images, ignore=shutil.ignore_patterns("rtstruct.dcm"))
    key = _key_of(images, tmp_path / "scratch")
    ingest(images, store, config=CFG, force=[key])
    assert check(without, store).ok
    assert [(c.key, c.what) for c in check(with_labels, store).changes] == [(key, "labels gone")]
    proc = cli("compact", store, "--no-progress")
    assert proc.returncode == 0 and "rewrote  shard" in proc.stdout, proc.stdout + proc.stderr
    assert check(without, store).ok


def _as_format_2(store: Path) -> None:
    """Rewrite store.json as medload of format 2 wrote it: no key lists (as tests/storage/test_repair.py)."""
    doc = json.loads((store / "store.json").read_text())
    doc["version"] = 2
    for entry in doc["shards"]:
        del entry["keys"]
    (store / "store.json").write_text(json.dumps(doc))


def test_check_names_series_in_a_lost_shard_and_those_repair_removed(built, store, tmp_path):
    record = SliceDataset(open_store(built / "store"), labels="only", classes=FG).lineage()  # the copy stays unopened
    in_first = _first_shard_keys(built / "store")
    assert len(in_first) >= 2  # the synthetic series, written by the ingest's tasks into shards of a few each
    data = shard_path(store, read_manifest(store).shards[0].name) / "data.mdb"
    saved = data.read_bytes()
    data.write_bytes(saved[: len(saved) // 2])
    assert {(c.key, c.what) for c in check(record, store).changes} == {(k, "unavailable") for k in in_first}

    data.write_bytes(saved)
    _as_format_2(store)  # a store that does not list its shards' series: repair ingests those the sources hold
    data.unlink()
    sources = {_key_of(built / "src" / name, tmp_path / name): built / "src" / name
               for name in ("p0s0", "p0s1", "p1s0", "p2s0")}
    kept = set(in_first[:-1])  # all but one of the lost shard's series come back from their sources
    result = repair_store(store, [sources[k] for k in sorted(kept)], config=CFG)
    assert len(result.retired) == 1 and {s.key for s in result.series} == kept
    path = medload.lineage.save(record, tmp_path / "r.json")
    proc = cli("lineage", "check", path, store)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    gone = sorted(set(in_first) - kept)
    assert sorted(line.split(":")[0] for line in proc.stdout.splitlines()[:-1]) == [f"gone  {k}" for k in gone]
    assert f"CHANGED: {len(gone)} gone of the 5 series" in proc.stdout


def test_export_nnunet_writes_a_record_that_checks(built, tmp_path):
    proc = cli("export-nnunet", built / "store", tmp_path / "raw", "--dataset-id", 7, "--name", "Lit",
                   "--query", "manufacturer != 'Philips'", "--folds", 3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = tmp_path / "raw" / "Dataset007_Lit"
    record = medload.lineage.load(folder / "medload_lineage.json")
    assert f"lineage record {folder / 'medload_lineage.json'} (digest {record.digest[:12]})" in proc.stdout
    cases = json.loads((folder / "medload_cases.json").read_text())["cases"]
    assert [s.key for s in record.series] == sorted(c["series"] for c in cases) and all(s.label for s in record.series)
    assert record.inputs["export"]["dataset_id"] == 7 and record.created == ""  # same export, same bytes
    assert cli("lineage", "check", folder / "medload_lineage.json", built / "store").returncode == 0


def test_no_raw_identifier_enters_a_record(built, tmp_path):
    """Every UID, the patient IDs and names and the other PS3.15 identifying values of the sources (real DICOM
    and synthetic), and the source paths: none is in a saved record."""
    st = open_store(built / "store")
    ds = SliceDataset(st, labels="only", classes=FG, keys=st.catalog().key)
    path = medload.lineage.save(make_loader(ds, batch_size=2, shuffle=True, seed=1).lineage(), tmp_path / "r.json")
    data = path.read_bytes()
    raw = _raw_values([*_dicom_files(PHILIPS / "dicom"), *_dicom_files(built / "src")], IDENTIFYING + UIDS)
    assert len(raw["SeriesInstanceUID"]) >= 5 and "LIT-0" in raw["PatientID"]
    secrets = {v for values in raw.values() for v in values} | {str(built), "p0s0", "philips_ct_head"}
    assert [s for s in secrets if _pattern(s).search(data)] == []


def test_store_data_module_writes_the_record_beside_its_checkpoints(built, tmp_path):
    lightning = pytest.importorskip("lightning", reason="PyTorch Lightning is an optional extra (medload[lightning])")
    from medload.lightning import StoreDataModule

    class Tiny(lightning.LightningModule):
        """One convolution: enough for Trainer.fit to take a step and save a checkpoint."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Conv2d(3, 1, 3, padding=1)

        def training_step(self, batch, batch_idx):
            return self.net(batch["image"]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = StoreDataModule(built / "store", batch_size=2, window="soft_tissue", augment=True, seed=3, classes=FG)
    trainer = lightning.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                                max_steps=1, default_root_dir=tmp_path)
    trainer.fit(Tiny(), datamodule=data)
    checkpoints = sorted((tmp_path / "checkpoints").iterdir())
    assert data.lineage_path == tmp_path / "checkpoints" / "medload_lineage.json" and len(checkpoints) == 2
    record = medload.lineage.load(data.lineage_path)
    assert [s.key for s in record.series] == sorted(data.split.train)
    assert record.inputs["split"]["val"] == sorted(data.split.val) and record.inputs["loader"]["augment"]["seed"] == 3
    assert check(record, built / "store").ok
