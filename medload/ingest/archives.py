"""Zip and tar archives listed safely, never extracted to member paths.

This module holds the records discovery yields (:class:`SourceRef`, :class:`DiscoveryProblem`), the caps
on archives (:class:`ArchiveLimits`) and the listing of one archive (:func:`scan_archive`). Zip members
and members of uncompressed tars are yielded as references into the archive and read in place later
(see :mod:`medload.ingest.discover`). Members of compressed tars (gz/bz2/xz) cannot be read at random
cheaply: they are streamed once and copied into a spool folder (files 0600 in a 0700 folder).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import logging
import lzma
import os
import re
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import BinaryIO, cast

from medload.errors import ConfigError
from medload.ingest.sniff import not_dicom, zero_head
from medload.storage.space import disk_full_is_error, out_of_space

__all__ = ["content_kind", "SourceRef", "DiscoveryProblem", "ArchiveLimits", "Spool", "archive_kind", "tar_header",
           "scan_archive", "describe", "is_junk", "HEAD_BYTES", "READ_ERRORS"]

log = logging.getLogger(__name__)

HEAD_BYTES = 512                  # enough to tell DICOM, zip, gzip/bz2/xz and tar apart
_TAR_BLOCK = 512
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_STREAM_MAGICS = ((b"\x1f\x8b", "gz"), (b"BZh", "bz2"), (b"\xfd7zXZ\x00", "xz"))
_JUNK_FILES = frozenset({".ds_store", "thumbs.db"})
_JUNK_DIR = "__macosx"
_RATIO_FLOOR = 1 << 20            # members this small cannot be bombs; the ratio cap applies above it
_ZIP_METHODS = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA})
_CHUNK = 1 << 20
_SEP = re.compile(r"[\\/]")
# gzip/bz2/lzma file objects are all buffered binary streams (BufferedIOBase), not typing.BinaryIO
_DECOMPRESSORS: dict[str, Callable[[BinaryIO], io.BufferedIOBase]] = {
    "gz": lambda raw: gzip.GzipFile(fileobj=raw, mode="rb"), "bz2": bz2.BZ2File, "xz": lzma.LZMAFile}

#: Exceptions that mean "this file or archive cannot be read", as opposed to a bug in medload.
READ_ERRORS = (OSError, EOFError, ValueError, NotImplementedError, tarfile.TarError, zipfile.BadZipFile,
               zlib.error, lzma.LZMAError)


@dataclass(frozen=True, slots=True)
class SourceRef:
    """One candidate DICOM input: a plain file, or a member of a zip/tar archive. Picklable.

    ``origin`` is set for members of compressed tars, which are spooled: ``path`` is then the spooled
    copy, ``member`` is ``None``, and ``origin`` says ``archive!member`` for messages.
    """

    path: str
    member: str | None
    size: int
    origin: str | None = None

    def __reduce__(self) -> tuple[type[SourceRef], tuple[str, str | None, int, str | None]]:
        """Pickled as its four values (every reference goes to a header process and comes back with its
        headers): the pickling dataclasses give a frozen, slotted class looks up its fields for every object."""
        return SourceRef, (self.path, self.member, self.size, self.origin)

    @property
    def display(self) -> str:
        """``path``, ``path!member``, or the origin of a spooled member."""
        if self.origin is not None:
            return self.origin
        return self.path if self.member is None else f"{self.path}!{self.member}"


@dataclass(frozen=True, slots=True)
class DiscoveryProblem:
    """An input discovery cannot hand on; ``skipped`` is True for inputs medload does not handle (a nested
    archive), ``ignored`` for inputs that are not DICOM at all (text, images, NIfTI: see :mod:`.sniff`).
    ``digest`` is False where the input's sha256 is not worth reading it all (a large zero-filled file)."""

    path: str
    member: str | None
    reason: str
    skipped: bool = False
    ignored: bool = False
    digest: bool = True

    @property
    def status(self) -> str:
        """The status of its quarantine record: ``ignored``, ``skipped`` or ``rejected``."""
        return "ignored" if self.ignored else "skipped" if self.skipped else "rejected"

    @property
    def display(self) -> str:
        """``path`` or ``path!member``."""
        return self.path if self.member is None else f"{self.path}!{self.member}"


