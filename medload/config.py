"""Typed settings, in one place, with the defaults the README documents.

Every setting can come from a TOML file (``--config FILE`` on the command line, :func:`load_config` in
Python) and be overridden by command-line flags. A file has one table per section::

    [ingest]
    workers = 8
    windows = ["lung", "soft_tissue"]

    [cache]
    l1 = "512MB"                      # in-process LRU of decoded slices, per process
    hot_dir = "/local/ssd/medload"    # L2: verified copies of shards on local disk
    hot_budget = "200GB"
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from medload.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["IngestConfig", "CacheConfig", "MedloadConfig", "load_config", "with_overrides", "parse_size", "format_size",
           "affinity_cores"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def affinity_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a Slurm allocation).

    Example:
        >>> affinity_cores() >= 1
        True
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_size(text: str | int) -> int:
    """Bytes from ``"4GB"``, ``"512MiB"``, ``"1.5G"`` or an integer."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"{text!r} is not a size: write e.g. 4GB, 512MB or 1.5GiB")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(size: int) -> str:
    """``"4 GB"``, ``"512 MB"``: a byte count in decimal units, three significant digits at most."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} bytes"


@dataclass(frozen=True)
class IngestConfig:
    """How ``medload ingest`` decides and works. Policies reject by default; each names the problem.

    Attributes:
        workers: decoding processes (``None``: all cores); each input is read and decoded in one of
            them, never in the writing process (see :mod:`medload.ingest.isolation`).
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
        worker_memory: memory cap of one decoding process in bytes (its data segment, ``RLIMIT_DATA``;
            see :mod:`medload.ingest.isolation`); an input that needs more is quarantined. 0: no cap.
        decode_timeout: seconds one input may take in a decoding process (its header, or one plane);
            the process is killed past it and the input quarantined. 0: no limit.
        plausibility: what to do with CT pixels that decode but cannot be real (see
            :mod:`medload.ingest.plausibility`): ``"reject"`` the series, ``"flag"`` it (stored, with
            a flag naming the slice), or ``"off"``.
        time_series: stacks at the same positions over time (fMRI, perfusion, 4-D CT): ``"split"`` into
            one volume per time point (flags ``t_01``..., linked by ``time_series`` in their records), or
            ``"reject"`` the series ("time series of N points"); see :mod:`medload.ingest.splits`.
        strict: a run that rejected anything exits non-zero.

    Example:
        >>> from medload.ingest import ingest
        >>> cfg = IngestConfig(workers=4, windows=("lung",), tilt_policy="shear")
        >>> report = ingest("dicom/", "stores/ct", config=cfg)   # doctest: +SKIP
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
    worker_memory: int = 4 * 10**9
    decode_timeout: float = 60.0
    plausibility: str = "reject"
    time_series: str = "split"
    strict: bool = False

    def __post_init__(self) -> None:
        if self.tilt_policy not in ("reject", "shear"):
            raise ConfigError(f"tilt policy {self.tilt_policy!r}: use 'reject' or 'shear'")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be at least 1, got {self.workers}")
        if self.spacing_tolerance_mm <= 0 or self.duplicate_tolerance_mm <= 0:
            raise ConfigError("tolerances must be positive")
        if self.plausibility not in ("reject", "flag", "off"):
            raise ConfigError(f"plausibility {self.plausibility!r}: use 'reject', 'flag' or 'off'")
        if self.time_series not in ("split", "reject"):
            raise ConfigError(f"time series policy {self.time_series!r}: use 'split' or 'reject'")
        if self.worker_memory < 0 or self.decode_timeout < 0:
            raise ConfigError("worker memory and decode timeout must be >= 0 (0: no limit)")

    @property
    def worker_count(self) -> int:
        return self.workers or affinity_cores()


