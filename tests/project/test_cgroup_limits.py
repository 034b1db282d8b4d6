"""The memory and cores a container or job leaves the process, read from cgroup trees laid out as the kernel
lays out version 1 and version 2, and from this machine's own."""

from __future__ import annotations

import os
from pathlib import Path

from medload.cgroup_limits import available_memory, cgroup_memory_left, cpu_quota, memory_group, usable_cores

GB = 1 << 30


def _files(folder: Path, **values: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in values.items():
        (folder / name.replace("__", ".")).write_text(text + "\n")
    return folder


def _proc(tmp_path: Path, cgroup_lines: str, available_kb: int = 64 << 20) -> Path:
    proc = tmp_path / "proc"
    _files(proc / "self", cgroup=cgroup_lines)
    (proc / "meminfo").write_text(f"MemTotal: {128 << 20} kB\nMemFree: 1000 kB\nMemAvailable: {available_kb} kB\n")
    return proc


def test_v2_a_pods_limit_binds_the_container_below_it_and_dropable_cache_counts_as_free(tmp_path):
    root = _files(tmp_path / "cg", cgroup__procs="")
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr")
    ctr = _files(root / "kubepods/pod1/ctr", memory__max="max", memory__current=str(3 * GB),
                 memory__stat=f"anon {GB}\nfile {2 * GB}\nshmem {GB // 2}", cpu__max="max 100000")
    _files(root / "kubepods/pod1", memory__max=str(8 * GB), memory__current=str(3 * GB),
           memory__stat=f"file {2 * GB}\nshmem {GB // 2}", cpu__max="250000 100000")
    # 8 GB - 3 GB used + 1.5 GB of page cache (2 GB of it less 0.5 GB of shared memory, which stays)
    assert cgroup_memory_left(proc, root) == 6.5 * GB
    assert available_memory(proc, root) == 6.5 * GB  # less than the host's 64 GB
    assert cpu_quota(proc, root) == 2.5
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(proc, root) == min(affinity, 3)
    (ctr / "memory.max").write_text(f"{4 * GB}\n")  # the container's own limit, tighter than the pod's
    assert cgroup_memory_left(proc, root) == 2.5 * GB
    (ctr / "cpu.max").write_text("50000 100000\n")
    assert cpu_quota(proc, root) == 0.5 and usable_cores(proc, root) == 1
    assert memory_group(proc, root) is None  # the container's folder is no cgroup of its own here (no cgroup.procs)
    (ctr / "cgroup.procs").write_text("")
    assert memory_group(proc, root) == (ctr, "memory.max")


def test_v1_limits_of_a_docker_container_and_the_unlimited_root(tmp_path):
    root = tmp_path / "cg"
    proc = _proc(tmp_path, "12:pids:/docker/abc\n4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/")
    _files(root / "memory", cgroup__procs="", memory__limit_in_bytes="9223372036854771712",
           memory__usage_in_bytes=str(10 * GB))
    _files(root / "memory/docker/abc", memory__limit_in_bytes=str(2 * GB), memory__usage_in_bytes=str(GB + GB // 2),
           memory__stat=f"cache {GB}\nshmem 0\ntotal_cache {GB}\ntotal_shmem {GB // 5}")
    _files(root / "cpu,cpuacct", cgroup__procs="", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    _files(root / "cpu,cpuacct/docker/abc", cpu__cfs_quota_us="400000", cpu__cfs_period_us="100000")
    assert cgroup_memory_left(proc, root) == 2 * GB - (GB + GB // 2) + (GB - GB // 5)
    assert cpu_quota(proc, root) == 4.0
    (root / "memory/docker/abc/cgroup.procs").write_text("")
    assert memory_group(proc, root) == (root / "memory/docker/abc", "memory.limit_in_bytes")


def test_a_container_that_shows_only_its_own_group_at_the_root(tmp_path):
    """Its /proc/self/cgroup names a path from the host's root that is not inside the mount: the root is it."""
    root = _files(tmp_path / "cg", cgroup__procs="", memory__max=str(GB), memory__current=str(GB // 4))
    proc = _proc(tmp_path, "0::/system.slice/docker-abc.scope")
    assert cgroup_memory_left(proc, root) == GB - GB // 4


def test_no_limit_anywhere_and_nothing_to_read(tmp_path):
    root = _files(tmp_path / "cg", cgroup__procs="", memory__current="5")  # the v2 root: no memory.max, no cpu.max
    proc = _proc(tmp_path, "0::/\nbroken line\n", available_kb=20_000_000)
    assert cgroup_memory_left(proc, root) is None and cpu_quota(proc, root) is None
    assert available_memory(proc, root) == 20_000_000 * 1024  # the system's figure alone
    assert usable_cores(proc, root) == len(os.sched_getaffinity(0))
    (root / "memory.max").write_text("garbage\n")  # unreadable figures are no limit, not an error
    assert cgroup_memory_left(proc, root) is None
    nowhere = tmp_path / "nowhere"
    assert available_memory(nowhere, nowhere) is None and cgroup_memory_left(nowhere, nowhere) is None
    assert memory_group(nowhere, nowhere) is None  # no cgroup file system mounted


def test_this_machine_reports_its_free_memory_and_cores():
    free = available_memory()
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    assert free is not None and 0 < free <= total
    assert 1 <= usable_cores() <= len(os.sched_getaffinity(0))
