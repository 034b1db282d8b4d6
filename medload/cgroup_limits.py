"""What the machine and this process's Linux control group (cgroup) leave it: free memory and CPU cores.

A container (``docker run --memory 8g --cpus 4``), a Kubernetes pod, a Slurm job or a systemd slice caps a
process through its cgroup, while ``/proc/meminfo`` and the affinity mask still describe the whole host: a
64-core host shows 64 cores to a pod given 4, and 256 GB free to a job allowed 8. The defaults that size
themselves to the machine (ingest workers, a loader's memory budget) read both and take the smaller.

Read from ``/proc/self/cgroup`` and the cgroup file system (``/sys/fs/cgroup``), version 2 (``memory.max``,
``memory.current``, ``memory.stat``, ``cpu.max``) or version 1 (``memory.limit_in_bytes``,
``memory.usage_in_bytes``, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), in this process's own group and
every group above it (a limit set on a parent binds its children). Page cache the kernel can drop counts
as free, as ``MemAvailable`` counts it; shared memory (tmpfs) does not: without swap it cannot be reclaimed.
See the kernel's ``Documentation/admin-guide/cgroup-v2.rst`` and ``cgroup-v1/memory.rst``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["affinity_cores", "available_memory", "cgroup_memory_left", "cpu_quota", "memory_group", "usable_cores"]

#: a v1 limit at or above this is "no limit" (the kernel writes PAGE_COUNTER_MAX pages, about 2**63 bytes)
_V1_UNLIMITED = 1 << 62
_PROC = Path("/proc")
_ROOT = Path("/sys/fs/cgroup")


def _groups(controller: str, proc: Path, root: Path) -> list[Path]:
    """This process's cgroup folders for ``controller`` (``memory`` or ``cpu``), its own first, then each
    parent up to the mount's root; the root alone where the own group is not visible (a container that
    mounts only its own group at the root)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    found: list[tuple[Path, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one unified hierarchy
            found.append((root, path))
        elif controller in controllers.split(","):
            found.append((root / controllers, path))
            found.append((root / controller, path))  # a v1 mount named for this controller alone
    for mount, path in found:
        if (mount / "cgroup.procs").exists():
            own = mount / path.lstrip("/")
            if not own.is_dir():
                return [mount]
            return [own, *[p for p in own.parents if p.is_relative_to(mount)]]
    return [root]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _left_in(group: Path) -> int | None:
    """Bytes this group's memory limit leaves (limit - usage + reclaimable page cache), None without a limit."""
    limit, usage = _read(group / "memory.max"), _read(group / "memory.current")
    stat = _stat(group / "memory.stat")
    if limit is not None:  # v2: "file" counts tmpfs and shared memory too
        cache, shmem = stat.get("file", 0), stat.get("shmem", 0)
    else:
        limit, usage = _read(group / "memory.limit_in_bytes"), _read(group / "memory.usage_in_bytes")
        # v1: shared memory counted in the cache too; the total_ figures include the groups below
        cache, shmem = stat.get("total_cache", stat.get("cache", 0)), stat.get("total_shmem", stat.get("shmem", 0))
    if limit is None or usage is None or not limit.isdigit() or not usage.isdigit() or int(limit) >= _V1_UNLIMITED:
        return None  # no limit ("max" in v2, PAGE_COUNTER_MAX in v1), or nothing readable
    return int(limit) - int(usage) + max(0, cache - shmem)


def memory_group(proc: Path = _PROC, root: Path = _ROOT) -> tuple[Path, str] | None:
    """This process's own memory cgroup folder and the name of the limit file its children have
    (``memory.limit_in_bytes`` in v1, ``memory.max`` in v2), None where no memory cgroup is mounted: what a
    benchmark or test needs to run a command under a limit of its own."""
    group = _groups("memory", proc, root)[0]
    if not (group / "cgroup.procs").exists():
        return None
    return group, "memory.limit_in_bytes" if (group / "memory.limit_in_bytes").exists() else "memory.max"


def cgroup_memory_left(proc: Path = _PROC, root: Path = _ROOT) -> int | None:
    """Bytes this process's cgroups still allow it (the tightest of its group and those above), None where
    no group sets a memory limit."""
    left = [v for g in _groups("memory", proc, root) if (v := _left_in(g)) is not None]
    return max(0, min(left)) if left else None


def available_memory(proc: Path = _PROC, root: Path = _ROOT) -> int | None:
    """Bytes this process may still take: ``MemAvailable`` (/proc/meminfo) or what its cgroups leave,
    whichever is less (None where the system says neither)."""
    free = None
    for line in (_read(proc / "meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            free = int(line.split()[1]) * 1024
    left = cgroup_memory_left(proc, root)
    if left is not None:
        free = left if free is None else min(free, left)
    return free


def cpu_quota(proc: Path = _PROC, root: Path = _ROOT) -> float | None:
    """Cores' worth of CPU time this process's cgroups allow (``--cpus 4``: 4.0), None without a quota."""
    quotas = []
    for group in _groups("cpu", proc, root):
        v2 = _read(group / "cpu.max")
        if v2 is not None:
            quota, _, period = v2.partition(" ")
        else:
            quota, period = _read(group / "cpu.cfs_quota_us") or "-1", _read(group / "cpu.cfs_period_us") or "0"
        if quota.lstrip("-").isdigit() and int(quota) > 0 and period.isdigit() and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def affinity_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a Slurm allocation).

    Examples:
        >>> affinity_cores() >= 1
        True
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def usable_cores(proc: Path = _PROC, root: Path = _ROOT) -> int:
    """:func:`affinity_cores`, fewer where this process's cgroup CPU quota allows less (rounded up); at least 1."""
    cores = affinity_cores()
    quota = cpu_quota(proc, root)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores
