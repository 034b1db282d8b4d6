"""The serial part of a local ingest: the ingest process's own CPU per file, stage by stage (issue 32).

Usage: PYTHONPATH=. python benchmarks/ingest_serial.py [--workers 2] [--series 16] [--slices 128]
                                                       [--repeats 3] [--data DIR]

With 2 or more workers the ingest process decodes and writes nothing: it discovers the files, sends their
references to the header processes and takes their headers back, groups and plans the series, hands them
to task processes and publishes their shards. Whatever it spends per file bounds how many workers it can
feed. Runs ``ingest()`` ``--repeats`` times in this process (the first pays the imports; the later ones
are the per-file cost) and prints the CPU time of this process's main thread (``time.thread_time``) per
file in each stage: discovery, the header pass, grouping, planning, adopting the task shards, and the rest
(not broken down; plans are pickled for the tasks by the executor's own thread, not counted). Without
``--data``, synthetic CT as ``medload bench`` makes it.
"""

from __future__ import annotations

import argparse
import collections
import functools
import tempfile
import time
from pathlib import Path

import medload.ingest.run as run
from medload.allocator import keep_large_buffers_in_heap
from medload.bench.ingest import make_data
from medload.config import IngestConfig
from medload.deid import create_key
from medload.ingest.local_engine import LocalEngine
from medload.storage.writer import StoreWriter


def time_stages(stages: tuple[tuple[object, str, str], ...], clock=time.thread_time) -> collections.Counter[str]:
    """Wrap each ``(owner, attribute, stage)`` function so that its calls add their ``clock`` seconds to the
    returned counter under ``stage`` (also used by ``ingest_cold.py``, with wall time)."""
    spent: collections.Counter[str] = collections.Counter()
    for owner, name, stage in stages:
        fn = getattr(owner, name)

        def timed(*args, _fn=fn, _stage=stage, **kwargs):
            t0 = clock()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_stage] += clock() - t0

        setattr(owner, name, functools.wraps(fn)(timed))
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--series", type=int, default=16)
    ap.add_argument("--slices", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", type=Path)
    args = ap.parse_args()
    keep_large_buffers_in_heap()  # as the medload command does
    spent = time_stages(((run, "_discover", "discovery"), (LocalEngine, "headers", "header pass"),
                         (run, "group_series", "grouping"), (run, "_plan", "planning"),
                         (StoreWriter, "adopt", "adopting shards")))
    with tempfile.TemporaryDirectory(prefix="medload-serial-") as tmp:
        src = args.data or make_data(Path(tmp), args.series, args.slices)
        key = create_key(Path(tmp) / "k.key")
        for n in range(args.repeats):
            spent.clear()
            t0 = time.thread_time()
            report = run.ingest(src, Path(tmp) / f"store{n}", config=IngestConfig(workers=args.workers), key_file=key)
            total = time.thread_time() - t0
            per = {stage: s / report.files * 1e3 for stage, s in spent.items()}
            per["rest"] = total / report.files * 1e3 - sum(per.values())
            print(f"ingest {n + 1}: {report.files} files, {args.workers} workers: {total / report.files * 1e3:.4f} ms "
                  f"of CPU per file ({report.files / total:,.0f} files per CPU-s); "
                  + ", ".join(f"{stage} {ms:.4f}" for stage, ms in per.items()))


if __name__ == "__main__":
    main()
