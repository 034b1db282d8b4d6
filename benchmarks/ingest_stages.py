"""Where one ingest worker's time goes: each stage of ``medload ingest`` timed alone, in one process, on
the same files, against bare pydicom read + decode + rescale (issue 32).

Usage: PYTHONPATH=. python benchmarks/ingest_stages.py [--series 4] [--slices 32] [--size 512] [--windows lung]

Stages, per file (ms), each run over every file after the one before it (so each starts from the
previous stage's output, held in memory): discovery, header pass (pseudonymised SliceHeader), grouping
and geometry (per file: the series' cost divided by its files), file read, decode + HU (``decode_plane``),
plane windowing (every stored window), compression + checksum (``encode_value`` of the value and its
planes), slice digest, source hash (xxh3 of the file), LMDB puts, and the synced commit (fsync) of each
series. Prints a markdown table for docs/benchmarks.md "Design measurements". One process, no pool: the
figures add up to what one worker spends per file.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pydicom
import xxhash

from medload import windows as win
from medload.allocator import keep_large_buffers_in_heap
from medload.config import IngestConfig
from medload.deid import Pseudonymizer, create_key, load_key
from medload.ingest.discover import SourceRef, discover, read_source
from medload.ingest.geometry import plan_geometry
from medload.ingest.headers import SliceHeader, read_headers
from medload.ingest.labels import LabelInput
from medload.ingest.pixels import LoadedFile, decode_plane
from medload.ingest.series import group_series
from medload.storage.codec import encode_value, get_codec
from medload.storage.digest import slice_digest
from medload.storage.task_shard import TaskShardWriter
from medload.synthetic import SeriesSpec, make_series


def _pydicom(paths: list[Path]) -> None:
    for p in paths:
        ds = pydicom.dcmread(p)
        (ds.pixel_array.astype(np.int32) * int(ds.RescaleSlope) + int(ds.RescaleIntercept)).astype(np.int16)


def _planes(found: list[SliceHeader] | LabelInput) -> list[SliceHeader]:
    return found if isinstance(found, list) else []


def measure(root: Path, series: int, slices: int, size: int, windows: tuple[str, ...]) -> list[tuple[str, float]]:
    src = root / "dicom"
    for i in range(series):
        make_series(src, SeriesSpec(n_slices=slices, rows=size, cols=size, signed=bool(i % 2), bits_stored=16 if i % 2 else 12,
                                    orientation="axial" if i % 2 == 0 else "oblique"), seed=200 + i, series_number=i + 1)
    cfg = IngestConfig(workers=1, windows=windows)
    pseudo = Pseudonymizer(load_key(create_key(root / "key")))
    codec, planes_of = get_codec(cfg.codec), [win.get(w) for w in cfg.windows]
    paths = sorted(src.iterdir())
    n = len(paths)
    times: list[tuple[str, float]] = []

    def clock(name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        times.append((name, (time.perf_counter() - t0) / n * 1e3))
        return out

    _pydicom(paths)  # page cache and imports warm for both sides
    encode_value(np.zeros((2, 2), np.int16), codec)  # blosc2 is imported on the first value encoded
    clock("bare pydicom: dcmread + pixel_array + rescale (the reference)", lambda: _pydicom(paths))
    refs: list[SourceRef] = clock("discovery", lambda: [r for r in discover(src) if isinstance(r, SourceRef)])
    headers = clock("header pass (read_headers)", lambda: [h for r in refs for h in _planes(read_headers(r, pseudo, cfg))])
    cands = clock("grouping + geometry", lambda: [(c, plan_geometry(c.headers, cfg)) for c in
                                                  group_series(headers, time_series=cfg.time_series,
                                                               duplicate_tolerance=cfg.duplicate_tolerance_mm)])
    slots = [(c, slot[0]) for c, g in cands for slot in g.slots]
    files = clock("file read", lambda: [LoadedFile(read_source(h.ref)) for _, h in slots])
    values = clock("decode + HU (decode_plane)", lambda: [decode_plane(f, h, c.first.modality, c.value_dtype)[0]
                                                          for f, (c, h) in zip(files, slots, strict=True)])
    planes = clock("plane windowing", lambda: [{w.name: win.to_uint8(v, w) for w in planes_of} for v in values])
    encoded = clock("compression + checksum", lambda: [(encode_value(v, codec), {k: encode_value(p, codec) for k, p in
                                                        ps.items()}) for v, ps in zip(values, planes, strict=True)])
    clock("slice digest", lambda: [slice_digest(v) for v in values])
    clock("source hash (xxh3 of the file)", lambda: [xxhash.xxh3_64_hexdigest(f.data) for f in files])
    writer = TaskShardWriter(root / "task.lmdb", cfg.windows)
    put = commit = 0.0
    i = 0
    for c, g in cands:  # one write transaction at a time (LMDB): puts and commit timed apart
        txn = writer.begin_series(c.key, 4 * sum(len(v) + sum(map(len, p.values())) for v, p in encoded))
        t0 = time.perf_counter()
        for z in range(len(g.slots)):
            txn.put_slice(z, encoded[i][0], encoded[i][1])
            i += 1
        t1 = time.perf_counter()
        txn.commit()
        put, commit = put + t1 - t0, commit + time.perf_counter() - t1
    times += [("LMDB puts", put / n * 1e3), ("commit + fsync (one per series)", commit / n * 1e3)]
    writer.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", type=int, default=4)
    ap.add_argument("--slices", type=int, default=32)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--windows", default="", help="window planes to store, as --windows of medload ingest (default none)")
    args = ap.parse_args()
    keep_large_buffers_in_heap()  # as every ingest worker does: a new slice-sized array must not page-fault
    with tempfile.TemporaryDirectory(prefix="medload-stages-") as tmp:
        times = measure(Path(tmp), args.series, args.slices, args.size, tuple(filter(None, args.windows.split(","))))
    reference = times[0][1]
    ours = sum(t for _, t in times[1:])
    planes = f", windows {args.windows}" if args.windows else ""
    print(f"| stage ({args.series} series x {args.slices} slices, {args.size}x{args.size}{planes}) | ms per file | "
          "x bare pydicom |")
    print("|---|---|---|")
    for name, t in times:
        print(f"| {name} | {t:.3f} | {t / reference:.2f} |")
    print(f"| **one worker, all stages** | **{ours:.3f}** | **{ours / reference:.2f}** |")


if __name__ == "__main__":
    main()
