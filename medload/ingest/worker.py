"""Work done in decoding processes: header batches and decode-and-encode chunks.

Workers receive the run's pseudonymiser and settings once (:func:`init_worker`) and then only small
task descriptions. A decode chunk covers consecutive slots of one series; it returns ready store
values (codec payload + checksum; written into the shared-memory ring when the writer provides one),
pre-windowed planes, per-slice digests and plausibility notes, so the task writing the series only has to
``put`` bytes. Problems never escape as exceptions: they come back as :class:`Failure`. Tasks
:func:`~medload.ingest.isolation.mark` each input they start, so the supervisor can name the input
that crashed or hung a worker.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import xxhash

from medload import windows as win
from medload.allocator import keep_large_buffers_in_heap
from medload.config import IngestConfig, format_size
from medload.deid import Pseudonymizer
from medload.errors import InputProblem
from medload.ingest import plausibility
from medload.ingest.discover import DiscoveryProblem, SourceRef, read_source, sniff_plain
from medload.ingest.headers import SliceHeader, read_headers
from medload.ingest.isolation import mark
from medload.ingest.labels import LabelInput
from medload.ingest.pixels import LoadedFile, decode_plane
from medload.ingest.ring import RingSlot, SlotWriter, Span
from medload.storage.codec import encode_value, get_codec
from medload.storage.digest import slice_digest

__all__ = ["init_worker", "header_batch", "sniffing_header_batch", "decode_chunk", "source_sha256", "DecodeChunk",
           "EncodedSlice", "Failure", "Archive", "FATAL"]


@dataclass(frozen=True)
class Failure:
    """An input that could not be read or decoded, with the sha256 of its bytes when they could be read."""

    source: str
    stage: str
    reason: str
    skipped: bool
    sha256: str | None


@dataclass(frozen=True)
class Archive:
    """A file of the header pass that is an archive of this ``kind``: its members are read next."""

    kind: str


_HeaderResult = list[SliceHeader] | LabelInput | Failure


@dataclass(frozen=True)
class DecodeChunk:
    """Slots ``z0 .. z0 + len(slots) - 1`` of one series; each slot lists its candidate planes.
    ``ring``, when set, is where the encoded values go (see :mod:`medload.ingest.ring`)."""

    series_index: int
    z0: int
    slots: list[list[SliceHeader]]
    modality: str
    dtype: str
    ring: RingSlot | None = None

    @property
    def planes(self) -> list[SliceHeader]:
        """Every plane of the chunk, in the order the task marks them (slot by slot)."""
        return [h for slot in self.slots for h in slot]


@dataclass(frozen=True)
class EncodedSlice:
    """One slice ready for the store: its value and window planes as bytes, or as spans of the ring;
    for CT under a plausibility policy, a thumbnail and why its values are implausible (if they are)."""

    z: int
    value: bytes | Span
    windows: dict[str, bytes | Span]
    digest: bytes
    source_hash: str
    padding: int
    thumb: np.ndarray | None = None
    implausible: str | None = None


#: What a worker lets through. Everything else raised while reading one input -- including the
#: BaseException-derived panics that Rust decoders (pylibjpeg-rle via pyo3) raise on damaged data --
#: becomes a quarantine record for that input.
FATAL = (KeyboardInterrupt, SystemExit, GeneratorExit)


class _State:
    pseudo: Pseudonymizer | None = None
    cfg: IngestConfig = IngestConfig()


def init_worker(pseudo: Pseudonymizer, cfg: IngestConfig, *, own_process: bool = True) -> None:
    """Process initializer: keep the run's pseudonymiser and settings for the tasks that follow. In a
    process of our own (a pool worker) also tune the allocator for slice-sized buffers (see
    :mod:`medload.allocator`); the caller's process keeps its settings."""
    _State.pseudo = pseudo
    _State.cfg = cfg
    if own_process:
        keep_large_buffers_in_heap()


