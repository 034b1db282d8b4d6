"""``store.json``: the versioned manifest of a store.

A store is a directory::

    store.json          this manifest: format version, codec, windows, published shards and the keys they hold
    store.json.bak      a copy of it, written after it: what `medload repair` restores a damaged manifest from
    shards/<name>.lmdb  published (immutable) LMDB environments
    staging/<name>.lmdb shards being written; never read; adopted by the next writer after a crash
    writer.lock         flock held by the one writer

Readers trust only the shards this manifest lists. It is replaced atomically (temporary file, fsync,
rename, fsync of the directory), so a crash leaves either the old or the new manifest. ``share`` says who
may read the store (see :mod:`medload.storage.sharing`); every file written here gets its modes.

Version 3 lists, per shard, the keys of the series, labels and replacement markers it holds
(:class:`ShardKeys`), so that a shard that cannot be read still says which series it held: a reader
shows them unavailable, and ``medload repair`` ingests them again. A version-2 manifest is read as is
(its shards' keys are unknown); the next writer lists the keys of every shard it can read and writes
version 3.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from medload.errors import (
    ManifestDamagedError,
    MedloadError,
    StoreError,
    StoreFormatError,
    StorePermissionError,
    StoreTooNewError,
)
from medload.storage.sharing import PRIVATE, Sharing, check_setting, reconciled_setting, share_command, sharing_of

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "READABLE_VERSIONS", "Manifest", "ShardEntry", "ShardKeys", "read_manifest",
           "write_manifest", "restore_manifest", "manifest_path", "backup_path", "shard_path", "staging_path",
           "retired_path", "write_file_atomic", "fsync_dir", "file_digest", "replaced", "recorded_key_fingerprint"]

FORMAT_NAME = "medload-store"
#: 2 added each shard's ``replaced`` sub-database (``ingest --force``, see :mod:`medload.storage.live`).
#: A version-1 store is a version-2 store without markers: it is read as is, and its manifest says 2 once
#: a writer of this version rewrites it (a version-1 reader would ignore markers, so it must refuse).
#: 3 added each shard's :class:`ShardKeys`; the shards themselves are as in version 2.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


@dataclass(frozen=True)
class ShardKeys:
    """The hex keys a shard holds records of: series, label records, and replacement markers (see
    :mod:`medload.storage.live`), each sorted."""

    series: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardEntry:
    """One published shard: its directory name under ``shards/``, what it holds, and the xxh3-128 of
    its ``data.mdb`` (published shards never change, so a copy can be checked against it). ``keys``
    is None where the manifest does not know them (a shard listed by format 2 and not read since)."""

    name: str
    series: int
    bytes: int
    digest: str
    keys: ShardKeys | None = None

    @classmethod
    def from_dict(cls, doc: dict) -> ShardEntry:
        keys = doc.get("keys")
        if keys is not None:
            keys = ShardKeys(**{field_name: tuple(v) for field_name, v in keys.items()})
        return cls(**{**doc, "keys": keys})


@dataclass
class Manifest:
    """Contents of ``store.json``."""

    codec: str
    windows: tuple[str, ...]
    key_fingerprint: str
    created_by: str
    shards: list[ShardEntry] = field(default_factory=list)
    version: int = FORMAT_VERSION
    #: who may read the store (:mod:`medload.storage.sharing`); None: not recorded (an earlier medload)
    share: str | None = None

    def to_json(self) -> str:
        # built by hand, not by dataclasses.asdict (which deep-copies every key: 60% of the CPU of a rewrite,
        # which every publish does with every shard's keys)
        doc = {"format": FORMAT_NAME, **vars(self), "windows": list(self.windows),
               "shards": [{**vars(s), "keys": None if s.keys is None else vars(s.keys)} for s in self.shards]}
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestDamagedError(f"{where} is not valid JSON ({exc}): the store manifest is damaged") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise StoreFormatError(f"{where} is not a medload store manifest")
        version = doc.get("version")
        if type(version) is int and version > max(READABLE_VERSIONS):
            raise StoreTooNewError(f"{where} was written by a newer medload (store format version {version}, this "
                                   f"medload reads up to version {max(READABLE_VERSIONS)}): upgrade medload to use it")
        if version not in READABLE_VERSIONS:
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
                shards=[ShardEntry.from_dict(s) for s in doc["shards"]],
                version=doc["version"],
                share=None if doc.get("share") is None else check_setting(doc["share"]),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ManifestDamagedError(f"{where} lacks or mangles field {exc}: the store manifest is damaged") from None
        except MedloadError as exc:
            raise ManifestDamagedError(f"{where}: {exc}: the store manifest is damaged") from None


def file_digest(path: Path, chunk: int = 8 << 20) -> str:
    """Hex xxh3-128 of a file's bytes, read in chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def manifest_path(root: Path) -> Path:
    return root / "store.json"


