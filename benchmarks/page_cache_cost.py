"""What a page of page cache costs this machine to take: new, just freed, or already cached.

Usage: PYTHONPATH=. python benchmarks/page_cache_cost.py [--dir DIR] [--files 4] [--mb 256] [--settle 5] [--json OUT]

An ingest writes every stored byte into pages of the page cache that held something else a moment ago or
nothing at all (the store is new data). On bare metal a free page costs the same however long it has been
free. In a virtual machine whose host takes back the guest's free memory (virtio-balloon free page
reporting, as Firecracker microVMs use it: ``page_reporting`` in ``/proc/cmdline``) a page that has been
free for a couple of seconds has gone back to the host, and the first write to it stalls while the host
maps it in again; the guest counts the stall as system CPU of the process that writes. A process that
writes gigabytes of new data, as an ingest does, pays it on most of its pages.

Three conditions, each after ``--settle`` seconds of quiet (long enough for the kernel to report every
free page to the host) for the first, none for the others; CPU seconds (user + system, ``getrusage``):

1. **new**: ``--files`` files of ``--mb`` each written with ``write()``, all kept: pages free since the
   settle, the steady state of an ingest that keeps what it writes;
2. **just freed**: a file deleted and the same amount written at once to a new one: pages the kernel
   hands out again before it reports them (what a benchmark that deletes each run's store takes);
3. **cached**: the same region of a file written again: no page taken at all.

Then the first two for medload's writer: a task shard of ``--series`` series x ``--slices`` values of
237 KB (a stored 512 x 512 CT slice; random bytes), each series one synced commit, CPU ms per slice, with
the allocator tuning every ingest process has (``medload.allocator``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

_VALUE_BYTES = 237 << 10
_BLOCK = os.urandom(1 << 20)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _write_file(path: Path, mb: int, flags: int = os.O_CREAT | os.O_TRUNC) -> float:
    """CPU ms per GB of writing ``mb`` MB to ``path`` from its start."""
    fd = os.open(path, os.O_WRONLY | flags, 0o600)
    try:
        c0 = _cpu()
        for _ in range(mb):
            os.write(fd, _BLOCK)
        return (_cpu() - c0) * 1e3 * 1024 / mb
    finally:
        os.close(fd)


def file_writes(directory: Path, files: int, mb: int, settle: float) -> dict:
    """``write()``: CPU ms per GB into new pages (file by file), just-freed pages and cached ones."""
    kept = [directory / f"new-{i}.bin" for i in range(files)]
    try:
        time.sleep(settle)
        new = [_write_file(p, mb) for p in kept]
        cached = _write_file(kept[-1], mb, flags=0)
        freed = []
        for i, p in enumerate(kept):
            p.unlink()
            freed.append(_write_file(directory / f"again-{i}.bin", mb))
    finally:
        for p in directory.glob("*.bin"):
            p.unlink()
    return {"new_ms_per_gb": [round(v) for v in new], "just_freed_ms_per_gb": [round(v) for v in freed],
            "cached_ms_per_gb": round(cached)}


def _shard_cpu(path: Path, series: int, slices: int, value: bytes) -> float:
    """CPU ms per slice of one task shard of ``series`` x ``slices`` values, each series one synced commit."""
    from medload.storage.task_shard import TaskShardWriter

    writer = TaskShardWriter(path, ())
    c0 = _cpu()
    for n in range(series):
        txn = writer.begin_series(n.to_bytes(16, "big"), slices * len(value))
        for z in range(slices):
            txn.put_slice(z, value)
        txn.commit()
    writer.close()
    return (_cpu() - c0) * 1e3 / (series * slices)


def writer_pages(directory: Path, rounds: int, series: int, slices: int, settle: float) -> dict:
    """medload's task writer: CPU ms per slice into new pages (settled, shards kept), then just-freed ones."""
    from medload.allocator import keep_large_buffers_in_heap

    keep_large_buffers_in_heap()  # as in every ingest process: LMDB's value buffers reused, not faulted anew
    value = os.urandom(_VALUE_BYTES)
    kept = [directory / f"kept-{i}.lmdb" for i in range(rounds)]
    new, freed = [], []
    try:
        for p in kept:
            time.sleep(settle)
            new.append(_shard_cpu(p, series, slices, value))
        for i, p in enumerate(kept):
            shutil.rmtree(p)  # its pages go back to the free lists a moment before they are needed
            freed.append(_shard_cpu(directory / f"again-{i}.lmdb", series, slices, value))
    finally:
        for p in directory.glob("*.lmdb"):
            shutil.rmtree(p, ignore_errors=True)
    return {"new_ms_per_slice": [round(v, 3) for v in new], "just_freed_ms_per_slice": [round(v, 3) for v in freed]}


def _reporting() -> str:
    """The kernel's free page reporting settings, as far as this machine shows them."""
    cmdline = Path("/proc/cmdline").read_text() if Path("/proc/cmdline").exists() else ""
    flags = [w for w in cmdline.split() if "page_reporting" in w]
    order = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    if order.exists():
        flags.append(f"page_reporting_order now {order.read_text().strip()}")
    return ", ".join(flags) or "no free page reporting found (no page_reporting module or option)"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder; use the store's disk)")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of quiet before writing into new pages")
    ap.add_argument("--rounds", type=int, default=3, help="task shards per condition")
    ap.add_argument("--series", type=int, default=8)
    ap.add_argument("--slices", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="medload-pages-", dir=args.dir) as tmp:
        out = {"kernel": _reporting(),
               "files": file_writes(Path(tmp), args.files, args.mb, args.settle),
               "writer": writer_pages(Path(tmp), args.rounds, args.series, args.slices, args.settle)}
    f, w = out["files"], out["writer"]
    print(f"kernel: {out['kernel']}")
    print(f"write(), {args.mb} MB files, CPU ms per GB: new pages "
          + ", ".join(f"{v:,}" for v in f["new_ms_per_gb"]) + "; just freed "
          + ", ".join(f"{v:,}" for v in f["just_freed_ms_per_gb"]) + f"; cached {f['cached_ms_per_gb']:,}")
    print(f"medload task writer, {args.series} x {args.slices} slices of {_VALUE_BYTES >> 10} KB, CPU ms per slice: "
          "new pages " + ", ".join(f"{v:.3f}" for v in w["new_ms_per_slice"])
          + "; just freed " + ", ".join(f"{v:.3f}" for v in w["just_freed_ms_per_slice"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