@dataclass(frozen=True)
class ArchiveLimits:
    """Caps for one archive. Ratio is uncompressed/compressed size, checked on members above 1 MiB."""

    max_members: int = 1_000_000
    max_member_bytes: int = 2 << 30
    max_total_bytes: int = 1 << 40
    max_ratio: float = 200.0

    def __post_init__(self) -> None:
        if min(self.max_members, self.max_member_bytes, self.max_total_bytes, self.max_ratio) <= 0:
            raise ConfigError(f"archive limits must all be positive, got {self}")


class _Rejected(Exception):
    """The archive is rejected as a whole (a cap was reached, the spool failed), for the reason given."""


class Spool:
    """Folder receiving members of compressed tars; created on first use. The caller deletes it."""

    def __init__(self, folder: Path | None) -> None:
        self._folder = folder
        self._ready = False
        self._count = 0

    @property
    def where(self) -> str:
        """The spool folder, or the temporary folder it will be created in."""
        return str(self._folder) if self._folder is not None else tempfile.gettempdir()

    def create(self, member: str) -> tuple[int, str]:
        """A new 0600 file for ``member``: its descriptor and path."""
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="medload-spool-"))
            log.info("spooling members of compressed tar archives to %s (delete it when done)", self._folder)
        elif not self._ready:
            self._folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._ready = True
        self._count += 1
        digest = hashlib.sha1(member.encode("utf-8", "surrogateescape"), usedforsecurity=False).hexdigest()
        return tempfile.mkstemp(prefix=f"{self._count:07d}-{digest[:16]}-", suffix=".dcm", dir=self._folder)


def content_kind(head: bytes) -> str | None:
    """``dicom``, ``zip``, ``gz``/``bz2``/``xz`` (tar candidates), ``tar`` or None, from the first bytes."""
    if head[128:132] == b"DICM":
        return "dicom"
    if head[:4] in _ZIP_MAGICS:
        return "zip"
    for magic, kind in _STREAM_MAGICS:
        if head.startswith(magic):
            return kind
    return "tar" if head[257:262] == b"ustar" else None


def archive_kind(path: str, head: bytes) -> str | None:
    """``zip``, ``tar``, ``gz``, ``bz2`` or ``xz`` if the file at ``path`` starting with ``head`` is an
    archive; None for DICOM (preamble checked first) and anything else."""
    kind = content_kind(head)
    if kind == "dicom":
        return None
    if kind is not None:
        return kind
    if path.lower().endswith(".zip") and zipfile.is_zipfile(path):
        return "zip"                             # zip with data prepended (self-extracting)
    return "tar" if tar_header(head) else None   # pre-POSIX tar without the ustar magic


def tar_header(head: bytes) -> bool:
    """Whether ``head`` starts with a valid tar header block: its checksum field (bytes 148..156, octal) holds
    the sum of the block's bytes with that field taken as spaces, unsigned or signed as :mod:`tarfile` accepts
    (POSIX.1 ustar, and pre-POSIX tars). Never :func:`tarfile.is_tarfile`: it takes a file of zeros for an
    empty tar after reading all of it."""
    if len(head) < _TAR_BLOCK:
        return False
    digits = head[148:156].strip(b"\0 ")
    if not digits or digits.strip(b"01234567"):
        return False
    block = head[:148] + b" " * 8 + head[156:_TAR_BLOCK]
    signed = sum(block) - 256 * sum(1 for byte in block if byte > 127)
    return int(digits, 8) in (sum(block), signed)


def is_junk(name: str) -> bool:
    """macOS/Windows folder litter: ``.DS_Store``, ``Thumbs.db``, anything under ``__MACOSX``."""
    parts = [part.casefold() for part in _SEP.split(name)]
    return parts[-1] in _JUNK_FILES or _JUNK_DIR in parts


