"""What every benchmark section shares: peak memory of a process tree, medians, the machine, file sizes.

Peak memory is the proportional set size (PSS, from ``/proc/<pid>/smaps_rollup``) of a process and all
its descendants, sampled by a thread: pages shared between the processes of a run (DataLoader workers
forked from the trainer, a memory-mapped file read by all of them) are counted once in the sum.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import threading
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from medload.config import affinity_cores

__all__ = ["peak_pss", "tree_pss_mb", "spread", "machine", "tree_bytes"]


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "min", "max"}`` of a non-empty sequence."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def tree_bytes(path: str | os.PathLike) -> int:
    """Sum of the sizes of the regular files under ``path`` (a file: its size; missing: 0)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


# ---- memory: PSS of a process tree, sampled by a thread ------------------------------------------
def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue  # the process (or thread) ended meanwhile
    return pids


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tree_pss_mb(pid: int) -> float:
    """PSS of ``pid`` and its descendants now (MB)."""
    return sum(_pss_kib(p) for p in _tree(pid)) * 1024 / 1e6


class peak_pss:  # noqa: N801 - used like a function
    """``with peak_pss(pid) as peak:`` samples the PSS of ``pid`` and its descendants every ``interval``
    seconds in a thread; ``peak.mb`` is the largest sum seen (MB)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval, self.kib = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.kib = max(self.kib, sum(_pss_kib(p) for p in _tree(self.pid)))
            self._stop.wait(self.interval)

    @property
    def mb(self) -> float:
        return self.kib * 1024 / 1e6

    def __enter__(self) -> peak_pss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ---- the machine ---------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError):
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def dcm2niix_version() -> str | None:
    """dcm2niix's version string, or None when it is not on PATH."""
    exe = shutil.which("dcm2niix")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (out.strip().splitlines() or ["unknown"])[-1].strip()


def machine() -> dict:
    """The machine and the versions that shape the figures."""
    info = {"cpu": _cpu_model(), "cores": affinity_cores(), "memory_gb": _memory_gb(), "os": platform.platform(),
            "arch": platform.machine(), "python": platform.python_version(), "dcm2niix": dcm2niix_version()}
    for dist in ("medload", "torch", "monai", "numpy", "pydicom", "SimpleITK", "lmdb", "blosc2"):
        info[dist.lower()] = _version(dist)
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        info["cuda"] = None
    return info
