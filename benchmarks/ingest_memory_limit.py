"""Ingest under a memory limit, as in a container or a Slurm job: does it finish, how fast, with how many workers.

Usage (as root, or with a delegated cgroup v2 group):
    PYTHONPATH=. python benchmarks/ingest_memory_limit.py DATA --limits 0,1G,600M,400M --workers default,1,2
        [--timeout 120] [--repeats 1]

For each limit (0: none) and worker setting (``default``: no ``--workers``, the count medload chooses), runs
``medload ingest DATA STORE`` in a new child of this process's memory cgroup (v1 ``memory.limit_in_bytes``
or v2 ``memory.max``), the source files' pages dropped before each run (``/proc/sys/vm/drop_caches``) so
that they come from disk. Prints the exit status (124: still running at ``--timeout``, killed; 137: killed
by the kernel's OOM killer; 1: an error, whose message is printed), the seconds, files/s, the group's peak
memory (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak`` where the kernel has it) and the worker count
medload announced when it lowered it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from medload.cgroup_limits import memory_group
from medload.config import parse_size


def _run(data: Path, limit: int, workers: str, timeout: float) -> str:
    own = memory_group()
    if own is None:
        raise SystemExit("no memory cgroup is mounted (/proc/self/cgroup, /sys/fs/cgroup)")
    group = own[0] / f"medload-bench-{os.getpid()}"
    group.mkdir()
    try:
        if limit:
            (group / own[1]).write_text(f"{limit}\n")
        with tempfile.TemporaryDirectory(prefix="medload-memlimit-", dir=data.parent) as tmp:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            cmd = [sys.executable, "-m", "medload.cli", "ingest", str(data), f"{tmp}/store", "--no-progress"]
            cmd += [] if workers == "default" else ["--workers", workers]
            procs = group / "cgroup.procs"
            t0 = time.perf_counter()
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                     preexec_fn=lambda: procs.write_text(f"{os.getpid()}\n"))
                rc, text = out.returncode, " ".join(re.sub("[│┃]", " ", out.stdout + out.stderr).split())  # no table rules
            except subprocess.TimeoutExpired:
                rc, text = 124, ""
                for pid in (group / "cgroup.procs").read_text().split():
                    os.kill(int(pid), 9)
            seconds = time.perf_counter() - t0
        peak_file = group / ("memory.max_usage_in_bytes" if own[1] == "memory.limit_in_bytes" else "memory.peak")
        peak = f"{int(peak_file.read_text()) >> 20} MB" if peak_file.exists() else "n/a"
    finally:
        for _ in range(50):  # the killed processes leave the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    rate = re.search(r"\(([\d,]+) files/s", text)
    chose = re.search(r"using (\d+) workers? rather than", text)
    error = (re.search(r"its task failed \((.*?)\); nothing", text) or re.search(r"error: (.*)", text)) if rc else None
    return (f"| {format_limit(limit)} | {workers} | {chose.group(1) if chose else ''} | {rc} | {seconds:.1f} | "
            f"{rate.group(1) if rate and rc == 0 else ''} | {peak} | {error.group(1)[:300] if error else ''} |")


def format_limit(limit: int) -> str:
    return "none" if not limit else f"{limit >> 20} MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--limits", default="0,1G,600M,400M", help="memory limits, comma-separated (0: none)")
    ap.add_argument("--workers", default="default,1,2", help="worker settings, comma-separated")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the script drops the page cache and creates cgroups")
    limits = [parse_size(x.replace("M", "MiB").replace("G", "GiB")) if x != "0" else 0
              for x in args.limits.split(",")]
    print("| memory limit | --workers | workers chosen | exit | s | files/s | peak memory | error |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for _ in range(args.repeats):
        for limit in limits:
            for workers in args.workers.split(","):
                print(_run(args.data.resolve(), limit, workers, args.timeout), flush=True)


if __name__ == "__main__":
    main()
