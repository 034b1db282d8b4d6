"""``store.json``: the versioned manifest of a store (DESIGN.md §3).

A store is a directory::

    store.json          this manifest: format version, codec, windows, published shards
    shards/<name>.lmdb  published (immutable) LMDB environments
    staging/<name>.lmdb shards being written; never read; adopted by the next writer after a crash
    writer.lock         flock held by the one writer

Readers trust only the shards this manifest lists. It is replaced atomically (temporary file, fsync,
rename, fsync of the directory), so a crash leaves either the old or the new manifest.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import xxhash

from medload.errors import StoreFormatError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "READABLE_VERSIONS", "Manifest", "ShardEntry", "read_manifest", "write_manifest",
           "manifest_path", "shard_path", "staging_path", "write_file_atomic", "fsync_dir", "file_digest"]

FORMAT_NAME = "medload-store"
#: 2 added each shard's ``replaced`` sub-database (``ingest --force``, see :mod:`medload.storage.live`).
#: A version-1 store is a version-2 store without markers: it is read as is, and its manifest says 2 once
#: a writer of this version rewrites it (a version-1 reader would ignore markers, so it must refuse).
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class ShardEntry:
    """One published shard: its directory name under ``shards/``, what it holds, and the xxh3-128 of
    its ``data.mdb`` (published shards never change, so a copy can be checked against it)."""

    name: str
    series: int
    bytes: int
    digest: str


@dataclass
class Manifest:
    """Contents of ``store.json``."""

    codec: str
    windows: tuple[str, ...]
    key_fingerprint: str
    created_by: str
    shards: list[ShardEntry] = field(default_factory=list)
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        doc = {"format": FORMAT_NAME, **asdict(self)}
        doc["windows"] = list(self.windows)
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StoreFormatError(f"{where} is not valid JSON ({exc}): the store manifest is damaged") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise StoreFormatError(f"{where} is not a medload store manifest")
        if doc.get("version") not in READABLE_VERSIONS:
            raise StoreFormatError(
                f"{where} has store format version {doc.get('version')}; this medload reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}: use the medload release that wrote it, or re-ingest"
            )
        try:
            return cls(
                codec=doc["codec"],
                windows=tuple(doc["windows"]),
                key_fingerprint=doc["key_fingerprint"],
                created_by=doc["created_by"],
                shards=[ShardEntry(**s) for s in doc["shards"]],
                version=doc["version"],
            )
        except (KeyError, TypeError) as exc:
            raise StoreFormatError(f"{where} lacks or mangles field {exc}: the store manifest is damaged") from None


def file_digest(path: Path, chunk: int = 8 << 20) -> str:
    """Hex xxh3-128 of a file's bytes, read in chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def manifest_path(root: Path) -> Path:
    return root / "store.json"


def shard_path(root: Path, name: str) -> Path:
    return root / "shards" / f"{name}.lmdb"


def staging_path(root: Path, name: str) -> Path:
    return root / "staging" / f"{name}.lmdb"


def read_manifest(root: Path) -> Manifest:
    """Read and check ``store.json`` of the store at ``root``."""
    path = manifest_path(root)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise StoreFormatError(f"{root} is not a medload store (no store.json): create it with `medload ingest`") from None
    return Manifest.from_json(text, path)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably; the file is owner-only (0600)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
            out.write(data)  # all of it, or an error (a bare os.write stops short on a full disk)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(root: Path, manifest: Manifest) -> None:
    """Atomically replace ``store.json``, in this medload's format version."""
    manifest.version = FORMAT_VERSION
    write_file_atomic(manifest_path(root), manifest.to_json().encode())