def _unsafe_reason(name: str) -> str | None:
    """Why a member name would escape a destination: absolute, drive letter, ``..`` component."""
    if not name or name.startswith(("/", "\\")):
        return f"unsafe member path {name!r}: absolute or empty"
    if re.match(r"[A-Za-z]:", name):
        return f"unsafe member path {name!r}: drive letter"
    if ".." in _SEP.split(name):
        return f"unsafe member path {name!r}: '..' component"
    return None


def _duplicate_reason(name: str, seen: set[str]) -> str | None:
    """A repeated member name: only the first copy is yielded (and read, see :mod:`.discover`)."""
    if name in seen:
        return "duplicate member name (only the first copy is read)"
    seen.add(name)
    return None


def _ratio_reason(size: int, compressed: int, limits: ArchiveLimits) -> str | None:
    """Why ``size`` bytes expanded from ``compressed`` bytes look like a decompression bomb."""
    if size > _RATIO_FLOOR and size > limits.max_ratio * max(compressed, 1):
        cap = f"{limits.max_ratio:.15g}"  # 200, 200.5: as given
        return f"compression ratio {_shown_above(size / max(compressed, 1), float(cap))}:1 above the cap {cap}:1"
    return None


def _shown_above(value: float, cap: float) -> str:
    """``value`` with the fewest decimals that still show it above ``cap`` (200.3, not 200, above a cap of 200)."""
    for decimals in range(17):
        if float(text := f"{value:.{decimals}f}") > cap:
            return text
    return repr(value)


def _size_reason(size: int, compressed: int | None, limits: ArchiveLimits) -> str | None:
    """Why a member of ``size`` bytes (``compressed`` in the archive, None if unknown) is refused."""
    if size > limits.max_member_bytes:
        return f"member size {size} bytes above the cap {limits.max_member_bytes} bytes"
    return None if compressed is None else _ratio_reason(size, compressed, limits)


def _archive_reason(count: int, total: int, limits: ArchiveLimits) -> str | None:
    """Why a whole archive with ``count`` members and ``total`` uncompressed bytes is refused."""
    if count > limits.max_members:
        return f"member count reached {count}, above the cap {limits.max_members}"
    if total > limits.max_total_bytes:
        return f"total uncompressed size reached {total} bytes, above the cap {limits.max_total_bytes} bytes"
    return None


def _member_problem(path: str, name: str, size: int, head: bytes) -> DiscoveryProblem | None:
    """Why member ``name`` (``size`` bytes, starting with ``head``) is not handed on: an archive itself
    (skipped), not DICOM (ignored), or zero bytes where the preamble should be (rejected); None for a candidate."""
    kind = content_kind(head)
    if kind == "dicom":
        return None
    if kind is not None:
        return DiscoveryProblem(path, name, f"nested archive not expanded: {kind} data", skipped=True)
    reason = not_dicom(name, head)
    if reason is not None:
        return DiscoveryProblem(path, name, reason, ignored=True)
    if zero_head(head):
        return DiscoveryProblem(path, name, f"zero-filled: all {size} bytes are zero" if len(head) >= size else
                                f"damaged: the first {len(head)} bytes are zero (no DICOM preamble)")
    return None


def _sniffed(path: str, name: str, size: int, head: bytes) -> SourceRef | DiscoveryProblem:
    """A reference to an archive member, or the problem :func:`_member_problem` finds."""
    return _member_problem(path, name, size, head) or SourceRef(path, name, size)


