"""Decoding processes under supervision: an input that crashes, exhausts or hangs its decoder costs
that input, never the run.

:class:`IsolatedPool` runs tasks (a batch of headers, a chunk of planes) in worker processes it
starts and watches. A task walks through its inputs and says which one it is on (:func:`mark`: one
store to a shared counter, no system call). When a worker dies -- a segfault in a C decoder, the
kernel's OOM killer -- or one input runs past the timeout (the worker is then killed), the task's
result is a :class:`Lost` naming that input and what happened; the worker is replaced, the tasks
queued behind it run as usual, and the caller quarantines the input and re-runs the rest of the task.

Memory cap: each worker limits its data segment (``RLIMIT_DATA``: heap and private writable
mappings, Linux >= 4.7) to the cap, so an allocation past it fails -- Python raises MemoryError, a C
decoder's malloc returns NULL -- before the kernel's OOM killer picks a victim. Not ``RLIMIT_AS``:
a worker's address space is several times its data (docs/benchmarks.md, "Design measurements"): shared libraries,
glibc's 64 MB arena reservations and the writer's shared-memory ring (4 x workers + 8 slots of up to
64 MB, ``MAP_SHARED``) all count in it, yet none is memory the worker allocates. A worker
forked late inherits the writer's heap (its header lists grow with the archive): if that is more
than half the cap, the worker gets half the cap on top of what it inherited.

Tasks go over one pipe per worker, at most two at a time (one running, one waiting, so a worker never
idles while this process writes) and never more bytes than the pipe holds unread, so this process
never blocks sending while a worker blocks sending its result; further tasks wait here and go to
whichever worker frees first. Workers are forked where available (Linux), before the store is
opened (py-lmdb's fork rule); replacements are forked later, each closing every pipe end it inherited
but its own. A worker exits when its pipe ends, and on Linux is killed when this process dies.
"""

from __future__ import annotations

import ctypes
import faulthandler
import fcntl
import logging
import multiprocessing as mp
import os
import resource
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from medload.config import format_size
from medload.errors import MedloadError

if TYPE_CHECKING:
    from multiprocessing.context import ForkContext, SpawnContext

