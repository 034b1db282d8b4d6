"""One ingest from files out of the page cache, stage by stage (wall seconds): discovery, the header pass,
decoding and writing.

Usage: PYTHONPATH=. python benchmarks/ingest_cold.py DATA [--workers 2] [--warm]

Before the ingest the source files' pages are dropped: the whole page cache (``/proc/sys/vm/drop_caches``,
folders and inodes too) when run as root, else each file's pages (``posix_fadvise``). ``--warm`` reads
them first instead. Run it alternately on two checkouts to compare them; ``medload bench --sections
ingest`` has the same rows (files not in the page cache) side by side with the warm ones.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from ingest_serial import time_stages  # this folder: run as a script

import medload.ingest.run as run
from medload.allocator import keep_large_buffers_in_heap
from medload.bench.common import data_files, evict_page_cache, read_files
from medload.config import IngestConfig
from medload.deid import create_key
from medload.ingest.local_engine import LocalEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warm", action="store_true")
    args = parser.parse_args()
    keep_large_buffers_in_heap()
    walls = time_stages(((run, "_discover", "discovery"), (LocalEngine, "headers", "header pass"),
                         (LocalEngine, "write", "decode and write")), time.perf_counter)
    files = data_files([args.data])
    with tempfile.TemporaryDirectory(prefix="medload-cold-") as tmp:
        key = create_key(Path(tmp) / "k.key")
        os.sync()
        if args.warm:
            read_files(files)
        elif os.geteuid() == 0:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        else:
            evict_page_cache(files)
        t0 = time.perf_counter()
        report = run.ingest(args.data, Path(tmp) / "store", config=IngestConfig(workers=args.workers), key_file=key)
        seconds = time.perf_counter() - t0
    stages = ", ".join(f"{stage} {s:.2f}" for stage, s in walls.items())
    print(f"{report.files} files, {args.workers} workers, {'warm' if args.warm else 'cold'}: {seconds:.2f} s "
          f"({report.files / seconds:,.0f} files/s); {stages}")


if __name__ == "__main__":
    main()
