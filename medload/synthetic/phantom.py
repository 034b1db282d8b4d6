"""A torso-like CT phantom with realistic HU statistics."""

from __future__ import annotations

import numpy as np

from medload.errors import ConfigError

__all__ = ["phantom_hu"]


def _ellipse(x: np.ndarray, y: np.ndarray, cx: float, cy: float, ax: np.ndarray, ay: np.ndarray) -> np.ndarray:
    return ((x - cx) / ax) ** 2 + ((y - cy) / ay) ** 2 <= 1.0


def phantom_hu(shape: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
    """Return int16 HU of shape (slices, rows, columns): a torso cross-section that changes along z.

    Air about -1000 outside an elliptical body, a fat layer about -100, soft tissue about 40 (noise sd
    15), two lungs about -850 and a vertebra of 700 (marrow) to 1200 (cortex). Rows run anterior to
    posterior, so the spine sits at high row indices. Values are clipped to [-1024, 3071].
    """
    if len(shape) != 3 or min(shape) < 1:
        raise ConfigError(f"phantom shape must be three positive sizes (slices, rows, columns), got {shape}")
    d, h, w = (int(n) for n in shape)
    z = (np.arange(d) / max(d - 1, 1))[:, None, None]
    y = ((np.arange(h) + 0.5) / h * 2.0 - 1.0)[None, :, None]
    x = ((np.arange(w) + 0.5) / w * 2.0 - 1.0)[None, None, :]
    phase = rng.uniform(0.0, 2.0 * np.pi, size=3)

    body_scale = 1.0 + 0.06 * np.sin(2.0 * np.pi * z + phase[0])
    lung_scale = 0.75 + 0.25 * np.sin(np.pi * z + phase[1])
    spine_shift = 0.03 * np.sin(2.0 * np.pi * z + phase[2])

    body = _ellipse(x, y, 0.0, 0.0, 0.88 * body_scale, 0.66 * body_scale)
    inner = _ellipse(x, y, 0.0, 0.0, 0.88 * body_scale - 0.09, 0.66 * body_scale - 0.09)
    lungs = _ellipse(x, y, -0.38, -0.08, 0.24 * lung_scale, 0.36 * lung_scale) | _ellipse(
        x, y, 0.38, -0.08, 0.24 * lung_scale, 0.36 * lung_scale
    )
    r_spine = np.sqrt((x - spine_shift) ** 2 + ((y - 0.40) / 0.9) ** 2)
    spine = r_spine <= 0.15

    hu = np.full((d, h, w), -1000.0) + rng.normal(0.0, 10.0, (d, h, w))
    hu = np.where(body, -100.0 + rng.normal(0.0, 15.0, (d, h, w)), hu)
    hu = np.where(inner, 40.0 + rng.normal(0.0, 15.0, (d, h, w)), hu)
    hu = np.where(inner & lungs, -850.0 + rng.normal(0.0, 30.0, (d, h, w)), hu)
    bone = 700.0 + 500.0 * np.clip(r_spine / 0.15, 0.0, 1.0) ** 2 + rng.normal(0.0, 25.0, (d, h, w))
    hu = np.where(inner & spine, bone, hu)
    return np.clip(np.rint(hu), -1024, 3071).astype(np.int16)
