"""The data of the 3D patch section (:mod:`medload.bench.patches`): anisotropic, oblique and feet-first
labelled synthetic CT, as each contender reads it.

Series ``i`` has ``slices`` slices of ``size`` x ``size`` at 0.7 x 0.7 mm, slice spacing 2.5, 3 or 5 mm
(``i % 3``), oblique (``i % 3 == 0``, direction cosines drawn from the seed), feet-first (``i % 3 == 1``:
ImageOrientationPatient (0020,0037) row cosine -1, 0, 0) or axial; labelled from its own HU (1: bone,
> 300 HU; 2: lung, -950 to -700 HU). Written as DICOM (:mod:`medload.synthetic`), ingested with its label,
then written for the peers, and the DICOM deleted:

- ``nifti/``: each series' image and label as ``medload export`` writes them (MONAI's input);
- ``nnunet/``: nnU-Net v2's preprocessed form of the same series, as its ``DefaultPreprocessor`` leaves it
  for ``3d_fullres`` at the target spacing: CT clipped and z-scored, resampled with nnU-Net's own
  ``resample_data_or_seg_to_spacing`` (cubic, separate z for anisotropic series; labels order 0), the
  foreground locations it samples, saved with ``nnUNetDatasetBlosc2.save_case``. nnU-Net does not
  reorient: it keeps each series in its stored axes, as its readers do.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from medload.bench.peers import PeerUnavailable

__all__ = ["PatchSettings", "PatchPrep", "prepare_patches", "CLASSES"]

CLASSES = {"background": 0, "bone": 1, "lung": 2}
"""The label's classes (nnU-Net's ``labels`` of dataset.json)."""
_SLICE_MM = (2.5, 3.0, 5.0)
_FEET_FIRST = (-1.0, 0.0, 0.0, 0.0, 1.0, 0.0)


@dataclass(frozen=True)
class PatchSettings:
    """Sizes of the patch section: the data (``series`` x ``slices`` of ``size``\\ :sup:`2`), the batches
    (``batch_size`` patches of ``patch`` voxels at ``spacing`` mm isotropic, ``foreground`` of them centred
    on a label), and the runs (``warmup`` + up to ``batches`` timed batches or ``max_pass_s``, ``repeats``
    passes, per contender, workers and page cache mode). ``train``: also the GPU variant's training rows."""

    series: int = 64
    slices: int = 96
    size: int = 384
    patch: tuple[int, int, int] = (128, 128, 128)
    spacing: float = 1.5
    foreground: float = 0.33
    batch_size: int = 2
    workers: tuple[int, ...] = (0, 2)
    modes: tuple[str, ...] = ("warm", "cold")
    warmup: int = 2
    batches: int = 10
    repeats: int = 2
    max_pass_s: float = 30.0
    timeout: float = 1800.0
    train: bool = False
    train_steps: int = 10
    contenders: tuple[str, ...] = field(default=("medload", "nnunet", "monai_cache", "monai_persistent"))

    @property
    def data_key(self) -> dict:
        """What the prepared data depend on (reused when equal)."""
        return {"series": self.series, "slices": self.slices, "size": self.size, "patch": list(self.patch),
                "spacing": self.spacing}


@dataclass
class PatchPrep:
    """Where the prepared data are: the store, the NIfTI pairs, the nnU-Net folder (None: not installed)
    and MONAI's PersistentDataset cache; ``settings`` as :meth:`PatchSettings.data_key`."""

    root: str
    store: str
    nifti: list[tuple[str, str]]
    nnunet: str | None
    persistent: str
    settings: dict

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> PatchPrep:
        d = json.loads(path.read_text())
        d["nifti"] = [tuple(p) for p in d["nifti"]]
        return cls(**d)

    def files(self) -> list[str]:
        """Every folder a contender reads (evicted together before each cold pass)."""
        return [self.store, str(Path(self.root) / "nifti"), self.persistent] + ([self.nnunet] if self.nnunet else [])


def _labels(hu: np.ndarray) -> np.ndarray:
    return np.where(hu > 300, 1, np.where((hu > -950) & (hu < -700), 2, 0)).astype(np.uint8)


def _write_series(src: Path, settings: PatchSettings) -> None:
    from medload.synthetic import SeriesSpec, make_series

    for i in range(settings.series):
        orientation = "oblique" if i % 3 == 0 else _FEET_FIRST if i % 3 == 1 else "axial"
        spec = SeriesSpec(n_slices=settings.slices, rows=settings.size, cols=settings.size, pixel_spacing=(0.7, 0.7),
                          slice_spacing=_SLICE_MM[i % 3], orientation=orientation)
        make_series(src / f"series{i:03d}", spec, seed=100 + i, patient_id=f"PATCH{i:04d}")


def _ingest_labelled(src: Path, store: Path, masks: Path, key_file: Path) -> None:
    """Ingest ``src``, label each series from its HU (a NIfTI on its grid), ingest again with the labels."""
    import nibabel as nib

    from medload.bench.loading_data import ingest_into
    from medload.config import IngestConfig, affinity_cores
    from medload.deid import KeyFile
    from medload.ingest import ingest
    from medload.storage.store import open_store

    ingest_into([src], store, key_file, workers=affinity_cores())
    masks.mkdir(parents=True, exist_ok=True)
    opened = open_store(store, cache=0)
    for rec in opened.series():
        label = _labels(opened.read(rec.key))
        nib.save(nib.Nifti1Image(label.transpose(2, 1, 0), np.asarray(rec.affine)), masks / f"{rec.key[:12]}.nii.gz")
    opened.close()
    ingest(src, store, config=IngestConfig(workers=affinity_cores()), labels=[masks], key_file=KeyFile(key_file))


