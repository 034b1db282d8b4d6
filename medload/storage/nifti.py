"""Export a stored volume as NIfTI-1 with its RAS affine, so any viewer can check the geometry."""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np

from medload.storage.store import Store

__all__ = ["export_nifti", "to_nifti"]


def to_nifti(store: Store, key: str | bytes, *, label: bool = False) -> nib.Nifti1Image:
    """The series (or its label map) as an in-memory NIfTI image: data ``(column, row, slice)``,
    sform = qform = the series affine, so image and label overlay in any viewer."""
    rec = store.record(key)
    data = (store.read_label(rec.key) if label else store.read(rec.key)).transpose(2, 1, 0)
    image = nib.Nifti1Image(data, np.asarray(rec.affine, dtype=np.float64))
    image.header.set_xyzt_units("mm")
    image.set_sform(image.affine, code=1)  # scanner-based anatomical coordinates
    image.set_qform(image.affine, code=1)
    image.header["descrip"] = f"medload {'label' if label else rec.modality} {rec.key[:12]}".encode()[:79]
    return image


def export_nifti(store: Store, key: str | bytes, out: str | os.PathLike, *, label: bool = False) -> Path:
    """Write the series (or its label map) to ``out`` (``.nii`` or ``.nii.gz``); returns the path written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    nib.save(to_nifti(store, key, label=label), out)
    return out
