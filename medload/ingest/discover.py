"""Discovery of DICOM inputs in files, folders and zip/tar archives, and reading them.

:func:`discover` walks its sources in a deterministic order and yields a :class:`SourceRef` for each
candidate DICOM input and a :class:`DiscoveryProblem` for each input it will not hand on (never raising
for a bad input). :func:`read_source` and :func:`open_source` read a reference in any process: archive
members are read in place through handles cached per process (keyed by path and pid, so fork-safe).

Policies: hidden files are inputs, except ``.DS_Store``, ``Thumbs.db`` and ``__MACOSX`` (ignored);
a symbolic link to a file inside the source root is followed (as the resolved file); links to folders,
outside the root, or dangling are problems; each real file is yielded once; archives found in folders are
expanded, archives inside archives are not; an archive without files is reported. Files plainly not
DICOM (text, images, NIfTI...: :mod:`.sniff`) are problems marked ``ignored``; a file whose first block
is zero bytes is a problem, told without reading it all. Messages carry no paths: the caller pairs them
with the ref.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
import tarfile
import threading
import weakref
import zipfile
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

from medload.errors import InputProblem
from medload.ingest.archives import (
    HEAD_BYTES,
    READ_ERRORS,
    ArchiveLimits,
    DiscoveryProblem,
    SourceRef,
    Spool,
    archive_kind,
    content_kind,
    describe,
    is_junk,
    scan_archive,
)
from medload.ingest.sniff import ZERO_WINDOW, not_dicom, zero_head, zeroed_reason

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer  # stub-only: what RawIOBase.readinto is given

__all__ = ["SourceRef", "DiscoveryProblem", "ArchiveLimits", "discover", "sniff_plain", "expand_archive",
           "read_source", "open_source", "problem_sha256"]

log = logging.getLogger(__name__)

_MAX_HANDLES = 32

_Found = SourceRef | DiscoveryProblem


def discover(sources: str | os.PathLike | Sequence[str | os.PathLike], *, limits: ArchiveLimits = ArchiveLimits(),
             spool_dir: Path | None = None, sniff: bool = True) -> Iterator[SourceRef | DiscoveryProblem]:
    """Every candidate DICOM input under ``sources`` (files, folders, zip and tar archives), in order.

    Folders are walked recursively in name order, archive members come in name order. Members of
    compressed tars are copied into ``spool_dir`` (created 0700 if missing; a private temporary folder
    when None, logged at INFO) and yielded with ``origin`` set: the spooled files stay there until the
    caller deletes the folder.

    ``sniff=False`` reads no file: every regular, non-empty file found is yielded as a candidate, and
    whoever reads it decides with :func:`sniff_plain` whether it is DICOM, not DICOM, or an archive to
    expand (:func:`expand_archive`). The header pass does, in parallel: from a cold disk the first block
    of each file is a random read, about ten times the rest of discovering the file (docs/benchmarks.md).
    """
    walker = _Walker(limits, Spool(spool_dir), sniff)
    for source in [sources] if isinstance(sources, (str, os.PathLike)) else sources:
        yield from walker.source(os.path.abspath(os.fspath(source)))


def sniff_plain(path: str, size: int) -> SourceRef | DiscoveryProblem | str:
    """What the regular file at ``path`` (``size`` bytes, not empty) is, from its first block: a DICOM
    candidate, a problem, or the kind of archive it is (see :func:`expand_archive`)."""
    try:  # a descriptor, not a buffered file object: a third of discovery's CPU per file went to building one
        fd = os.open(path, os.O_RDONLY)
        try:
            return _plain(path, fd, size, os.pread(fd, HEAD_BYTES, 0))
        finally:
            os.close(fd)
    except OSError as exc:
        return DiscoveryProblem(path, None, f"cannot read: {describe(exc)}")


def expand_archive(path: str, kind: str, *, limits: ArchiveLimits = ArchiveLimits(),
                   spool_dir: Path | None = None) -> Iterator[SourceRef | DiscoveryProblem]:
    """The members of the archive at ``path`` that :func:`sniff_plain` found to be of ``kind``, as
    :func:`discover` yields them (compressed tars spooled into ``spool_dir``)."""
    return _members(path, kind, limits, Spool(spool_dir))


def _members(path: str, kind: str, limits: ArchiveLimits, spool: Spool) -> Iterator[SourceRef | DiscoveryProblem]:
    empty = True
    for item in scan_archive(path, kind, limits, spool):
        empty = False
        yield item
    if empty:  # nothing but folders and OS litter: no file to report otherwise
        yield DiscoveryProblem(path, None, f"{kind} archive without files", ignored=True)


class _Walker:
    """State of one :func:`discover` call: limits, spool, real files already yielded."""

    def __init__(self, limits: ArchiveLimits, spool: Spool, sniff: bool) -> None:
        self._limits = limits
        self._spool = spool
        self._sniff = sniff
        self._seen: set[tuple[int, int]] = set()

    def source(self, path: str) -> Iterator[_Found]:
        """One source named by the caller: a file or a folder (followed even if it is a link)."""
        try:
            info = os.stat(path)
        except OSError as exc:
            yield DiscoveryProblem(path, None, f"cannot open source: {describe(exc)}")
            return
        if stat.S_ISDIR(info.st_mode):
            yield from self._folder(path)
        else:
            yield from self._file(path, info)

    def _folder(self, root: str) -> Iterator[_Found]:
        """Depth-first walk, entries in name order; links to folders are never followed, so no cycles."""
        real_root = os.path.realpath(root)
        visited: set[tuple[int, int]] = set()
        stack: list[Iterator[str]] = []
        yield from self._enter(root, stack, visited)
        while stack:
            path = next(stack[-1], None)
            if path is None:
                stack.pop()
                continue
            if is_junk(os.path.basename(path)):
                log.debug("ignoring %s", path)
                continue
            try:
                info = os.lstat(path)
            except OSError as exc:
                yield DiscoveryProblem(path, None, f"cannot read: {describe(exc)}")
                continue
            if stat.S_ISLNK(info.st_mode):
                yield from self._link(path, real_root)
            elif stat.S_ISDIR(info.st_mode):
                yield from self._enter(path, stack, visited)
            else:
                yield from self._file(path, info)

    def _enter(self, folder: str, stack: list[Iterator[str]], visited: set[tuple[int, int]]) -> Iterator[_Found]:
        """Push the sorted entries of ``folder`` on ``stack``, unless it was visited already."""
        try:
            info = os.stat(folder)
            with os.scandir(folder) as entries:
                names = sorted(entry.name for entry in entries)
        except OSError as exc:
            yield DiscoveryProblem(folder, None, f"cannot list folder: {describe(exc)}")
            return
        if (info.st_dev, info.st_ino) in visited:
            yield DiscoveryProblem(folder, None, "folder already visited (filesystem cycle)")
            return
        visited.add((info.st_dev, info.st_ino))
        stack.append(iter([os.path.join(folder, name) for name in names]))

    def _link(self, path: str, real_root: str) -> Iterator[_Found]:
        """Follow a symbolic link to a file inside the source root; report any other link."""
        target = os.path.realpath(path)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            yield DiscoveryProblem(path, None, "dangling symbolic link")
            return
        except OSError as exc:
            yield DiscoveryProblem(path, None, f"unresolvable symbolic link: {describe(exc)}")
            return
        if stat.S_ISDIR(info.st_mode):
            yield DiscoveryProblem(path, None, "symbolic link to a folder not followed")
        elif os.path.commonpath([real_root, target]) != real_root:
            yield DiscoveryProblem(path, None, "symbolic link points outside the source root")
        else:
            yield from self._file(target, info)

    def _file(self, path: str, info: os.stat_result) -> Iterator[_Found]:
        """A regular file: a DICOM candidate, an archive to list, or a problem."""
        if not stat.S_ISREG(info.st_mode):
            yield DiscoveryProblem(path, None, "not a regular file")
            return
        if (info.st_dev, info.st_ino) in self._seen:
            log.debug("%s: same file as one already found", path)
            return
        self._seen.add((info.st_dev, info.st_ino))
        if info.st_size == 0:
            yield DiscoveryProblem(path, None, "empty file")
            return
        found = sniff_plain(path, info.st_size) if self._sniff else SourceRef(path, None, info.st_size)
        if isinstance(found, str):
            yield from _members(path, found, self._limits, self._spool)
        else:
            yield found


def _plain(path: str, fd: int, size: int, head: bytes) -> SourceRef | DiscoveryProblem | str:
    """What the file at ``path`` starting with ``head`` is: DICOM (a candidate, as is anything else not
    told apart here), not DICOM (ignored), zero where its header should be (rejected), or an archive (its kind)."""
    if content_kind(head) == "dicom":
        return SourceRef(path, None, size)
    reason = not_dicom(path, head)
    if reason is not None:
        return DiscoveryProblem(path, None, reason, ignored=True)
    if zero_head(head):  # hashed only if small: a file of zeros is not read in full
        return DiscoveryProblem(path, None, zeroed_reason(fd, size), digest=size <= ZERO_WINDOW)
    return archive_kind(path, head) or SourceRef(path, None, size)


def problem_sha256(problem: DiscoveryProblem) -> str | None:
    """sha256 of a refused plain file (an empty file, a damaged or capped archive, a file that is not DICOM);
    None for links (not followed), refused archive members (not read), zero-filled files of more than
    :data:`~medload.ingest.sniff.ZERO_WINDOW` bytes (not read in full) and what cannot be read."""
    try:
        if not problem.digest or problem.member is not None or not stat.S_ISREG(os.lstat(problem.path).st_mode):
            return None
        digest = hashlib.sha256()
        with open(problem.path, "rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()
    except OSError:
        return None


def read_source(ref: SourceRef, *, max_bytes: int | None = None) -> bytes:
    """The content of ``ref`` (its first ``max_bytes`` if given); InputProblem if it cannot be read."""
    try:
        if ref.member is None:
            with open(ref.path, "rb") as file:
                return file.read(-1 if max_bytes is None else max_bytes)
        return _read_member(ref.path, ref.member, max_bytes)
    except READ_ERRORS as exc:
        raise InputProblem("discover", f"cannot read: {describe(exc)}") from exc


def open_source(ref: SourceRef) -> BinaryIO:
    """A seekable binary file object on ``ref``; InputProblem if it cannot be opened."""
    try:
        if ref.member is None:
            return open(ref.path, "rb")
        return _open_member(ref.path, ref.member)
    except READ_ERRORS as exc:
        raise InputProblem("discover", f"cannot open: {describe(exc)}") from exc


class _TarHandle:
    """An uncompressed tar opened for ``pread``, with the data offset and size of each regular member."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "rb")
        weakref.finalize(self, self.file.close)  # when the last reference (cache or open view) goes, or at exit
        self.stamp = _stamp(os.fstat(self.file.fileno()))
        self.index: dict[str, tuple[int, int]] = {}
        with tarfile.open(fileobj=self.file, mode="r:") as archive:
            try:
                for member in archive:
                    if member.isreg() and not member.issparse():
                        self.index.setdefault(member.name, (member.offset_data, member.size))
            except READ_ERRORS as exc:  # damaged further on: members before the damage stay readable
                log.debug("tar archive %s damaged after %d members: %s", path, len(self.index), exc)

    def find(self, member: str) -> tuple[int, int]:
        """Data offset and size of ``member``."""
        if member not in self.index:
            raise InputProblem("discover", "member not found as a regular file in the tar archive")
        return self.index[member]

    def pread(self, size: int, offset: int) -> bytes:
        """Exactly ``size`` bytes at ``offset``; InputProblem if the file is shorter."""
        parts, done = [], 0
        while done < size:
            part = os.pread(self.file.fileno(), size - done, offset + done)
            if not part:
                raise InputProblem("discover", "member data truncated (archive cut short)")
            parts.append(part)
            done += len(part)
        return b"".join(parts)


