"""Diffusion-weighted stacks: their labels, numbered in acquisition order, and the b-value and gradient
their records keep.

The b-value and direction of a plane come from DiffusionBValue (0018,9087) and
DiffusionGradientOrientation (0018,9089), else a vendor's private tags (:mod:`medload.ingest.vendor`).
Stacks are labelled ``b<value>``, or ``b<value>_dir<k>`` where several directions share a b-value: k
counts the directions in acquisition order -- the order of the stacks' first InstanceNumber (0020,0013),
then frame, as dcm2niix orders its volumes -- so ``dir01`` is the first direction acquired.

A record keeps ``b_value``, ``gradient`` (unit vector in the patient frame, LPS, as DICOM writes it) and
``gradient_image`` (the same vector along the volume's voxel axes: column, row, slice), from which
:func:`medload.storage.nifti.export_nifti` writes FSL's ``.bval``/``.bvec``. A direction in a vendor's
image frame (GE) is kept for labels only: its axes' signs are not public, so no gradient is recorded.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Hashable
from decimal import Decimal, InvalidOperation

import numpy as np

from medload.ingest.headers import SliceHeader

__all__ = ["diffusion_labels", "diffusion_record"]


def _b_text(b: str) -> str:
    try:
        return f"b{Decimal(b).normalize():f}"
    except InvalidOperation:
        return f"b{re.sub(r'[^a-z0-9]+', '_', b.lower()).strip('_')}" if b else "dwi"


def _acquired(members: list[SliceHeader]) -> tuple:
    """When a stack was acquired, relative to the others: its first InstanceNumber, then frame."""
    return min((h.instance_number is None, h.instance_number or 0, h.frame or 0) for h in members)


def diffusion_labels(parts: dict[Hashable, list[SliceHeader]]) -> dict[Hashable, str]:
    """Labels of stacks by their ``"b-value|direction"`` value (see the module docstring)."""
    directions: dict[str, list[Hashable]] = defaultdict(list)
    for v in parts:
        directions[str(v).partition("|")[0]].append(v)
    out: dict[Hashable, str] = {}
    for b, values in directions.items():
        ranked = sorted(values, key=lambda v: (_acquired(parts[v]), str(v)))
        for k, v in enumerate(ranked, 1):
            out[v] = _b_text(b) + (f"_dir{k:02d}" if len(ranked) > 1 else "")
    return out


def diffusion_record(diffusion: str, frame: str, affine_lps: np.ndarray) -> dict:
    """``b_value``, ``gradient`` and ``gradient_image`` of a stack split by ``diffusion`` ("b|gx\\gy\\gz"),
    whose direction is in ``frame`` ("patient" or a vendor's "image"), for a volume placed by ``affine_lps``;
    {} when there is no b-value."""
    b_text, _, direction = diffusion.partition("|")
    try:
        b_value = float(b_text)
    except ValueError:
        return {}
    out: dict = {"b_value": b_value}
    try:
        vector = np.array([float(v) for v in direction.split("\\")]) if direction else None
    except ValueError:
        vector = None
    if vector is None or vector.shape != (3,) or frame != "patient" or not np.linalg.norm(vector):
        return out
    vector /= np.linalg.norm(vector)
    axes = affine_lps[:3, :3] / np.linalg.norm(affine_lps[:3, :3], axis=0)
    out["gradient"] = tuple(round(float(v), 6) for v in vector)
    out["gradient_image"] = tuple(round(float(v), 6) for v in axes.T @ vector)
    return out
