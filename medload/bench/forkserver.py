"""Fresh processes without paying the imports each time: a server imports the heavy modules once and
forks one child per run.

Importing torch, MONAI and medload takes 2-4 s on a small machine; a benchmark of 30-40 runs would
spend minutes on imports alone. A :class:`ForkServer` is a process that has done the imports of one
group of contenders (``modules``) and nothing else; each run is a child forked from it -- a fresh
process with no state of any other run, started as a DataLoader worker is -- which calls
``target(arg)`` (``"module:function"``) with its stdout and stderr in a log file, and exits.

Memory: right after the fork the child shares the server's pages (its imports), and PSS splits each
shared page between the two. The benchmark therefore samples the PSS of the server *and* its children
(:class:`~medload.bench.common.peak_pss` on :attr:`ForkServer.pid`): shared pages count once, as they
would in a standalone process that did the same imports. So that no contender pays for imports it
does not need, contenders without MONAI run from a server that never imported it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import traceback
from importlib import import_module
from pathlib import Path
from typing import IO, cast

__all__ = ["ForkServer"]


class ForkServer:
    """A server process that imported ``modules``; :meth:`run` forks a child per call."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = list(modules)
        self.proc = subprocess.Popen([sys.executable, "-m", "medload.bench.forkserver", *self.modules],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        # both are pipes (PIPE above), never None
        self._stdin, self._stdout = cast(IO[str], self.proc.stdin), cast(IO[str], self.proc.stdout)
        ready = self._stdout.readline().strip()
        if ready != "ready":
            self.close()
            raise RuntimeError(f"fork server for {self.modules} did not start ({ready or 'no answer'})")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, target: str, arg: str, log: Path, timeout: float) -> tuple[int | None, bool]:
        """Fork a child that calls ``target(arg)``; wait at most ``timeout`` s (then kill it).
        Returns (exit code or None, timed out)."""
        self._stdin.write(json.dumps({"target": target, "arg": arg, "log": str(log)}) + "\n")
        self._stdin.flush()
        child = json.loads(self._stdout.readline())["pid"]
        ready, _, _ = select.select([self._stdout], [], [], timeout)
        timed_out = not ready
        if timed_out:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        line = self._stdout.readline()
        if not line:
            raise RuntimeError(f"fork server for {self.modules} ended (exit status {self.proc.poll()})")
        return json.loads(line)["exit"], timed_out

    def close(self) -> None:
        if self.proc.poll() is None:
            self._stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child(request: dict) -> int:
    """In the forked child: logs to the request's file, calls the target, returns the exit code."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        module, func = request["target"].rsplit(":", 1)
        getattr(import_module(module), func)(request["arg"])
        return 0
    except BaseException:  # the log says what happened; the exit status says that it did
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve(modules: list[str]) -> None:
    """The server: import ``modules``, say ``ready``, then fork a child per request line on stdin."""
    for name in modules:
        import_module(name)
    out = sys.stdout
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request))
        print(json.dumps({"pid": pid}), file=out, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), file=out, flush=True)


if __name__ == "__main__":
    serve(sys.argv[1:])