class _ZipHandle:
    """An open zip with its first member of each name (the one discovery yields)."""

    def __init__(self, path: str) -> None:
        self.zip = zipfile.ZipFile(path)
        self.stamp = _stamp(os.fstat(cast(BinaryIO, self.zip.fp).fileno()))
        self.index: dict[str, zipfile.ZipInfo] = {}
        for info in self.zip.infolist():
            self.index.setdefault(info.filename, info)

    def find(self, member: str) -> zipfile.ZipInfo:
        """The entry of ``member``."""
        if member not in self.index:
            raise InputProblem("discover", "member not found in the zip archive")
        return self.index[member]


class _MemberView(io.RawIOBase):
    """Read-only, seekable view of one tar member's bytes inside the archive file."""

    def __init__(self, handle: _TarHandle, offset: int, size: int) -> None:
        super().__init__()
        self._handle, self._offset, self._size, self._pos = handle, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}.get(whence)
        if base is None or base + pos < 0:
            raise ValueError(f"invalid seek: offset {pos}, whence {whence}")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        size = max(0, min(len(view), self._size - self._pos))
        data = self._handle.pread(size, self._offset + self._pos) if size else b""
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


_handles: OrderedDict[tuple[str, int], _TarHandle | _ZipHandle] = OrderedDict()
_handles_lock = threading.Lock()


