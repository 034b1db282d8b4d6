"""Test-only: a container's small /dev/shm, for real.

``run_in_namespace(mount_line(size) + script, *args)`` runs a Python script in a new mount namespace
(``unshare -m``) whose /dev/shm the script's first line replaces with a tmpfs of ``size``; the test skips,
saying why, where no namespace can be made."""

from __future__ import annotations

import subprocess
import sys

import pytest

__all__ = ["mount_line", "run_in_namespace"]


def mount_line(size: str) -> str:
    """The script line that mounts a ``size`` tmpfs (``"16m"``) on /dev/shm inside the namespace."""
    return f'import subprocess; subprocess.run(["mount", "-t", "tmpfs", "-o", "size={size}", "tmpfs", "/dev/shm"], check=True)'


def run_in_namespace(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -c script args...`` in a new mount namespace (skips the test where that is not allowed)."""
    probe = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(reason=f"cannot mount a small /dev/shm in a mount namespace here (needs root or "
                           f"CAP_SYS_ADMIN): {probe.stderr.strip()}")
    return subprocess.run(["unshare", "-m", sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=timeout)
