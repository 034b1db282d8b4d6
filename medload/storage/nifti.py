"""Export a stored volume as NIfTI-1 with its RAS affine, so any viewer can check the geometry; a
diffusion-weighted volume gets FSL's ``.bval``/``.bvec`` beside it, as dcm2niix writes them."""

from __future__ import annotations

import os
from pathlib import Path

import nibabel as nib
import numpy as np

from medload.storage.store import Store

__all__ = ["export_nifti", "to_nifti", "fsl_gradient"]


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
    image = to_nifti(store, key, label=label)
    nib.save(image, out)
    rec = store.record(key)
    if not label and rec.b_value is not None:
        stem = out.with_name(out.name.removesuffix(".gz").removesuffix(".nii"))
        bval, bvec = fsl_gradient(rec.b_value, rec.gradient_image, image.affine)
        stem.with_suffix(".bval").write_text(bval)
        stem.with_suffix(".bvec").write_text(bvec)
    return out


def fsl_gradient(b_value: float, gradient_image: tuple[float, float, float] | None,
                 affine: np.ndarray) -> tuple[str, str]:
    """The ``.bval`` and ``.bvec`` text of one volume: the b-value, and the gradient along the voxel axes of
    the image ``affine`` describes, with the first axis negated where that affine's determinant is positive
    (FSL's convention: bvecs are given for radiological voxel order); zeros without a gradient."""
    vector = np.zeros(3) if gradient_image is None else np.asarray(gradient_image, dtype=np.float64)
    if gradient_image is not None and np.linalg.det(affine[:3, :3]) > 0:
        vector[0] = -vector[0]
    return f"{b_value:g}\n", "".join(f"{v + 0.0:.6g}\n" for v in vector)