def _stamp(info: os.stat_result) -> tuple[int, ...]:
    """What identifies one version of a file: device, inode, size, modification time."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _handle(path: str) -> _TarHandle | _ZipHandle:
    """The open archive at ``path`` for this process (keyed by pid, so a forked child opens its own;
    reopened if the file at ``path`` was replaced or changed since)."""
    key = (path, os.getpid())
    stamp = _stamp(os.stat(path))
    with _handles_lock:
        found = _handles.get(key)
        if found is not None and found.stamp == stamp:
            _handles.move_to_end(key)
            return found
    with open(path, "rb") as file:
        kind = archive_kind(path, file.read(HEAD_BYTES))
    if kind == "zip":
        handle: _TarHandle | _ZipHandle = _ZipHandle(path)
    elif kind == "tar":
        handle = _TarHandle(path)
    else:
        raise InputProblem("discover", "not a zip or uncompressed tar archive (compressed tars are spooled)")
    with _handles_lock:
        _handles[key] = handle
        while len(_handles) > _MAX_HANDLES:
            _handles.popitem(last=False)  # open views keep their handle alive
    return handle


def _read_member(path: str, member: str, max_bytes: int | None) -> bytes:
    """Bytes of ``member`` of the archive at ``path`` (the first ``max_bytes`` if given)."""
    handle = _handle(path)
    if isinstance(handle, _TarHandle):
        offset, size = handle.find(member)
        return handle.pread(size if max_bytes is None else min(max_bytes, size), offset)
    info = handle.find(member)
    limit = info.file_size + 1 if max_bytes is None else min(max_bytes, info.file_size + 1)
    with handle.zip.open(info) as data:
        content = data.read(limit)  # zip bomb guard: never more than declared + 1
    if len(content) > info.file_size:
        raise InputProblem("discover", f"member yields more than its declared {info.file_size} bytes")
    return content


def _open_member(path: str, member: str) -> BinaryIO:
    """A seekable binary file object reading ``member`` of the archive at ``path``."""
    handle = _handle(path)
    if isinstance(handle, _TarHandle):
        return cast(BinaryIO, io.BufferedReader(_MemberView(handle, *handle.find(member))))
    return cast(BinaryIO, handle.zip.open(handle.find(member)))
