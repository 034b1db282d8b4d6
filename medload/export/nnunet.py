"""A store's labelled series as an nnU-Net v2 raw dataset, with cross-validation folds by patient.

What is written follows nnU-Net v2's documentation ("dataset format", "manual data splits")::

    OUT/Dataset501_Name/
        dataset.json            channel_names {"0": "CT"}, labels, numTraining, file_ending ".nii.gz"
        imagesTr/case_0000_0000.nii.gz   the stored volume: HU as stored, the series affine (sform = qform)
        labelsTr/case_0000.nii.gz        its label map in the dataset's class ids, on the same grid
        splits_final.json       one {"train": [...], "val": [...]} per fold; a patient in one fold only
        medload_cases.json      case -> series key, patient and study pseudonyms, fold; series left out
        medload_lineage.json    the lineage record of the cases' series and labels (:mod:`medload.lineage`)

Images and labels are :func:`medload.storage.nifti.to_nifti`'s, so ``nibabel`` reads back the stored
voxels (``data.transpose(2, 1, 0)``) and the series affine (as NIfTI keeps it, in float32).
``nnUNetv2_plan_and_preprocess`` copies ``splits_final.json`` to ``$nnUNet_preprocessed/Dataset501_Name/``,
where training reads it. Case numbers follow the series keys (sorted), so the same store, selection and
seed give the same dataset, byte for byte.

Example:
    >>> result = export_nnunet("stores/ct", "nnUNet_raw", dataset_id=501, name="Liver",
    ...                        query="kernel == 'B30f'", folds=5, seed=0)   # doctest: +SKIP
    >>> result.path, len(result.cases), result.labels                       # doctest: +SKIP
    (PosixPath('nnUNet_raw/Dataset501_Liver'), 120, {'background': 0, 'liver': 1})
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from medload.errors import ConfigError
from medload.export.classes import dataset_classes
from medload.export.folds import nnunet_splits, patient_folds
from medload.lineage.record import make_record, save
from medload.storage.nifti import to_nifti
from medload.storage.records import LabelRecord, SeriesRecord
from medload.storage.store import Store, open_store

__all__ = ["NnunetCase", "NnunetExport", "export_nnunet", "select_keys"]

log = logging.getLogger(__name__)

_FILE_ENDING = ".nii.gz"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class NnunetCase:
    """One training case: nnU-Net's case identifier, the series it holds and the fold that validates it."""

    case: str
    series: str
    patient: str
    study: str
    fold: int


@dataclass(frozen=True)
class NnunetExport:
    """What :func:`export_nnunet` wrote: the dataset folder, nnU-Net's labels, the cases, the series of
    the selection that were left out (series key, reason), notes on classes mapped to background and the
    digest of the lineage record written with it (``medload_lineage.json``)."""

    path: Path
    labels: dict[str, int]
    cases: tuple[NnunetCase, ...]
    left_out: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]
    lineage: str = ""


def select_keys(store: Store, query: str | None) -> list[str]:
    """Keys of the series a catalog query selects (``DataFrame.query`` on :meth:`Store.catalog`; every
    series when None), sorted."""
    catalog = store.catalog()
    if query is None:
        return sorted(catalog["key"])
    try:
        chosen = catalog.query(query)
    except (SyntaxError, NameError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"query {query!r} does not run on the catalog ({type(exc).__name__}: {exc}); it is a "
                          f"pandas DataFrame.query expression over the columns {', '.join(catalog.columns)}, "
                          "such as \"kernel == 'B30f' and slice_thickness <= 1.5\"") from None
    return sorted(chosen["key"])


