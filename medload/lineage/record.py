"""A lineage record: which data, taken how, a training run could draw -- as versioned JSON.

The record names the store (its format, codec, windows and the fingerprint of its pseudonymisation key,
never its path), each series the dataset can draw by its series key (a keyed hash, see
:mod:`medload.storage.keys`) and the content digest of its voxels (:mod:`medload.storage.digest`), with
the digest of its label map where the run uses labels, the inputs that decide the samples (dataset and
filters, split, seeds, loader and augmentation settings), the software versions and when it was made.
Raw identifiers never enter it: the store holds none to copy (UIDs, patient IDs and source paths are
kept only as keyed pseudonyms or hashes).

Its identity is :attr:`LineageRecord.digest`, the SHA-256 of its canonical JSON (keys sorted, no spaces,
ASCII): :func:`save` writes it beside the fields, :func:`load` refuses a file whose fields no longer hash
to it. ``medload push-seg --lineage`` puts it into a SEG, ``medload lineage check`` compares a store with
the record (:mod:`medload.lineage.check`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from medload.errors import ConfigError
from medload.storage.manifest import FORMAT_NAME, write_file_atomic
from medload.storage.records import SeriesRecord
from medload.storage.store import Store

__all__ = ["FORMAT", "VERSION", "LineageError", "LineageSeries", "LineageRecord", "make_record", "store_identity",
           "save", "load"]

FORMAT = "medload-lineage"
#: 1: the first format
VERSION = 1
_SOFTWARE = ("medload", "torch", "monai", "numpy")


class LineageError(ConfigError):
    """A file that is not a lineage record this medload reads, or one edited after it was written."""


@dataclass(frozen=True)
class LineageSeries:
    """One series a run could draw: its key, the digest of its voxels, the digest of its label map (None
    where the run does not use labels, or the series has none)."""

    key: str
    digest: str
    label: str | None = None


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _plain(doc: Any) -> Any:
    """``doc`` as JSON gives it back (tuples as lists, keys as text), so a record and its loaded copy hash alike."""
    try:
        return json.loads(_canonical(doc))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"lineage inputs must be JSON values (numbers, text, lists, mappings): {exc}") from None


@dataclass(frozen=True)
class LineageRecord:
    """A lineage record (see the module docs); :attr:`digest` is its identity.

    Examples:
        >>> record = SliceDataset(store, context=1).lineage()
        >>> [s.key for s in record.series] == [r.key for r in store.series()]
        True
        >>> len(record.digest)          # hex SHA-256 of the canonical JSON
        64
    """

    store: dict[str, Any]
    series: tuple[LineageSeries, ...]
    inputs: dict[str, Any] = field(default_factory=dict)
    software: dict[str, str | None] = field(default_factory=dict)
    created: str = ""
    version: int = VERSION

    def to_dict(self) -> dict[str, Any]:
        """The record's fields as JSON values, without its digest."""
        return {"format": FORMAT, "version": self.version, "created": self.created, "store": self.store,
                "series": [[s.key, s.digest, s.label] for s in self.series], "inputs": self.inputs,
                "software": self.software}

    @property
    def digest(self) -> str:
        """Hex SHA-256 of :meth:`to_dict` as canonical JSON: the record's identity."""
        return hashlib.sha256(_canonical(self.to_dict())).hexdigest()

    def with_inputs(self, **inputs: Any) -> LineageRecord:
        """A copy with ``inputs`` added to (or replacing parts of) :attr:`inputs`."""
        return LineageRecord(self.store, self.series, {**self.inputs, **_plain(inputs)}, self.software, self.created,
                             self.version)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], where: str = "the record") -> LineageRecord:
        if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
            raise LineageError(f"{where} is not a medload lineage record (no \"format\": \"{FORMAT}\")")
        version = doc.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise LineageError(f"{where} has lineage format version {version!r}; this medload reads up to {VERSION}: "
                               "upgrade medload to read it")
        try:
            series = tuple(LineageSeries(str(k), str(d), None if lab is None else str(lab)) for k, d, lab in doc["series"])
            return cls(dict(doc["store"]), series, dict(doc["inputs"]), dict(doc["software"]), str(doc["created"]),
                       version)
        except (KeyError, TypeError, ValueError) as exc:
            raise LineageError(f"{where} lacks or mangles field {exc}: write it again with medload") from None


def store_identity(store: Store) -> dict[str, Any]:
    """The store's format and settings, the fingerprint of its pseudonymisation key, its series count and a
    content fingerprint (SHA-256 over every readable series' key and digest, in key order) -- never its path."""
    content = hashlib.sha256()
    records = sorted(store.series(), key=lambda r: r.key)
    for rec in records:
        content.update(f"{rec.key}:{rec.digest};".encode())
    m = store.manifest
    return {"format": FORMAT_NAME, "format_version": m.version, "codec": m.codec, "windows": list(m.windows),
            "key_fingerprint": m.key_fingerprint, "series": len(records), "content": content.hexdigest()}


def _software() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in _SOFTWARE:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def make_record(store: Store, records: Iterable[SeriesRecord], *, labels: bool, timed: bool = True,
                **inputs: Any) -> LineageRecord:
    """The lineage record of a run drawing from ``records`` of ``store`` (each once, in key order); with
    ``labels``, the digest of each series' label map (None for one without). ``inputs``: what decides the
    samples, as JSON values (``dataset=``, ``loader=``, ``split=``...). ``timed=False`` leaves ``created``
    empty, so the same data and inputs give the same record, byte for byte (an export's)."""
    series = []
    for rec in sorted({r.key: r for r in records}.values(), key=lambda r: r.key):
        label = store.labels(rec.key) if labels else None
        series.append(LineageSeries(rec.key, rec.digest, None if label is None else label.digest))
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) if timed else ""
    return LineageRecord(store_identity(store), tuple(series), _plain(inputs), _software(), created)


def save(record: LineageRecord, path: str | os.PathLike) -> Path:
    """Write ``record`` to ``path`` as JSON with its digest, atomically (a crash leaves the old file or the
    new one, never half of it); returns the path.

    Examples:
        >>> record = SliceDataset(store).lineage()
        >>> path = save(record, "lineage.json")
        >>> load(path).digest == record.digest
        True
    """
    if not isinstance(record, LineageRecord):
        raise ConfigError(f"save() writes a LineageRecord (dataset.lineage(), loader.lineage()), got "
                          f"{type(record).__name__}")
    path = Path(path)
    doc = {**record.to_dict(), "digest": record.digest}
    write_file_atomic(path, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
    return path


def load(path: str | os.PathLike) -> LineageRecord:
    """The record :func:`save` wrote at ``path``; LineageError where it is not one, or no longer hashes to the
    digest written with it (it was edited)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise LineageError(f"{path}: no such lineage record") from None
    except ValueError as exc:
        raise LineageError(f"{path} is not JSON ({exc}): not a lineage record medload wrote") from None
    record = LineageRecord.from_dict(doc, str(path))
    if doc.get("digest") != record.digest:
        raise LineageError(f"{path}: its fields hash to {record.digest[:12]}, not to the digest "
                           f"{str(doc.get('digest'))[:12]} written with it: it was edited after medload wrote it")
    return record