def _nnunet_case(folder: Path, case: str, volume: np.ndarray, label: np.ndarray, spacing: np.ndarray,
                 settings: PatchSettings) -> None:
    """One series as nnU-Net's preprocessor saves it for ``3d_fullres`` at ``settings.spacing`` mm."""
    try:
        from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor
        from nnunetv2.preprocessing.resampling.default_resampling import resample_data_or_seg_to_spacing
        from nnunetv2.training.dataloading.nnunet_dataset import comp_blosc2_params, nnUNetDatasetBlosc2
    except ImportError as exc:
        raise PeerUnavailable(f"nnunetv2 is not installed ({exc}): pip install nnunetv2") from exc
    target = [settings.spacing] * 3
    hu = np.clip(volume.astype(np.float32), -1024.0, 2000.0)  # CTNormalization: clip, then z-score
    data = ((hu - hu.mean()) / max(float(hu.std()), 1e-8))[None]
    data = resample_data_or_seg_to_spacing(data, spacing, target, is_seg=False, order=3, order_z=0,
                                           force_separate_z=None).astype(np.float32)
    seg = resample_data_or_seg_to_spacing(label[None].astype(np.int8), spacing, target, is_seg=True, order=1,
                                          order_z=0, force_separate_z=None).astype(np.int8)
    properties = {"spacing": target, "shape_before_cropping": volume.shape, "bbox_used_for_cropping":
                  [[0, n] for n in volume.shape], "shape_after_cropping_and_before_resampling": volume.shape,
                  "class_locations": DefaultPreprocessor._sample_foreground_locations(seg, [1, 2], seed=1234)}
    blocks, chunks = comp_blosc2_params(data.shape, settings.patch, data.itemsize)
    seg_blocks, seg_chunks = comp_blosc2_params(seg.shape, settings.patch, seg.itemsize)
    nnUNetDatasetBlosc2.save_case(data, seg, properties, str(folder / case), chunks=chunks, blocks=blocks,
                                  chunks_seg=seg_chunks, blocks_seg=seg_blocks)


def _fill_persistent(prep: PatchPrep, settings: PatchSettings) -> None:
    """MONAI's PersistentDataset cache of the deterministic transforms, as its first epoch leaves it."""
    from monai.data import PersistentDataset

    from medload.bench.patches_peers import monai_transforms

    deterministic, _ = monai_transforms(settings)
    ds = PersistentDataset([{"image": i, "label": lab} for i, lab in prep.nifti], transform=deterministic,
                           cache_dir=prep.persistent)
    for i in range(len(ds)):
        ds[i]


def prepare_patches(root: Path, settings: PatchSettings, *, key_file: Path, progress: bool = True) -> PatchPrep:
    """The section's data under ``root`` (reused when a previous run with the same sizes left them)."""
    import os

    from medload.data.patch_geometry import series_index_affine
    from medload.progress import progress_bar
    from medload.storage.nifti import export_nifti
    from medload.storage.store import open_store

    root = Path(root)
    done = root / "prepared-patches.json"
    if done.exists():
        prep = PatchPrep.load(done)
        if prep.settings == settings.data_key:
            return prep
    for old in ("dicom", "masks", "store", "nifti", "nnunet", "persistent"):
        shutil.rmtree(root / old, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    _write_series(root / "dicom", settings)
    _ingest_labelled(root / "dicom", root / "store", root / "masks", key_file)
    shutil.rmtree(root / "dicom")
    store = open_store(root / "store", cache=0)
    (root / "nifti").mkdir()
    (root / "nnunet").mkdir()
    nnunet: Path | None = root / "nnunet"
    pairs = []
    records = list(store.series())
    with progress_bar("patch data: NIfTI and nnU-Net", len(records), enabled=progress) as advance:
        for i, rec in enumerate(records):
            image = export_nifti(store, rec.key, root / "nifti" / f"case_{i:04d}.nii.gz")
            label = export_nifti(store, rec.key, root / "nifti" / f"case_{i:04d}_label.nii.gz", label=True)
            pairs.append((str(image), str(label)))
            if nnunet is not None:
                spacing = np.linalg.norm(series_index_affine(rec.affine)[:3, :3], axis=0)
                try:
                    _nnunet_case(nnunet, f"case_{i:04d}", store.read(rec.key), store.read_label(rec.key), spacing,
                                 settings)
                except PeerUnavailable:
                    shutil.rmtree(nnunet)
                    nnunet = None
            advance(1)
    store.close()
    prep = PatchPrep(str(root), str(root / "store"), pairs, None if nnunet is None else str(nnunet),
                     str(root / "persistent"), settings.data_key)
    _fill_persistent(prep, settings)
    os.sync()  # written pages are clean, so that a cold pass can drop them
    prep.save(done)
    return prep
