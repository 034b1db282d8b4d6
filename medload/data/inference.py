"""Sliding-window inference at a model's training spacing and orientation, answered on the stored grid.

:func:`predict_series` resamples a whole stored series onto the grid a :class:`~medload.data.PatchDataset`
model was trained on (:func:`~medload.data.patch_geometry.covering_grid`: the series' extent at
``spacing`` along ``orientation``; trilinear, -1024 HU outside), runs MONAI's
``sliding_window_inference`` over it, resamples the model's output channels back onto the series'
own voxels (trilinear, so a voxel between two target voxels weighs both) and takes the arg max there:
a ``(slices, rows, columns)`` label map on the stored grid, what ``medload.writeback.push_seg`` and
``medload export`` take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from medload.data.patch_geometry import (
    axcode_directions,
    covering_grid,
    native_directions,
    native_spacing,
    voxel_to_voxel,
)
from medload.data.resample import resample_volume
from medload.errors import ConfigError
from medload.storage.store import Store

__all__ = ["predict_series", "target_grid"]

_CHUNK = 1 << 22  # output values (classes x voxels) resampled back at a time


def target_grid(store: Store, key: str | bytes, spacing: Sequence[float] | None = None,
                orientation: str | None = "RAS", least: Sequence[int] = (1, 1, 1)) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The affine (``(d, h, w)`` to RAS mm) and shape ``(D, H, W)`` of the grid at ``spacing`` along
    ``orientation`` (as :class:`~medload.data.PatchDataset` takes them) holding the whole series, at least
    ``least`` voxels along each axis.

    Examples:
        >>> rec = store.series()[0]
        >>> affine, shape = target_grid(store, rec.key, spacing=(5.0, 2.0, 2.0))
        >>> shape              # 28 slices at 5 mm; 512 columns 0.451 mm apart span 230.5 mm: 117 at 2 mm
        (28, 117, 117)
    """
    rec = store.record(key)
    directions = native_directions(rec.affine) if orientation is None else axcode_directions(orientation)
    spacing = native_spacing(rec.affine, directions) if spacing is None else tuple(float(s) for s in spacing)
    return covering_grid(rec.affine, rec.shape, spacing, directions, least)


def predict_series(store: Store, key: str | bytes, model: Callable[[torch.Tensor], torch.Tensor],
                   patch: Sequence[int], spacing: Sequence[float] | None = None, orientation: str | None = "RAS",
                   *, overlap: float = 0.5, sw_batch_size: int = 1, mode: str = "gaussian", device: str = "cpu",
                   preprocess: Callable[[torch.Tensor], torch.Tensor] | None = None) -> np.ndarray:
    """The label map ``(slices, rows, columns)`` a model predicts for a stored series, on the stored grid.

    Args:
        store, key: the series.
        model: takes ``(B, channels, D, H, W)`` windows of ``patch`` voxels, returns ``(B, classes, D, H, W)``
            logits or probabilities (one channel: a foreground logit, thresholded at 0). Put it in eval mode.
        patch, spacing, orientation: the window, and the grid the model was trained at (as
            :class:`~medload.data.PatchDataset`'s).
        overlap, sw_batch_size, mode: MONAI ``sliding_window_inference``'s (``"gaussian"``: nnU-Net's
            blending of overlapping windows).
        device: where the model runs; the whole resampled series and the stitched output stay on the CPU.
        preprocess: applied to the resampled series ``(1, 1, D, H, W)`` (float32 HU) before the windows,
            e.g. the intensity normalisation the model was trained with.

    Returns uint8 class ids (uint16 beyond 256 classes), 0 where the model says background.

    Examples:
        >>> model = torch.nn.Conv3d(1, 2, 3, padding=1)
        >>> rec = store.series()[0]
        >>> with torch.no_grad():
        ...     pred = predict_series(store, rec.key, model, patch=(16, 64, 64), spacing=(5.0, 2.0, 2.0))
        >>> pred.shape == rec.shape, pred.dtype
        (True, dtype('uint8'))
    """
    from monai.inferers import sliding_window_inference

    if len(patch) != 3 or min(patch) < 1:
        raise ConfigError(f"patch must be three sizes (D, H, W), got {tuple(patch)}")
    rec = store.record(key)
    affine, shape = target_grid(store, key, spacing, orientation, least=patch)
    image = resample_volume(store.read(rec.key), voxel_to_voxel(affine, rec.affine), shape)
    x = image[None, None]
    if preprocess is not None:
        x = preprocess(x)
    with torch.inference_mode():
        out = sliding_window_inference(x, tuple(int(n) for n in patch), sw_batch_size, model, overlap=overlap,
                                       mode=mode, sw_device=device, device="cpu")
    return _to_series_grid(torch.as_tensor(out)[0].float(), np.linalg.inv(voxel_to_voxel(affine, rec.affine)),
                           rec.shape)


def _to_series_grid(logits: torch.Tensor, back: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Class ids on the stored grid ``shape`` from ``logits`` ``(classes, D, H, W)`` on the target grid,
    ``back`` mapping stored index to target index: trilinear per channel, then the arg max (or, for one
    channel, logit > 0), a few slices at a time so only their channels are held."""
    classes = logits.shape[0]
    out = np.zeros(tuple(shape), dtype=np.uint8 if classes <= 256 else np.uint16)
    step = max(1, _CHUNK // (classes * int(shape[1]) * int(shape[2])))
    for z0 in range(0, int(shape[0]), step):
        m = back.copy()
        m[:3, 3] += m[:3, 0] * z0  # the chunk's first slice is slice z0
        part = resample_volume(logits, m, (min(step, int(shape[0]) - z0), *shape[1:]), pad=0.0)
        out[z0 : z0 + part.shape[1]] = (part[0] > 0 if classes == 1 else part.argmax(dim=0)).numpy()
    return out