def export_nnunet(store: Store | str | os.PathLike, out: str | os.PathLike, *, dataset_id: int, name: str,
                  query: str | None = None, label_map: Mapping[str, Sequence[str]] | None = None, folds: int = 5,
                  seed: int = 0) -> NnunetExport:
    """Write the labelled series of ``store`` that ``query`` selects as ``out/Dataset{id:03d}_{name}``.

    Series without a label map, and sheared ones (gantry tilt kept with ``--tilt-policy shear``: nnU-Net
    reads NIfTI with SimpleITK, which needs orthogonal axes), are left out and listed. Classes follow
    :func:`medload.export.classes.dataset_classes` (``label_map``: ``{"liver": ["Liver", "LIVER_1"]}``);
    folds :func:`medload.export.folds.patient_folds`. The folder appears whole or not at all.

    Raises:
        ConfigError: a bad id, name or query, a dataset with that id already in ``out``, no labelled series
            selected, several modalities (nnU-Net normalises channel 0 one way), or classes that disagree.
    """
    if isinstance(dataset_id, bool) or not isinstance(dataset_id, int) or not 1 <= dataset_id <= 999:
        raise ConfigError(f"nnU-Net dataset ids are integers 1..999, got {dataset_id!r}")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"dataset name {name!r}: use letters, digits, '_' and '-' (it becomes the folder "
                          f"Dataset{dataset_id:03d}_NAME)")
    store = store if isinstance(store, Store) else open_store(store)
    out = Path(out)
    target = out / f"Dataset{dataset_id:03d}_{name}"
    taken = sorted(out.glob(f"Dataset{dataset_id:03d}_*")) if out.is_dir() else []
    if taken:
        raise ConfigError(f"{taken[0]} already holds nnU-Net dataset {dataset_id}: choose another --dataset-id, or "
                          "remove that folder to export again")
    chosen, label_records, left_out = _exportable([store.record(k) for k in select_keys(store, query)], store)
    if not chosen:
        why = "; ".join(sorted({reason for _, reason in left_out})) or "the query selects no series"
        raise ConfigError(f"no series to export ({why}): an nnU-Net training case needs an image and its labels")
    modalities = sorted({rec.modality for rec in chosen})
    if len(modalities) > 1:
        raise ConfigError(f"the selection mixes modalities {modalities}; nnU-Net normalises a channel one way: "
                          "export one, e.g. --query \"modality == 'CT'\"")
    labels, luts, notes = dataset_classes(label_records, label_map)
    folds_of = patient_folds([rec.patient for rec in chosen], folds, seed)
    cases = tuple(NnunetCase(f"case_{i:04d}", rec.key, rec.patient, rec.study, fold)
                  for i, (rec, fold) in enumerate(zip(chosen, folds_of)))
    for note in notes:
        log.warning("%s", note)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f".{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted export
    partial.mkdir()
    try:
        _write_cases(store, partial, cases, luts)
        _write_json(partial / "dataset.json", {
            "channel_names": {"0": modalities[0]}, "labels": labels, "numTraining": len(cases),
            "file_ending": _FILE_ENDING, "name": name,
            "description": f"{len(cases)} {modalities[0]} series of a medload store (HU as stored, the series "
                           "affine); medload_cases.json names the series of each case"})
        _write_json(partial / "splits_final.json", nnunet_splits([c.case for c in cases], folds_of))
        _write_json(partial / "medload_cases.json", {
            "query": query, "label_map": None if label_map is None else dict(label_map), "folds": folds,
            "seed": seed, "cases": [asdict(c) for c in cases],
            "left_out": [{"series": key, "reason": reason} for key, reason in left_out], "notes": notes})
        record = make_record(store, chosen, labels=True, timed=False, export={
            "kind": "nnU-Net v2", "dataset_id": dataset_id, "name": name, "query": query,
            "label_map": None if label_map is None else dict(label_map),
            "labels": labels, "folds": folds, "seed": seed})
        save(record, partial / "medload_lineage.json")
        partial.rename(target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log.info("wrote %s: %d cases of %d patients in %d folds", target, len(cases), len({c.patient for c in cases}),
             folds)
    return NnunetExport(target, labels, cases, tuple(left_out), tuple(notes), record.digest)


def _exportable(records: list[SeriesRecord], store: Store
                ) -> tuple[list[SeriesRecord], list[LabelRecord], list[tuple[str, str]]]:
    """The records that can be training cases, their label records, and (key, reason) for the others."""
    chosen: list[SeriesRecord] = []
    labels: list[LabelRecord] = []
    left_out: list[tuple[str, str]] = []
    for rec in records:
        label = store.labels(rec.key_bytes)
        if label is None:
            left_out.append((rec.key, "no label map stored"))
        elif not _orthogonal(rec.affine):
            left_out.append((rec.key, "sheared grid (gantry tilt): nnU-Net's SimpleITK reader needs orthogonal axes"))
        else:
            chosen.append(rec)
            labels.append(label)
    return chosen, labels, left_out


def _orthogonal(affine, tol: float = 1e-4) -> bool:
    """Whether the voxel axes of an affine are at right angles (cosines of their angles within ``tol``)."""
    axes = np.asarray(affine, dtype=np.float64)[:3, :3]
    axes = axes / np.linalg.norm(axes, axis=0)
    return bool(np.all(np.abs(axes.T @ axes - np.eye(3)) <= tol))


def _write_cases(store: Store, folder: Path, cases: Sequence[NnunetCase], luts) -> None:
    """imagesTr/CASE_0000.nii.gz and labelsTr/CASE.nii.gz of every case (one channel: the stored volume)."""
    (folder / "imagesTr").mkdir()
    (folder / "labelsTr").mkdir()
    for case, lut in zip(cases, luts):
        nib.save(to_nifti(store, case.series), folder / "imagesTr" / f"{case.case}_0000{_FILE_ENDING}")
        stored = to_nifti(store, case.series, label=True)
        label = nib.Nifti1Image(lut[np.asarray(stored.dataobj)], stored.affine, stored.header)
        label.set_data_dtype(lut.dtype)
        nib.save(label, folder / "labelsTr" / f"{case.case}{_FILE_ENDING}")
        log.info("%s <- series %s (fold %d)", case.case, case.series[:12], case.fold)


def _write_json(path: Path, doc) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n")
