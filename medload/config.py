"""Typed settings, in one place, with the defaults the README documents.

Every setting can come from a TOML file (``--config FILE`` on the command line, :func:`load_config` in
Python) and be overridden by command-line flags. A setting has one name: its field name here is its key
in TOML and, with dashes, its command-line flag (``shard_bytes``, ``--shard-bytes``). A file has one
table per section::

    [ingest]
    workers = 8
    windows = ["lung", "soft_tissue"]

    [cache]
    l1_bytes = "512MB"                # in-process LRU of decoded slices, per process
    hot_dir = "/local/ssd/medload"    # L2: verified copies of shards on local disk
    hot_budget = "200GB"

    [loader]
    batch_size = 16
    num_workers = "auto"              # loader processes, or measure and choose

Each value is checked against its field's annotation, from TOML and from Python alike: a boolean is
``true``/``false`` (the string ``"false"`` is an error), an integer is not ``"4"``, a byte size (a field
with ``metadata={"unit": "bytes"}``) is an integer or a size string such as ``"2GB"``, and ``windows`` is
a list of names or one name. A wrong value is a :class:`~medload.errors.ConfigError` naming the key
(and the file).
"""

from __future__ import annotations

import contextlib
import enum
import numbers
import os
import re
import sys
import types
import typing
import warnings
from dataclasses import Field, dataclass, field, fields, replace
from functools import cache
from pathlib import Path

from medload import windows
from medload.cgroup_limits import affinity_cores, usable_cores
from medload.errors import ConfigError

