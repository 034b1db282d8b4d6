"""Typed settings, in one place, with the defaults the README documents."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from medload.errors import ConfigError

__all__ = ["IngestConfig", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from ``"4GB"``, ``"512MiB"``, ``"1.5G"`` or an integer."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"{text!r} is not a size: write e.g. 4GB, 512MB or 1.5GiB")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class IngestConfig:
    """How ``medload ingest`` decides and works. Policies reject by default; each names the problem.

    Attributes:
        workers: decoding processes (``None``: all cores; 1: everything in this process).
        codec: slice codec for a new store (see :mod:`medload.storage.codec`).
        windows: names of pre-windowed uint8 planes to store besides HU (see :mod:`medload.windows`).
        spacing_tolerance_mm, spacing_tolerance_rel: a slice may sit at most
            ``max(mm, rel * slice spacing)`` from where the affine puts it; otherwise the series has
            irregular spacing or gaps and is rejected.
        duplicate_tolerance_mm: slices closer than this along the normal share one position.
        tilt_policy: ``"reject"`` a sheared stack (gantry tilt), or ``"shear"``: keep it with the sheared
            affine that places every slice where its ImagePositionPatient says (flagged ``sheared``).
        shard_bytes: publish a shard and start a new one past this size.
        max_frame_pixels, max_frames: caps checked against the header before any pixel is decoded.
        strict: a run that rejected anything exits non-zero.
    """

    workers: int | None = None
    codec: str = "blosc2-lz4"
    windows: tuple[str, ...] = ()
    spacing_tolerance_mm: float = 0.1
    spacing_tolerance_rel: float = 0.01
    duplicate_tolerance_mm: float = 0.01
    tilt_policy: str = "reject"
    shard_bytes: int = 4 * 10**9
    max_frame_pixels: int = 16384 * 16384
    max_frames: int = 100_000
    strict: bool = False

    def __post_init__(self) -> None:
        if self.tilt_policy not in ("reject", "shear"):
            raise ConfigError(f"tilt policy {self.tilt_policy!r}: use 'reject' or 'shear'")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be at least 1, got {self.workers}")
        if self.spacing_tolerance_mm <= 0 or self.duplicate_tolerance_mm <= 0:
            raise ConfigError("tolerances must be positive")

    @property
    def worker_count(self) -> int:
        if self.workers:
            return self.workers
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
