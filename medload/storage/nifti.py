"""Export a stored volume as NIfTI-1 with its RAS affine, so any viewer can check the geometry."""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np

from medload.storage.store import Store

__all__ = ["export_nifti", "to_nifti"]


def to_nifti(store: Store, key: str | bytes) -> nib.Nifti1Image:
    """The series as an in-memory NIfTI image: data ``(column, row, slice)``, sform = qform = affine."""
    rec = store.record(key)
    data = store.read(rec.key).transpose(2, 1, 0)
    image = nib.Nifti1Image(data, np.asarray(rec.affine, dtype=np.float64))
    image.header.set_xyzt_units("mm")
    image.set_sform(image.affine, code=1)  # scanner-based anatomical coordinates
    image.set_qform(image.affine, code=1)
    image.header["descrip"] = f"medload {rec.modality} {rec.key[:12]}".encode()[:79]
    return image


def export_nifti(store: Store, key: str | bytes, out: str | os.PathLike) -> Path:
    """Write the series to ``out`` (``.nii`` or ``.nii.gz``); returns the path written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    nib.save(to_nifti(store, key), out)
    return out