__all__ = ["IsolatedPool", "Job", "Lost", "death_reason", "die_with_parent", "mark"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
#: a worker's shared progress marker: a RawValue("q"), read and written through ``.value``
Marker = ctypes.c_longlong
_T_co = TypeVar("_T_co", covariant=True)
_A = TypeVar("_A")

_INPUT_BITS = 24                 # a marker is (task sequence number << 24) | input index
_PIPE_BYTES = 1 << 20            # asked for each task pipe (Linux allows up to fs.pipe-max-size, 1 MB)
_QUEUED = 2                      # tasks sent to one worker at a time (default): one running, one in its pipe
_START_FAILURES = 3              # workers in a row dying before their first input: give up
_STOP_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1            # prctl(2)


# ---- the worker's side ----------------------------------------------------------------------------
class _Marker:
    """This process's shared counter (None outside a pool worker) and its current task."""

    value: Marker | None = None
    task = 0


def mark(index: int) -> None:
    """Tell the supervisor that the current task has started its input ``index`` (no-op elsewhere)."""
    if _Marker.value is not None:
        _Marker.value.value = (_Marker.task << _INPUT_BITS) | min(index, (1 << _INPUT_BITS) - 1)


@dataclass(frozen=True)
class _Raised:
    """A task raised (a bug: tasks report bad inputs in their result); re-raised by :meth:`IsolatedPool.wait`."""

    text: str


def _limit_data(cap: int) -> None:
    """Cap this process's data segment at ``cap`` bytes, or at what it holds now + cap/2 if that is more."""
    try:
        with open("/proc/self/status") as status:
            held = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return  # not Linux: the pool warned when it started
    limit = cap
    if held > cap // 2:
        limit = held + cap // 2
        log.warning("a decoding process inherited %s of data: it may allocate %s more (half of --worker-memory)",
                    format_size(held), format_size(cap // 2))
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def die_with_parent() -> None:
    """Linux: be killed when the supervisor dies (even by SIGKILL), rather than decode on, orphaned,
    until the end of the pipe shows. Elsewhere the end of the pipe alone stops a worker."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _serve(tasks: Connection, results: Connection, marker: Marker, memory: int, initializer: Callable, initargs: tuple,
           inherited: list[Connection]) -> None:
    """A worker's life: run tasks until told to stop or until the supervisor's end of the pipe closes."""
    for conn in inherited:
        conn.close()
    # A crash here is the supervisor's to report: it quarantines the input with the signal. A fault
    # handler inherited from the parent (pytest enables one) would only dump every thread's stack.
    faulthandler.disable()
    die_with_parent()
    # the supervisor stops workers: Ctrl-C and SIGTERM (the CLI's handler of it is inherited) are for it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    initializer(*initargs)
    if memory:
        _limit_data(memory)
    _Marker.value = marker
    while True:
        try:
            message = ForkingPickler.loads(tasks.recv_bytes())
        except EOFError:
            return
        if message is None:
            return
        seq, fn, arg = message
        _Marker.task = seq
        mark(0)
        try:
            result = fn(arg)
        except Exception as exc:  # noqa: BLE001 -- handed to the caller, who re-raises it
            result = _Raised("".join(traceback.format_exception(exc)))
        try:
            results.send_bytes(ForkingPickler.dumps((seq, result)))
        except OSError:
            return


# ---- the supervisor's side ------------------------------------------------------------------------
@dataclass(frozen=True)
class Lost:
    """The result of a task whose worker died, or was stopped, while on its input ``index``."""

    index: int
    reason: str


class Job(Generic[_T_co]):
    """A submitted task; ``result`` is set once ``done``. ``payload``, the pickled task, exists from its
    dispatch until its result is in. ``Job[T]``: ``fn`` returns a ``T``."""

    __slots__ = ("seq", "fn", "arg", "payload", "done", "result")

    def __init__(self, seq: int, fn: Callable[..., _T_co], arg: object) -> None:
        self.seq, self.fn, self.arg = seq, fn, arg
        self.payload: bytes | None = None
        self.done = False
        self.result: object = None

    def pickled(self) -> bytes:
        if self.payload is None:
            self.payload = bytes(ForkingPickler.dumps((self.seq, self.fn, self.arg)))
        return self.payload


class _Worker:
    """One worker process, its two pipes, and the tasks sent to it (in order) and not yet answered."""

    def __init__(self, process: BaseProcess, tasks: Connection, results: Connection, marker: Marker) -> None:
        self.process, self.tasks, self.results, self.marker = process, tasks, results, marker
        try:
            self.capacity = fcntl.fcntl(tasks.fileno(), fcntl.F_GETPIPE_SZ)
        except (AttributeError, OSError):
            self.capacity = 0  # unknown (not Linux): send only to an idle worker
        self.sent: deque[Job[object]] = deque()
        self.sent_bytes = 0
        self.seen = marker.value
        self.since = time.monotonic()


def death_reason(exitcode: int | None, process: str = "decoder process") -> str:
    """Why a worker process ended, from its exit code (negative: the signal that killed it)."""
    if exitcode is not None and exitcode < 0:
        number = -exitcode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown signal"
        hint = "; the system's out-of-memory killer sends it" if number == signal.SIGKILL else ""
        return f"{process} killed by signal {number} ({name}{hint})"
    return f"{process} exited with status {exitcode}"


class IsolatedPool:
    """``workers`` supervised processes running ``initializer(*initargs)`` once, then tasks.

    ``memory``: data-segment cap per worker in bytes (0: none); ``timeout``: seconds one input may
    take (0: no limit); ``size``: the number of workers; ``queued``: how many tasks one worker may hold
    (one running, the rest waiting in its pipe; a caller that stops taking results for a while, a writer
    committing, raises it so that the workers work on meanwhile). Use as a context manager; :meth:`submit` tasks, then :meth:`wait` for each (while
    waiting for one, the pool takes in the results of all). A task's result is what ``fn(arg)``
    returned, or a :class:`Lost`.
    """

    def __init__(self, workers: int, initializer: Callable, initargs: tuple, *, memory: int = 0,
                 timeout: float = 0.0) -> None:
        self._ctx: ForkContext | SpawnContext = (
            mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context("spawn"))
        self.size, self.queued = workers, _QUEUED
        self._init = (initializer, initargs)
        self._memory, self._timeout = memory, timeout
        self._tick = min(1.0, max(0.05, timeout / 20)) if timeout else None
        self._pending: deque[Job[object]] = deque()
        self._seq = 0
        self._start_failures = 0
        if memory and not os.path.exists("/proc/self/status"):
            log.warning("the worker memory cap needs Linux (RLIMIT_DATA, /proc): decoding runs without it")
        self._workers: list[_Worker] = []
        for _ in range(workers):
            self._workers.append(self._start())

    def __enter__(self) -> IsolatedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- tasks ----
    def submit(self, fn: Callable[[_A], _T], arg: _A) -> Job[_T]:
        """Queue ``fn(arg)`` (``fn`` a module-level function, ``arg`` picklable)."""
        self._seq += 1
        job = Job(self._seq, fn, arg)
        self._pending.append(job)
        self._dispatch()
        return job

    def wait(self, job: Job[_T]) -> _T | Lost:
        """The result of ``job``, once it is in."""
        while not job.done:
            self._pump()
        if isinstance(job.result, _Raised):
            raise RuntimeError(f"{job.fn.__name__} failed in a decoding process:\n{job.result.text}")
        return cast("_T | Lost", job.result)  # done: what fn(arg) returned in a worker, or a Lost (_finish)

    def close(self) -> None:
        """Stop the workers: idle ones are asked to exit, busy ones (after an error) are killed."""
        for w in self._workers:
            if w.sent:
                w.process.kill()
            else:
                try:
                    w.tasks.send_bytes(ForkingPickler.dumps(None))
                except OSError:
                    pass
        deadline = time.monotonic() + _STOP_SECONDS
        for w in self._workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.tasks.close()
            w.results.close()
        self._workers = []

    # ---- supervision ----
    def _start(self) -> _Worker:
        tasks_r, tasks_w = self._ctx.Pipe(duplex=False)
        results_r, results_w = self._ctx.Pipe(duplex=False)
        for end in (tasks_w, results_w):  # results too: a worker blocks on a full pipe while the writer commits
            try:
                fcntl.fcntl(end.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
            except (AttributeError, OSError):
                pass  # not Linux, or the user's pipe quota is spent: the default size works, with less queued
        marker = self._ctx.RawValue("q", -1)
        inherited = [c for w in self._workers for c in (w.tasks, w.results)] + [tasks_w, results_r]
        process = self._ctx.Process(target=_serve, name="medload-decoder", daemon=True, args=(
            tasks_r, results_w, marker, self._memory, *self._init,
            inherited if self._ctx.get_start_method() == "fork" else []))
        process.start()
        tasks_r.close()
        results_w.close()
        return _Worker(process, tasks_w, results_r, marker)

    def _room(self, w: _Worker, job: Job[object]) -> bool:
        """Whether ``w`` may take ``job`` now: it is idle (it reads whatever it is sent), or holds fewer than
        :attr:`queued` tasks and ``job`` fits in its pipe unread. The rest wait here, for whichever worker
        frees first."""
        return not w.sent or (len(w.sent) < self.queued and w.sent_bytes + len(job.pickled()) + 16 <= w.capacity)

    def _dispatch(self) -> None:
        while self._pending:
            job = self._pending[0]
            ready = [w for w in self._workers if self._room(w, job)]
            if not ready:
                return
            w = min(ready, key=lambda w: len(w.sent))
            self._pending.popleft()
            if not w.sent:
                w.since = time.monotonic()
            w.sent.append(job)
            w.sent_bytes += len(job.pickled()) + 16
            try:
                w.tasks.send_bytes(job.pickled())
            except OSError:
                self._replace(w, None)  # it died; its tasks, this one included, are handled there

    def _pump(self) -> None:
        """Wait for results, deaths or the next timeout check, and act on them."""
        self._dispatch()
        busy = [w for w in self._workers if w.sent]
        if not busy and not self._pending:
            raise RuntimeError("waiting for a task that was never submitted to this pool")
        waitables = {w.results: w for w in busy} | {w.process.sentinel: w for w in self._workers}
        for ready in wait(list(waitables), self._tick):
            w = waitables[cast("Connection | int", ready)]  # wait() returns the objects it was given
            if w in self._workers:  # not replaced already in this round
                self._receive(w)
        if self._timeout:
            self._check_timeouts()
        self._dispatch()

    def _receive(self, w: _Worker) -> None:
        """Take the results ``w`` has sent; replace it if it is gone (its end of the pipe is closed)."""
        if not self._drain(w):
            self._replace(w, None)

    def _drain(self, w: _Worker) -> bool:
        """Settle the jobs ``w`` has answered; False once its pipe has ended (it exited)."""
        try:
            while w.results.poll():
                seq, result = ForkingPickler.loads(w.results.recv_bytes())
                job = w.sent.popleft()
                if job.seq != seq:
                    raise RuntimeError(f"decoding process answered task {seq}, expected {job.seq}")
                w.sent_bytes -= len(job.pickled()) + 16  # its payload, kept while it is in the pipe
                self._finish(job, result)
                self._start_failures = 0
                w.since = time.monotonic()
        except (EOFError, OSError):
            return False
        return True

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if not w.sent:
                continue
            value = w.marker.value
            if value != w.seen:
                w.seen, w.since = value, now
            elif now - w.since > self._timeout:
                w.process.kill()
                self._replace(w, f"took longer than {self._timeout:g} s (--decode-timeout)")

    def _replace(self, w: _Worker, reason: str | None) -> None:
        """``w`` is dead (or killed): settle its tasks and start another worker in its place."""
        self._drain(w)
        w.process.join()
        reason = reason or death_reason(w.process.exitcode)
        w.tasks.close()
        w.results.close()
        value = w.marker.value
        if w.sent and value >= 0 and value >> _INPUT_BITS == w.sent[0].seq:
            self._finish(w.sent.popleft(), Lost(value & ((1 << _INPUT_BITS) - 1), reason))
            self._start_failures = 0
        elif value < 0:  # it died before its first input: nothing to blame
            self._start_failures += 1
            if self._start_failures >= _START_FAILURES:
                self._workers.remove(w)
                raise MedloadError(f"decoding processes die before their first input ({reason}): if "
                                   "--worker-memory is small, raise it")
        self._pending.extendleft(reversed(w.sent))
        log.info("replacing a decoding process: %s", reason)
        self._workers[self._workers.index(w)] = self._start()

    @staticmethod
    def _finish(job: Job[object], result: object) -> None:
        job.result, job.done, job.payload = result, True, None