def describe(exc: BaseException) -> str:
    """One line for an exception, without the file name OSError adds."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def scan_archive(path: str, kind: str, limits: ArchiveLimits, spool: Spool) -> Iterator[SourceRef | DiscoveryProblem]:
    """Members of the archive at ``path`` (``kind`` from :func:`archive_kind`), sorted by name."""
    if kind in _DECOMPRESSORS:
        return _scan_tar_stream(path, kind, limits, spool)
    return _scan_zip(path, limits) if kind == "zip" else _scan_tar(path, limits)


def _zip_reason(info: zipfile.ZipInfo, limits: ArchiveLimits) -> str | None:
    """Why a zip member cannot be read: encrypted, not a regular file, unknown method, caps."""
    file_type = stat.S_IFMT(info.external_attr >> 16)
    if info.flag_bits & 0x1:
        return "encrypted member"
    if file_type == stat.S_IFLNK:
        return "symbolic link member not followed"
    if file_type not in (0, stat.S_IFREG):
        return "special file member (not a regular file)"
    if info.compress_type not in _ZIP_METHODS:
        return f"unsupported zip compression method {info.compress_type}"
    return _size_reason(info.file_size, info.compress_size, limits)


def _scan_zip(path: str, limits: ArchiveLimits) -> Iterator[SourceRef | DiscoveryProblem]:
    try:
        archive = zipfile.ZipFile(path)
    except READ_ERRORS as exc:
        yield DiscoveryProblem(path, None, f"damaged zip archive: {describe(exc)}")
        return
    with archive:
        infos = archive.infolist()
        reason = _archive_reason(len(infos), sum(i.file_size for i in infos if not i.is_dir()), limits)
        if reason:
            yield DiscoveryProblem(path, None, reason)
            return
        seen: set[str] = set()
        for info in sorted(infos, key=attrgetter("filename")):  # stable: duplicates keep archive order
            name = info.filename
            reason = _unsafe_reason(name)
            if reason is None and (info.is_dir() or is_junk(name)):
                log.debug("ignoring %s!%s", path, name)
                continue
            reason = reason or _duplicate_reason(name, seen) or _zip_reason(info, limits)
            if reason is not None:
                yield DiscoveryProblem(path, name, reason)
                continue
            try:
                with archive.open(info) as member:
                    head = member.read(HEAD_BYTES)
            except READ_ERRORS as exc:
                yield DiscoveryProblem(path, name, f"unreadable member: {describe(exc)}")
            else:
                yield _sniffed(path, name, info.file_size, head)


_IGNORE = "ignore"


def _tar_member_verdict(path: str, member: tarfile.TarInfo, seen: set[str], limits: ArchiveLimits) -> str | None:
    """``None``: read the member; ``_IGNORE``: skip it silently (a folder entry, OS junk); else why it is refused."""
    reason = _unsafe_reason(member.name)
    if reason is None and (member.isdir() or is_junk(member.name)):
        log.debug("ignoring %s!%s", path, member.name)
        return _IGNORE
    return (reason or _duplicate_reason(member.name, seen) or _tar_reason(member)
            or _size_reason(member.size, None, limits))


def _tar_reason(member: tarfile.TarInfo) -> str | None:
    """Why a tar member is not a plain regular file we read."""
    if member.issym():
        return "symbolic link member not followed"
    if member.islnk():
        return "hard link member not followed"
    if member.ischr() or member.isblk() or member.isfifo():
        return "device or fifo member not read"
    if member.issparse():
        return "sparse member not supported"
    return None if member.isreg() else f"unsupported tar member type {member.type!r}"


def _scan_tar(path: str, limits: ArchiveLimits) -> Iterator[SourceRef | DiscoveryProblem]:
    members: list[tarfile.TarInfo] = []
    damage = None
    try:
        with open(path, "rb") as raw:
            file_size = os.fstat(raw.fileno()).st_size
            try:
                with tarfile.open(fileobj=raw, mode="r:") as archive:
                    for member in archive:
                        members.append(member)
                        if len(members) > limits.max_members:
                            break
            except READ_ERRORS as exc:
                damage = DiscoveryProblem(path, None, f"damaged tar archive: {describe(exc)}")
            reason = _archive_reason(len(members), sum(m.size for m in members if m.isreg()), limits)
            if reason:
                yield DiscoveryProblem(path, None, reason)
                return
            seen: set[str] = set()
            for member in sorted(members, key=attrgetter("name")):
                reason = _tar_member_verdict(path, member, seen, limits)
                if reason is _IGNORE:
                    continue
                if reason is None and member.offset_data + member.size > file_size:
                    reason = "member data truncated (archive cut short)"
                if reason is None:
                    head = os.pread(raw.fileno(), HEAD_BYTES, member.offset_data)
                    yield _sniffed(path, member.name, member.size, head)
                else:
                    yield DiscoveryProblem(path, member.name, reason)
    except OSError as exc:
        damage = DiscoveryProblem(path, None, f"unreadable tar archive: {describe(exc)}")
    if damage is not None:
        yield damage


def _scan_tar_stream(path: str, compression: str, limits: ArchiveLimits,
                     spool: Spool) -> Iterator[SourceRef | DiscoveryProblem]:
    """Stream a compressed tar once, spooling its members. The stream is read to its end so that its
    checksum is verified; damage anywhere, or a whole-archive cap, rejects the archive as a whole."""
    found: list[tuple[str, SourceRef | DiscoveryProblem]] = []
    try:
        with open(path, "rb") as raw, _DECOMPRESSORS[compression](raw) as stream:
            if content_kind(stream.read(HEAD_BYTES)) != "tar":  # decompresses, but no (POSIX) tar header
                yield DiscoveryProblem(path, None, f"{compression} data that is not a tar archive", skipped=True)
                return
            stream.seek(0)
            archive = tarfile.open(fileobj=stream, mode="r|")
            seen: set[str] = set()
            count = total = 0
            check_ratio = partial(_check_ratio, stream, raw, limits)
            with archive:
                for member in archive:
                    count += 1
                    total += member.size if member.isreg() else 0
                    reason = _archive_reason(count, total, limits)
                    if reason:
                        raise _Rejected(reason)
                    reason = _tar_member_verdict(path, member, seen, limits)
                    if reason is _IGNORE:
                        continue
                    if reason is None:
                        found.append((member.name, _spool_member(path, archive, member, spool, check_ratio)))
                    else:
                        found.append((member.name, DiscoveryProblem(path, member.name, reason)))
            while stream.read(_CHUNK):
                check_ratio()
    except (_Rejected, *READ_ERRORS) as exc:
        for _, item in found:
            if isinstance(item, SourceRef):
                Path(item.path).unlink(missing_ok=True)
        reason = str(exc) if isinstance(exc, _Rejected) else f"damaged tar.{compression} archive: {describe(exc)}"
        yield DiscoveryProblem(path, None, reason)
        return
    found.sort(key=lambda pair: pair[0])  # stable: duplicates keep archive order
    yield from (item for _, item in found)


def _check_ratio(stream: io.BufferedIOBase, raw: BinaryIO, limits: ArchiveLimits) -> None:
    """Stop a stream that has expanded more than the ratio cap allows."""
    reason = _ratio_reason(stream.tell(), raw.tell(), limits)
    if reason:
        raise _Rejected(reason)


def _spool_member(path: str, archive: tarfile.TarFile, member: tarfile.TarInfo, spool: Spool,
                  check_ratio: Callable[[], None]) -> SourceRef | DiscoveryProblem:
    """Copy the current member of a streamed tar into the spool (unless it is an archive itself)."""
    data = cast(BinaryIO, archive.extractfile(member))
    chunk = data.read(HEAD_BYTES)
    problem = _member_problem(path, member.name, member.size, chunk)
    if problem is not None:
        while data.read(_CHUNK):  # the stream reads through it anyway: a bomb is stopped here too
            check_ratio()
        return problem
    full_disk = partial(disk_full_is_error, spool.where, "spool", f"spooling {path}!{member.name}")
    try:
        with full_disk():
            fd, spooled = spool.create(member.name)
    except OSError as exc:
        raise _Rejected(f"cannot create a spool file: {describe(exc)}") from exc
    size = 0
    try:
        with full_disk(), open(fd, "wb") as out:  # closing flushes too: a full disk can show there
            while chunk:
                _spool_write(out, chunk, spool.where)
                size += len(chunk)
                check_ratio()
                chunk = data.read(_CHUNK)
    except BaseException:
        os.unlink(spooled)
        raise
    return SourceRef(spooled, None, size, origin=f"{path}!{member.name}")


def _spool_write(out: BinaryIO, chunk: bytes, where: str) -> None:
    """Write to a spool file in ``where``. A full disk is raised as is, to stop the run (see the caller): it is
    not the archive's fault, and every later member would fail the same way; any other failure rejects the archive."""
    try:
        out.write(chunk)
        out.flush()
    except OSError as exc:
        if out_of_space(exc, where):
            raise
        raise _Rejected(f"cannot write a spool file: {describe(exc)}") from exc
