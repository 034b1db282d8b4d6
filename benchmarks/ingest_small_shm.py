"""Ingest with a container's small /dev/shm against the machine's own: the rings' fallback (issue 32).

Usage (as root: it mounts a tmpfs):
    PYTHONPATH=. python benchmarks/ingest_small_shm.py DATA [--shm-mb 64] [--workers 2] [--rounds 4]

A container's ``/dev/shm`` is 64 MB unless told otherwise, and each writing process wants a ring of about
100 MB there (:mod:`medload.ingest.ring`). This mounts a tmpfs of ``--shm-mb`` MB, and in each round runs
one ingest of DATA with that tmpfs standing in for ``/dev/shm`` and one with the real ``/dev/shm``, each in a
fresh process (imports untimed, as ``medload bench`` does), into a new store beside this machine's
temporary directory. Prints each run's seconds, files/s and the CPU seconds of the whole process tree
(``getrusage``: the process and its reaped children), then the medians. Run it against two checkouts
(``PYTHONPATH=...``) to compare the fallbacks: before 2026-12-06 a ring that did not fit went through the
pipe; now it is a file in the temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(data: str, workers: int, shm: str | None) -> None:
    import resource

    import medload.ingest.ring as ring

    if shm:
        ring._directory = lambda: shm  # the small tmpfs stands in for /dev/shm
    import blosc2  # noqa: F401 -- imported before the clock starts, as the bench's children do
    import pydicom  # noqa: F401

    from medload.allocator import keep_large_buffers_in_heap
    from medload.config import IngestConfig
    from medload.deid import create_key
    from medload.ingest.run import ingest

    keep_large_buffers_in_heap()
    with tempfile.TemporaryDirectory(prefix="medload-smallshm-") as tmp:
        key = Path(tmp, "k.key")
        create_key(key)
        usage = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
        t0 = time.perf_counter()
        report = ingest(data, f"{tmp}/store", config=IngestConfig(workers=workers), key_file=key, progress=False)
        seconds = time.perf_counter() - t0
        after = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    cpu = sum(b.ru_utime - a.ru_utime + b.ru_stime - a.ru_stime for a, b in zip(usage, after))
    print(json.dumps({"files": report.files, "s": seconds, "cpu_s": cpu}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data")
    ap.add_argument("--shm-mb", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--child", choices=("small", "full"), help=argparse.SUPPRESS)
    ap.add_argument("--shm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.data, args.workers, args.shm if args.child == "small" else None)
        return
    with tempfile.TemporaryDirectory(prefix="medload-shm-") as shm:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.shm_mb}m", "tmpfs", shm],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            raise SystemExit(f"cannot mount a tmpfs (run as root): {mounted.stderr.strip()}")
        try:
            runs: dict[str, list[dict]] = {"small": [], "full": []}
            print("| round | /dev/shm | s | files/s | CPU s (tree) |\n|---|---|---:|---:|---:|")
            for r in range(1, args.rounds + 1):
                for mode in runs:
                    out = subprocess.run([sys.executable, __file__, args.data, "--workers", str(args.workers),
                                          "--child", mode, "--shm", shm], capture_output=True, text=True,
                                         env=os.environ, check=True)
                    run = json.loads(out.stdout.strip().splitlines()[-1])
                    runs[mode].append(run)
                    label = f"{args.shm_mb} MB tmpfs" if mode == "small" else "the machine's"
                    print(f"| {r} | {label} | {run['s']:.2f} | {run['files'] / run['s']:,.0f} | {run['cpu_s']:.2f} |",
                          flush=True)
        finally:
            subprocess.run(["umount", shm], check=False)
    for mode, label in (("small", f"{args.shm_mb} MB tmpfs"), ("full", "the machine's")):
        s = statistics.median(r["s"] for r in runs[mode])
        cpu = statistics.median(r["cpu_s"] for r in runs[mode])
        print(f"median, {label} /dev/shm: {s:.2f} s, {runs[mode][0]['files'] / s:,.0f} files/s, {cpu:.2f} CPU s")


if __name__ == "__main__":
    main()
