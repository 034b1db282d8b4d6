"""Reading a suspect shard for ``medload verify`` in a child process.

A damaged B-tree can make LMDB read past the end of the mapped file, which kills the process (SIGBUS)
instead of raising. A shard whose bytes differ from ``store.json`` is therefore checked in a child; the
child streams its findings, so those made before it died are kept.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from medload.storage.verify_report import RESTORE, Damage, VerifyReport
from medload.storage.verify_shard import shard_records, shard_values

T = TypeVar("T")

__all__ = ["run_check"]

_CHECKS = {fn.__name__: fn for fn in (shard_records, shard_values)}


def run_check(report: VerifyReport, isolated: bool, shard: str, fn: Callable[..., T], *args: Any) -> T | None:
    """``fn(report, *args)`` (one of :mod:`~medload.storage.verify_shard`'s checks) here or, when
    ``isolated``, in a child process; its result, or None when the child died (named as damage)."""
    if not isolated:
        return fn(report, *args)
    path = os.pathsep.join(filter(None, (str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH"))))
    proc = subprocess.run([sys.executable, "-c", "from medload.storage.verify_isolated import _child; _child()"],
                          input=pickle.dumps((fn.__name__, args)), capture_output=True,
                          env={**os.environ, "PYTHONPATH": path})
    stream, result = io.BytesIO(proc.stdout), None
    while True:
        try:
            item = pickle.load(stream)
        except (EOFError, pickle.UnpicklingError):
            break
        if isinstance(item, Damage):
            report.damage.append(item)
        else:
            result, slices = item
            report.slices += slices
    if proc.returncode == 0:
        return result
    why = (f"killed the reader ({signal.Signals(-proc.returncode).name}): its B-tree points outside the file"
           if proc.returncode < 0 else f"failed: {proc.stderr.decode(errors='replace').strip().splitlines()[-1:]}")
    report.add_unreadable(shard, f"checking its {fn.__name__.removeprefix('shard_')} {why}; {RESTORE}")
    return None


class _Emit(list):
    """The damage list of the child process: each finding is written to the parent at once."""

    def append(self, item: Damage) -> None:
        pickle.dump(item, sys.stdout.buffer)
        sys.stdout.buffer.flush()


def _child() -> None:
    """Entry of :func:`run_check`'s child: a pickled (check name, arguments) on stdin; findings, then the
    (result, slices) pair on stdout. Pickle only travels between these two processes, never to disk."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # dying of SIGBUS is expected here: no core dump
    name, args = pickle.load(sys.stdin.buffer)
    found = VerifyReport("", damage=_Emit())
    result = _CHECKS[name](found, *args)
    pickle.dump((result, found.slices), sys.stdout.buffer)