@dataclass(frozen=True)
class CacheConfig:
    """How a :class:`~medload.Store` reads: L1 in-process LRU → L2 hot-shard copies → L3 the store.

    Attributes:
        l1_bytes: budget of decoded slices kept in this process (0 disables L1). Every process (each
            DataLoader worker) has its own, shared by all its Stores, with the largest budget any of
            them asked for; except that the workers of a loader over a dataset more than 8 times the
            budget share it, each keeping 1/num_workers (see :func:`medload.data.loader.worker_l1`).
        hot_dir: local-SSD directory for verified shard copies (L2); ``None`` disables L2.
        hot_budget: bytes the hot directory may hold; the least recently used copies are evicted.
        fetch: ``"background"``: a shard read from the store is copied to the hot directory by a
            background thread; ``"never"``: only ``medload cache warm`` fills it.
        max_rate: bytes/s limit for copies (be kind to a shared NFS server); ``None``: no limit.
        verify: check each value's xxh3 checksum when it is read (a damaged value then raises
            :class:`~medload.errors.ChecksumError`, or falls back to the store for a hot copy).
    """

    l1_bytes: int = 256 * 10**6
    hot_dir: Path | None = None
    hot_budget: int = 0
    fetch: str = "background"
    max_rate: int | None = None
    verify: bool = True

    def __post_init__(self) -> None:
        if self.l1_bytes < 0:
            raise ConfigError(f"l1 budget must be >= 0, got {self.l1_bytes}")
        if self.fetch not in ("background", "never"):
            raise ConfigError(f"fetch {self.fetch!r}: use 'background' or 'never'")
        if self.hot_dir is not None and self.hot_budget <= 0:
            raise ConfigError("a hot directory needs a budget: set hot_budget (e.g. \"50GB\")")


@dataclass(frozen=True)
class MedloadConfig:
    """All settings: one section per stage."""

    ingest: IngestConfig = field(default_factory=IngestConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)


#: TOML keys that differ from field names, and the converter of each value
_CACHE_KEYS = {"l1": ("l1_bytes", parse_size), "hot_dir": ("hot_dir", Path), "hot_budget": ("hot_budget", parse_size),
               "fetch": ("fetch", str), "max_rate": ("max_rate", parse_size), "verify": ("verify", bool)}
_INGEST_KEYS = {"workers": ("workers", int), "codec": ("codec", str), "windows": ("windows", tuple),
                "tilt_policy": ("tilt_policy", str), "shard_size": ("shard_bytes", parse_size),
                "strict": ("strict", bool), "spacing_tolerance_mm": ("spacing_tolerance_mm", float),
                "worker_memory": ("worker_memory", parse_size), "decode_timeout": ("decode_timeout", float),
                "plausibility": ("plausibility", str), "time_series": ("time_series", str),
                "spacing_tolerance_rel": ("spacing_tolerance_rel", float),
                "duplicate_tolerance_mm": ("duplicate_tolerance_mm", float)}


def _section(table: dict, keys: dict, where: str) -> dict:
    unknown = sorted(set(table) - set(keys))
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(keys))}")
    out = {}
    for key, value in table.items():
        name, convert = keys[key]
        try:
            out[name] = convert(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {key} = {value!r} is not valid ({exc})") from None
    return out


def load_config(path: str | os.PathLike | None = None) -> MedloadConfig:
    """Settings from a TOML file (sections ``[ingest]`` and ``[cache]``); defaults without a file."""
    if path is None:
        return MedloadConfig()
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    unknown = sorted(set(doc) - {"ingest", "cache"})
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}; use [ingest] and [cache]")
    return MedloadConfig(
        ingest=IngestConfig(**_section(doc.get("ingest", {}), _INGEST_KEYS, f"{path} [ingest]")),
        cache=CacheConfig(**_section(doc.get("cache", {}), _CACHE_KEYS, f"{path} [cache]")),
    )


def with_overrides(config, **flags):
    """``config`` with the flags that were given (not None) replacing its fields."""
    names = {f.name for f in fields(config)}
    return replace(config, **{k: v for k, v in flags.items() if v is not None and k in names})