if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["IngestConfig", "CacheConfig", "LoaderConfig", "MedloadConfig", "load_config", "with_overrides", "parse_size",
           "format_size", "affinity_cores", "RENAMED", "FROM_CONFIG", "choose"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
#: field metadata of a byte count: an integer, or a size string such as "4GB" (see :func:`parse_size`)
_BYTES = {"unit": "bytes"}


#: A store's share settings (:mod:`medload.storage.sharing`): its owner only, or a group.
SHARE_PRIVATE = "private"
SHARE_GROUP = "group"


def check_share_setting(text: str) -> str:
    """``text`` if it is a share setting (``private``, ``group`` or ``group:NAME``), else a ConfigError."""
    kind, colon, name = text.partition(":")
    if text == SHARE_PRIVATE or (kind == SHARE_GROUP and (not colon or name.strip() == name != "")):
        return text
    raise ConfigError(f"share setting {text!r}: use 'private' (the owner only), 'group' (the group of the store's "
                      "folder reads it) or 'group:NAME'")


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
        workers: decode processes (``None``: one per usable core -- fewer under a container's CPU quota --
            and no more than fit in the free memory, see :mod:`medload.ingest.memory_need`); each input is
            read and decoded in one of them, never in the writing process (see :mod:`medload.ingest.isolation`).
        codec: slice codec for a new store (see :mod:`medload.storage.codec`).
        windows: names of pre-windowed uint8 planes to store besides HU (see :mod:`medload.windows`);
            one name (``"lung"``) is one window.
        spacing_tolerance_mm, spacing_tolerance_rel: a slice may sit at most
            ``max(mm, rel * slice spacing)`` from where the affine puts it; otherwise the series has
            irregular spacing or gaps and is rejected.
        duplicate_tolerance_mm: slices closer than this along the normal share one position.
        tilt_policy: ``"reject"`` a sheared stack (gantry tilt), or ``"shear"``: keep it with the sheared
            affine that places every slice where its ImagePositionPatient says (flagged ``sheared``).
        shard_bytes: publish a shard and start a new one past this size. Like every byte size here,
            an integer or a size string (``"2GB"``).
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
        label_min_kept: a label (mask, SEG or RTSTRUCT) with less than this fraction of its foreground
            inside its series' grid (placed by physical position) is rejected as the label of another
            series or patient, with the figure; one kept above it but not whole is stored, its fraction
            recorded (``kept`` of its label record) and shown by ``ls``, ``info``, the catalog and
            ``verify``. 0 keeps any label that overlaps at all; 1 rejects every cut label.
        strict: a run that rejected anything exits non-zero.
        share: who may read the store: ``"private"`` (its owner), ``"group"`` (the group of the store's
            folder too) or ``"group:NAME"`` (group NAME); recorded in the store and kept by every later
            writer (see :mod:`medload.storage.sharing`). None: the store's own setting (a new store: private).

    Examples:
        >>> from medload.ingest import ingest
        >>> cfg = IngestConfig(workers=4, windows="lung", shard_bytes="2GB", tilt_policy="shear")
        >>> cfg.windows, cfg.shard_bytes
        (('lung',), 2000000000)
        >>> report = ingest("dicom/", "stores/ct", config=cfg)   # doctest: +SKIP
    """

    workers: int | None = None
    codec: str = "blosc2-lz4"
    windows: tuple[str, ...] = ()
    spacing_tolerance_mm: float = 0.1
    spacing_tolerance_rel: float = 0.01
    duplicate_tolerance_mm: float = 0.01
    tilt_policy: str = "reject"
    shard_bytes: int = field(default=4 * 10**9, metadata=_BYTES)
    max_frame_pixels: int = 16384 * 16384
    max_frames: int = 100_000
    worker_memory: int = field(default=4 * 10**9, metadata=_BYTES)
    decode_timeout: float = 60.0
    plausibility: str = "reject"
    time_series: str = "split"
    label_min_kept: float = 0.5
    strict: bool = False
    share: str | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.share is not None:
            check_share_setting(self.share)
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
        if not 0 <= self.label_min_kept <= 1:
            raise ConfigError(f"label_min_kept must be a fraction from 0 to 1 (0.5: half), got {self.label_min_kept}")
        if self.worker_memory < 0 or self.decode_timeout < 0:
            raise ConfigError("worker memory and decode timeout must be >= 0 (0: no limit)")

    @property
    def worker_count(self) -> int:
        return self.workers or usable_cores()


@dataclass(frozen=True)
class CacheConfig:
    """How a :class:`~medload.Store` reads: L1 in-process LRU → L2 hot-shard copies → L3 the store.

    Attributes:
        l1_bytes: budget of decoded slices kept in this process (0 disables L1). Every process (each
            DataLoader worker) has its own, shared by all its Stores, with the largest budget any of
            them asked for; except that the workers of a loader over a dataset more than 8 times the
            budget share it, each keeping 1/num_workers (see :func:`medload.data.slots.worker_l1`).
        hot_dir: local-SSD directory for verified shard copies (L2); ``None`` disables L2.
        hot_budget: bytes the hot directory may hold; the least recently used copies are evicted.
        fetch: ``"background"``: a shard read from the store is copied to the hot directory by a
            background thread; ``"never"``: only ``medload cache warm`` fills it.
        max_rate: bytes/s limit for copies (be kind to a shared NFS server); ``None``: no limit.
        verify: check each value's xxh3 checksum when it is read (a damaged value then raises
            :class:`~medload.errors.ChecksumError`, or falls back to the store for a hot copy).
    """

    l1_bytes: int = field(default=256 * 10**6, metadata=_BYTES)
    hot_dir: Path | None = None
    hot_budget: int = field(default=0, metadata=_BYTES)
    fetch: str = "background"
    max_rate: int | None = field(default=None, metadata={"unit": "bytes/s"})
    verify: bool = True

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.l1_bytes < 0:
            raise ConfigError(f"l1_bytes must be >= 0 (0 disables L1), got {self.l1_bytes}")
        if self.fetch not in ("background", "never"):
            raise ConfigError(f"fetch {self.fetch!r}: use 'background' or 'never'")
        if self.hot_dir is not None and self.hot_budget <= 0:
            raise ConfigError("a hot directory needs a budget: give --hot-budget on the command line, or hot_budget in "
                              "the [cache] table of the config file (e.g. \"50GB\")")


#: the batch dtypes a loader hands out, by name (see :func:`medload.data.make_loader`'s ``dtype``)
LOADER_DTYPES = ("float32", "float64", "float16", "bfloat16", "int16", "uint8")
_CONTEXTS = ("fork", "spawn", "forkserver")


@dataclass(frozen=True)
class LoaderConfig:
    """How a training loader runs: :func:`~medload.data.make_loader` (``config=``),
    :class:`~medload.lightning.StoreDataModule` (``config=``), ``profile_training`` / ``medload profile``
    and ``pipelines/train_segmentation.py`` take it, and the ``[loader]`` table of a config file holds it.
    A keyword given explicitly wins over the config (see each of them).

    Attributes:
        batch_size: samples per batch. ``None``: the tool's default (``make_loader`` needs one; the
            data module and the pipeline take 8, ``medload profile`` 4).
        num_workers: loader processes (DataLoader workers), or ``"auto"``: measure and choose (see
            :mod:`medload.data.autotune`). ``None``: the tool's default (0; the pipeline 2).
        window: HU window applied on the device (a preset, ``"350/50"``...). ``None``: the tool's default
            (no window; ``medload profile`` and the pipeline: ``soft_tissue``).
        dtype: of the image batches: ``"float32"``, ``"float64"``, ``"float16"``, ``"bfloat16"``, or the
            stored ``"int16"`` / ``"uint8"`` (batches as stored, unwindowed).
        drop_last: drop each matrix size's last partial batch.
        prefetch_factor: batches each worker reads ahead (``None``: 2, or what ``"auto"`` chooses).
        persistent_workers: keep workers between epochs (``None``: when there are workers).
        multiprocessing_context: ``"fork"``, ``"spawn"`` or ``"forkserver"`` (``None``: torch's default).
        pin_memory: copy to CUDA through pinned buffers (``None``: on CUDA).
        memory_budget: bytes ``"auto"`` may spend (``None``: a quarter of the free memory, at most 4 GB).
        meta: batches as MONAI ``MetaTensor`` with each sample's affine.

    Examples:
        >>> cfg = LoaderConfig(batch_size=16, num_workers="auto", memory_budget="2GB", dtype="bfloat16")
        >>> cfg.memory_budget, cfg.num_workers
        (2000000000, 'auto')
    """

    batch_size: int | None = None
    num_workers: int | str | None = None
    window: str | None = None
    dtype: str = "float32"
    drop_last: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    multiprocessing_context: str | None = None
    pin_memory: bool | None = None
    memory_budget: int | None = field(default=None, metadata=_BYTES)
    meta: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {self.batch_size}")
        workers = self.num_workers
        if isinstance(workers, str) and workers != "auto" or isinstance(workers, int) and workers < 0:
            raise ConfigError(f'num_workers must be a whole number >= 0 or "auto", got {workers!r}')
        if self.window is not None:
            windows.get(self.window)
        if self.dtype not in LOADER_DTYPES:
            raise ConfigError(f"dtype {self.dtype!r}: use one of {', '.join(LOADER_DTYPES)}")
        if self.prefetch_factor is not None and self.prefetch_factor < 1:
            raise ConfigError(f"prefetch_factor must be at least 1, got {self.prefetch_factor}")
        if self.multiprocessing_context not in (None, *_CONTEXTS):
            raise ConfigError(f"multiprocessing_context {self.multiprocessing_context!r}: use one of {', '.join(_CONTEXTS)}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"memory_budget must be positive, got {self.memory_budget}")


class FromConfig(enum.Enum):
    """The default of a keyword that a config can set: :data:`FROM_CONFIG`."""

    FROM_CONFIG = "FROM_CONFIG"

    def __repr__(self) -> str:
        return self.value


#: a keyword not given: the setting comes from the ``config=`` passed beside it, else the tool's default
FROM_CONFIG = FromConfig.FROM_CONFIG
_T = typing.TypeVar("_T")


def choose(given: _T | FromConfig, configured: _T | None, default: _T) -> _T:
    """A setting's value: the keyword ``given`` explicitly, else the config's (where not None), else ``default``.

    Examples:
        >>> choose(FROM_CONFIG, LoaderConfig(num_workers=4).num_workers, 0), choose(2, 4, 0), choose(FROM_CONFIG, None, 0)
        (4, 2, 0)
    """
    if not isinstance(given, FromConfig):
        return given
    return default if configured is None else configured


@dataclass(frozen=True)
class MedloadConfig:
    """All settings: one section per stage."""

    ingest: IngestConfig = field(default_factory=IngestConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)

    def __post_init__(self) -> None:
        _check_fields(self)


#: old TOML keys of renamed settings, per section: still read (with a DeprecationWarning) until the next release
RENAMED: dict[str, dict[str, str]] = {"ingest": {"shard_size": "shard_bytes"}, "cache": {"l1": "l1_bytes"}, "loader": {}}
_SECTIONS = {"ingest": IngestConfig, "cache": CacheConfig, "loader": LoaderConfig}


@cache
def _annotated_fields(cls: type) -> dict[str, tuple[Field, object]]:
    """Each field of the dataclass ``cls`` by name, with its annotation resolved to a type."""
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in fields(cls)}


def _check_fields(config: DataclassInstance) -> None:
    """Set each field of the (frozen) ``config`` to its value converted as its annotation says."""
    for name, (f, hint) in _annotated_fields(type(config)).items():
        value = _convert(getattr(config, name), hint, f.metadata.get("unit"), f"{type(config).__name__}.{name}")
        object.__setattr__(config, name, value)


def _convert(value, hint, unit: str | None, name: str):
    """``value`` as the type ``hint`` names (``unit``: the field's, for byte sizes), or a ConfigError naming
    the setting ``name``. Only lossless conversions: 60 to 60.0, "2GB" to bytes, a list or one name to a tuple."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) > 1:  # the first type that takes the value (num_workers: a count, or "auto")
            for option in options:
                with contextlib.suppress(ConfigError):
                    return _convert(value, option, unit, name)
            raise ConfigError(f"{name} = {value!r} is not of type {' or '.join(o.__name__ for o in options)}")
        (hint,) = options
    if hint is bool:
        if isinstance(value, bool):
            return value
        problem = "not a boolean: write true or false, without quotes"
    elif hint is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        if unit and isinstance(value, str):
            with contextlib.suppress(ConfigError):
                return parse_size(value)
        problem = (f'not a size: write a whole number of {unit} or a size such as "4GB"' if unit else
                   "not an integer: write a whole number, without quotes")
    elif hint is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        problem = "not a number: write it without quotes"
    elif hint is str:
        if isinstance(value, str):
            return value
        problem = "not a string: write it in quotes"
    elif hint is Path:
        if isinstance(value, (str, os.PathLike)):
            return Path(value)
        problem = "not a path: write it as a string"
    elif hint == tuple[str, ...]:
        if isinstance(value, str):  # one name (or a comma list, as on the command line), not its letters
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        problem = 'not a list of names: write e.g. ["lung", "bone"], or one name'
    elif isinstance(hint, type) and isinstance(value, hint):
        return value
    else:
        problem = f"not of type {getattr(hint, '__name__', hint)}"
    raise ConfigError(f"{name} = {value!r} is {problem}")


def _section(table, section: str, where: str):
    """The config of ``section`` (its class in ``_SECTIONS``) from its TOML table; errors name ``where``."""
    cls, renamed = _SECTIONS[section], RENAMED[section]
    known = _annotated_fields(cls)
    try:
        if not isinstance(table, dict):
            raise ConfigError(f"{section} = {table!r} is not a table: write [{section}] and its keys below it")
        unknown = sorted(key for key in table if renamed.get(key, key) not in known)
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}")
        values: dict[str, object] = {}
        key: str  # TOML keys are strings
        for key, value in table.items():
            name = renamed.get(key, key)
            if name != key:
                if name in table:
                    raise ConfigError(f"{key} and {name} are one setting: keep {name} only")
                warnings.warn(f"{where}: {key} is now called {name}; the old name stops working in the next release",
                              DeprecationWarning, stacklevel=3)
            f, hint = known[name]
            values[name] = _convert(value, hint, f.metadata.get("unit"), key)
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_config(path: str | os.PathLike | None = None) -> MedloadConfig:
    """Settings from a TOML file (sections ``[ingest]``, ``[cache]`` and ``[loader]``); defaults without a file.

    Keys are the field names of :class:`IngestConfig`, :class:`CacheConfig` and :class:`LoaderConfig`; the old names in
    :data:`RENAMED` still work, with a DeprecationWarning, until the next release.
    """
    if path is None:
        return MedloadConfig()
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    unknown = sorted(set(doc) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}; use [ingest], [cache] and [loader]")
    sections = {}
    for name in _SECTIONS:  # a loop, not a comprehension: the stack level of the rename warning is _section's caller's
        sections[name] = _section(doc.get(name, {}), name, f"{path} [{name}]")
    return MedloadConfig(**sections)


def with_overrides(config, **flags):
    """``config`` with the flags that were given (not None) replacing its fields of the same names."""
    unknown = sorted(set(flags) - {f.name for f in fields(config)})
    if unknown:
        raise ConfigError(f"{type(config).__name__} has no setting(s) {', '.join(unknown)}")
    return replace(config, **{k: v for k, v in flags.items() if v is not None})