def source_sha256(ref: SourceRef) -> str | None:
    """sha256 of the bytes of ``ref``, or None if they cannot be read."""
    try:
        return hashlib.sha256(read_source(ref)).hexdigest()
    except InputProblem:
        return None


def _out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` or an exception it was raised from (readers wrap what they catch) is a MemoryError."""
    while exc is not None:
        if isinstance(exc, MemoryError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _failure(ref: SourceRef, stage: str, exc: BaseException) -> Failure:
    """The quarantine verdict on ``ref`` for ``exc``; memory exhaustion names the worker memory cap."""
    skipped = False
    if _out_of_memory(exc):
        cap = _State.cfg.worker_memory
        reason = (f"exceeded the {format_size(cap)} worker memory cap (raise --worker-memory if such inputs "
                  "are expected)") if cap else f"out of memory: {type(exc).__name__}: {exc}"
    elif isinstance(exc, InputProblem):
        stage, reason, skipped = exc.stage, exc.reason, exc.skipped
    else:
        reason = f"{type(exc).__name__}: {exc}"
    return Failure(ref.display, stage, reason, skipped, source_sha256(ref))


def header_batch(refs: list[SourceRef]) -> list[_HeaderResult | DiscoveryProblem | Archive]:
    """Header pass over a batch of inputs: per input, its planes, the LabelInput of a SEG/RTSTRUCT, or a
    :class:`Failure` (never a problem or an archive: see :func:`sniffing_header_batch`)."""
    return _headers(refs, sniff=False)


def sniffing_header_batch(refs: list[SourceRef]) -> list[_HeaderResult | DiscoveryProblem | Archive]:
    """:func:`header_batch` over inputs discovered without reading them (``discover(sniff=False)``): each
    file that is no archive member is first sniffed (:func:`~medload.ingest.discover.sniff_plain`), and
    one that is not DICOM is its :class:`DiscoveryProblem`, an archive its :class:`Archive`."""
    return _headers(refs, sniff=True)


def _headers(refs: list[SourceRef], sniff: bool) -> list[_HeaderResult | DiscoveryProblem | Archive]:
    pseudo = _State.pseudo
    if pseudo is None:
        raise RuntimeError("header_batch runs in a process set up by init_worker (it has no pseudonymisation key)")
    out: list[_HeaderResult | DiscoveryProblem | Archive] = []
    seen: dict = {}
    for i, ref in enumerate(refs):
        mark(i)
        try:
            if sniff and ref.member is None and ref.origin is None:
                found = sniff_plain(ref.path, ref.size)
                if isinstance(found, DiscoveryProblem):
                    out.append(found)
                    continue
                if isinstance(found, str):
                    out.append(Archive(found))
                    continue
            headers = read_headers(ref, pseudo, _State.cfg)
        except FATAL:
            raise
        except BaseException as exc:  # noqa: BLE001 -- a damaged file must never stop the run (see FATAL)
            out.append(_failure(ref, "header", exc))
            continue
        out.append(_share_repeats(headers, seen) if isinstance(headers, list) else headers)
    return out


#: SliceHeader fields whose values repeat across the planes of a series. Giving equal values one object
#: per batch lets the pickled batch hold each once, so the ingest process, which keeps every header until
#: its series is planned, holds ~1.0 KB per plane instead of ~2.4 KB (tracemalloc, Philips series; about
#: 10 rather than 24 GB for 10 million slices), for ~18 us per plane against ~680 us of parsing (timeit, same series).
_REPEATED = ("sop_class", "series", "frame_of_reference", "study", "patient", "modality", "image_type",
             "photometric", "orientation", "pixel_spacing", "transfer_syntax", "echo", "stack", "manufacturer",
             "model", "kernel", "body_part", "window", "frame_type", "echo_time", "diffusion",
             "modality_lut")


_REPEATED_AT = tuple(SliceHeader._fields.index(name) for name in _REPEATED)


def _share_repeats(headers: list[SliceHeader], seen: dict) -> list[SliceHeader]:
    out = []
    for h in headers:
        values = list(h)
        for i in _REPEATED_AT:
            value = values[i]
            values[i] = seen.setdefault((i, value if type(value) is str else _exact(value)), value)
        out.append(tuple.__new__(SliceHeader, values))
    return out


def _exact(value):
    """A key equal only for identical values: -0.0 is not 0.0, 1 is not 1.0 nor True."""
    if isinstance(value, tuple):
        return tuple(_exact(v) for v in value)
    return (type(value), value.hex() if isinstance(value, float) else value)


def decode_chunk(chunk: DecodeChunk) -> list[EncodedSlice] | Failure:
    """Decode, check and encode the slots of one chunk; the first failure fails the chunk."""
    cfg = _State.cfg
    codec = get_codec(cfg.codec)
    windows = [win.stored(name) for name in cfg.windows]  # checked by ingest(); a store's own names kept
    check = cfg.plausibility != "off" and chunk.modality == "CT"
    out = []
    sink = SlotWriter(chunk.ring)
    loaded: dict[SourceRef, LoadedFile] = {}
    first = 0  # index of the slot's first plane in chunk.planes
    for i, slot in enumerate(chunk.slots):
        z = chunk.z0 + i
        resolved = _resolve_slot(slot, chunk, loaded, first)
        first += len(slot)
        if isinstance(resolved, Failure):
            return Failure(resolved.source, resolved.stage, f"slice {z}: {resolved.reason}", False, resolved.sha256)
        values, padding, source_hash = resolved
        out.append(EncodedSlice(
            z=z,
            value=sink.put(encode_value(values, codec)),
            windows={w.name: sink.put(encode_value(win.to_uint8(values, w), codec)) for w in windows},
            digest=slice_digest(values),
            source_hash=source_hash,
            padding=padding,
            thumb=plausibility.thumbnail(values) if check else None,
            implausible=plausibility.value_problem(values) if check else None,
        ))
    return out


def _load(ref: SourceRef, loaded: dict[SourceRef, LoadedFile]) -> LoadedFile:
    file = loaded.get(ref)
    if file is None:
        if len(loaded) >= 4:  # frames of one file are adjacent in a chunk: a tiny cache suffices
            loaded.pop(next(iter(loaded)))
        file = loaded[ref] = LoadedFile(read_source(ref))
    return file


def _resolve_slot(slot: list[SliceHeader], chunk: DecodeChunk, loaded: dict[SourceRef, LoadedFile],
                  first: int) -> tuple[np.ndarray, int, str] | Failure:
    """Decode a slot whose planes are ``chunk.planes[first:]``: (values, padding pixels, xxh3 of the
    source file) or a Failure.

    Planes sharing one position (duplicates) must hold identical values; then the first, in the
    header-pass order (by SOP instance pseudonym, independent of file names), is kept.
    """
    kept: tuple[np.ndarray, int, str] | None = None
    for j, h in enumerate(slot):
        mark(first + j)
        try:
            file = _load(h.ref, loaded)
            values, padding = decode_plane(file, h, chunk.modality, chunk.dtype)
        except FATAL:
            raise
        except BaseException as exc:  # noqa: BLE001 -- see FATAL
            return _failure(h.ref, "decode", exc)
        if kept is None:
            kept = (values, padding, xxhash.xxh3_64_hexdigest(file.data))
        elif not np.array_equal(kept[0], values):
            return Failure(h.ref.display, "decode", f"conflicting duplicates: {_plane_name(slot[0])} and "
                           f"{_plane_name(h)} share one position but hold different pixels, and nothing in their "
                           "headers tells them apart (type, echo, diffusion, time); policy: reject",
                           False, source_sha256(h.ref))
    if kept is None:
        raise ValueError("a slot without planes: geometry puts one plane or more at every position")
    return kept


def _plane_name(h: SliceHeader) -> str:
    """A plane as a reason names it: its file, and its frame in a multi-frame object (1-based)."""
    return h.ref.display if h.frame is None else f"{h.ref.display} frame {h.frame + 1}"
