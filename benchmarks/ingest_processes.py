"""Where the CPU of one local ingest goes, process by process and phase by phase (issue 32).

Usage: PYTHONPATH=. python benchmarks/ingest_processes.py [--workers 1] [--pin] [--series 16] [--slices 128]
                                                          [--data DIR]

Runs one ``ingest()`` in this process and samples every 20 ms the CPU seconds (``/proc/PID/stat``, user +
system) of this process and of each process below it, marking the header pass and the writing of series
(the engine's ``headers`` and ``write``). Prints, per phase, its seconds, the CPU seconds of each process
and the cores busy: whether decoders wait (a phase's cores busy well under the worker count) and which
process does what (with one worker the ingest process writes, next to its decoding process; with more,
task processes write and fork a decoding process each). ``--pin`` keeps the whole tree on one CPU, as the
bench's "pinned to 1 core" row. Without ``--data``, synthetic CT as ``medload bench`` makes it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from medload.allocator import keep_large_buffers_in_heap
from medload.bench.ingest import make_data
from medload.config import IngestConfig
from medload.deid import create_key
from medload.ingest.local_engine import LocalEngine
from medload.ingest.run import ingest

TICK = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    todo, out = [root], []
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                todo += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def _cpu(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``, None once it has gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--pin", action="store_true", help="this process and its children on one CPU")
    ap.add_argument("--series", type=int, default=16)
    ap.add_argument("--slices", type=int, default=128)
    ap.add_argument("--data", type=Path)
    args = ap.parse_args()
    keep_large_buffers_in_heap()  # as the medload command does
    if args.pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    marks: list[tuple[str, float]] = []
    for name in ("headers", "write"):
        def timed(self, *a, _run=getattr(LocalEngine, name), _name=name, **k):
            marks.append((_name, time.perf_counter()))
            try:
                return _run(self, *a, **k)
            finally:
                marks.append((f"after {_name}", time.perf_counter()))
        setattr(LocalEngine, name, timed)
    samples: list[tuple[float, dict[int, float]]] = []
    me, parents, stop, first = os.getpid(), {}, threading.Event(), threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now, seen = time.perf_counter(), {}
            for pid in _tree(me):
                got = _cpu(pid)
                if got is not None:
                    parents[pid], seen[pid] = got[0], got[1]
            samples.append((now, seen))
            first.set()
            stop.wait(0.02)

    with tempfile.TemporaryDirectory(prefix="medload-procs-") as tmp:
        src = args.data or make_data(Path(tmp), args.series, args.slices)
        key = create_key(Path(tmp) / "k.key")
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        first.wait()
        t0 = samples[0][0]  # CPU from here on: the imports before are not the ingest's
        report = ingest(src, Path(tmp) / "store", config=IngestConfig(workers=args.workers), key_file=key)
        end = time.perf_counter()
        stop.set()
        sampler.join()
    print(f"{report.files} files, {args.workers} worker(s){' pinned to 1 core' if args.pin else ''}: "
          f"{end - t0:.2f} s, {report.files / (end - t0):.0f} files/s")

    def cpu_at(t: float) -> dict[int, float]:
        last: dict[int, float] = {}
        for when, seen in samples:
            if when > t:
                break
            last.update(seen)
        return last

    edges = [("start", t0), *marks, ("end", end)]
    for (name, a), (_, b) in zip(edges, edges[1:]):
        before, after = cpu_at(a), cpu_at(b)
        spent = {pid: after[pid] - before.get(pid, 0.0) for pid in after if after[pid] - before.get(pid, 0.0) > 0.005}
        roles = ", ".join(f"{'ingest' if pid == me else 'child' if parents[pid] == me else 'grandchild'} {s:.2f}"
                          for pid, s in spent.items())
        print(f"  {name:14s} {b - a:5.2f} s, {sum(spent.values()) / max(b - a, 1e-9):4.2f} cores busy: {roles}")


if __name__ == "__main__":
    main()