def backup_path(root: Path) -> Path:
    """The copy of ``store.json`` that every manifest write leaves next to it."""
    return root / "store.json.bak"


#: what a store folder holds (docs/architecture.md, store layout): a folder holding only these -- a first
#: ingest killed before it wrote ``store.json`` leaves some of them -- may become a store
STORE_LAYOUT = frozenset({"store.json", "store.json.bak", "writer.lock", "shards", "staging", "retired",
                          "compact.json"})


def check_store_folder(root: Path) -> None:
    """Refuse to make a store of ``root`` when it is a file, or a folder that holds anything but a store's
    own files (a store is created in a new or empty folder only: never among someone's DICOM)."""
    if root.exists() and not root.is_dir():
        raise StoreError(f"{root} is a file, not a folder: give a new (or empty) folder for the store")
    if not root.is_dir() or manifest_path(root).exists() or backup_path(root).exists():
        return
    foreign = sorted(p.name for p in root.iterdir() if p.name not in STORE_LAYOUT)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise StoreError(f"{root} is not a medload store and is not empty (it holds {shown}): a store is created "
                         "in a new or empty folder only; give another path (for ingest, the store is the last "
                         "argument: medload ingest SOURCES... STORE)")


def shard_path(root: Path, name: str) -> Path:
    return root / "shards" / f"{name}.lmdb"


def staging_path(root: Path, name: str) -> Path:
    return root / "staging" / f"{name}.lmdb"


def retired_path(root: Path, name: str) -> Path:
    """Where ``medload repair`` moves a shard that cannot be read, once its series are stored again."""
    return root / "retired" / f"{name}.lmdb"


def read_manifest(root: Path) -> Manifest:
    """Read and check ``store.json`` of the store at ``root``."""
    path = manifest_path(root)
    restore = f"restore it from its copy with `medload repair {root}`"
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        if backup_path(root).is_file():
            raise ManifestDamagedError(f"{path} is missing: {restore}") from None
        raise StoreFormatError(f"{root} is not a medload store (no store.json): create it with `medload ingest`") from None
    except PermissionError:
        raise StorePermissionError(f"cannot read {path}: permission denied: the store is not shared with you; ask "
                                   f"its owner to run {share_command(root)} with a group you are in") from None
    try:
        return Manifest.from_json(text, path)
    except ManifestDamagedError as exc:
        if backup_path(root).is_file():
            raise ManifestDamagedError(f"{exc}: {restore}") from None
        raise


def replaced(root: Path, entry: ShardEntry) -> bool:
    """Whether ``store.json`` no longer lists ``entry`` (compact or repair replaced or dropped the shard
    since it was read); a ``store.json`` that cannot be read is not taken for a replacement."""
    try:
        current = read_manifest(root)
    except MedloadError:
        return False
    return not any(s.name == entry.name and s.digest == entry.digest for s in current.shards)


def write_file_atomic(path: Path, data: bytes, sharing: Sharing | None = None) -> None:
    """Replace ``path`` with ``data`` atomically and durably; the file has the modes of ``sharing`` (default:
    owner-only, 0600)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
            (sharing or Sharing(PRIVATE, None)).fix_fd(out.fileno())
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
    """Atomically replace ``store.json``, in this medload's format version and with the modes of its share
    setting (recorded now if it was not: see :func:`~medload.storage.sharing.reconciled_setting`), then its copy."""
    manifest.version = FORMAT_VERSION
    if manifest.share is None:
        manifest.share = reconciled_setting(None, manifest_path(root))
    sharing = sharing_of(root, manifest.share)
    data = manifest.to_json().encode()
    write_file_atomic(manifest_path(root), data, sharing)
    write_file_atomic(backup_path(root), data, sharing)


def restore_manifest(root: Path) -> bool:
    """Replace a ``store.json`` that does not read with its copy, when the copy reads; whether it did.

    The copy may lag by the last shard published (a crash between the two writes): the next writer adds
    a published shard that the manifest misses (see :class:`~medload.storage.writer.StoreWriter`)."""
    try:
        read_manifest(root)
        return False
    except ManifestDamagedError:
        if not backup_path(root).is_file():
            raise
    data = backup_path(root).read_bytes()
    copy = Manifest.from_json(data.decode(errors="replace"), backup_path(root))  # refuses a damaged copy too
    write_file_atomic(manifest_path(root), data, sharing_of(root, reconciled_setting(copy.share, backup_path(root))))
    return True


def recorded_key_fingerprint(root: Path) -> str | None:
    """The fingerprint of the pseudonymisation key the store at ``root`` was built with; None where no store
    is there yet (a folder that cannot become one is refused, see :func:`check_store_folder`)."""
    check_store_folder(root)
    if not manifest_path(root).exists() and not backup_path(root).exists():
        return None
    return read_manifest(root).key_fingerprint
