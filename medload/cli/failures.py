"""How an error ends a ``medload`` command: one line on stderr saying what went wrong and what to do, and
an exit code; the traceback too only when asked for (``-v`` or ``--debug``).

Exit codes: 0 done; 1 done, but something needs attention (``verify`` found damage, ``ingest --strict``
rejected inputs...); 2 an error stopped the command (a medload error, a bad option, a file that cannot
be read or written, a full disk); 3 the store was written by a newer medload (upgrade medload: the store
is not damaged); 70 an unexpected error, which is a bug to report; 130 interrupted (Ctrl-C, SIGINT); 143
terminated (SIGTERM). A signal stops a command as an error does: what it had committed stays, what it had
begun is tidied away.
"""

from __future__ import annotations

import errno
import signal
import sys
import traceback

import click
from rich.console import Console
from rich.markup import escape

from medload.errors import MedloadError, StoreTooNewError

__all__ = ["ERROR", "TOO_NEW", "BUG", "INTERRUPTED", "TERMINATED", "Terminated", "stop_on_sigterm", "report"]

ERROR = 2
TOO_NEW = 3
BUG = 70
INTERRUPTED = 130
TERMINATED = 128 + signal.SIGTERM

_OS_ADVICE = {
    errno.ENOSPC: "free space there, then run the same command again",
    errno.EDQUOT: "free space within your quota there, then run the same command again",
    errno.EACCES: "check the permissions of that path, or give another one",
    errno.EPERM: "check the permissions of that path, or give another one",
    errno.EROFS: "that filesystem is read-only: give a path on a writable one",
    errno.ENOENT: "check the path (a folder on it may not exist)",
    errno.ENOTDIR: "check the path: a part of it is a file, not a folder",
    errno.EISDIR: "check the path: it is a folder, and a file was expected",
    errno.EEXIST: "check the path: something of that name is in the way (a file where a folder is expected?)",
}


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM (:func:`stop_on_sigterm`): it unwinds the command as Ctrl-C's
    KeyboardInterrupt does, running the same clean-up. Not a KeyboardInterrupt, which click answers with a
    blank line for the terminal's ``^C`` echo."""


def _raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM, during the clean-up, ends the process at once
    raise Terminated()


def stop_on_sigterm() -> None:
    """Make SIGTERM stop this process as Ctrl-C does (instead of ending it on the spot, leaving staging files)."""
    signal.signal(signal.SIGTERM, _raise_terminated)


def report(exc: BaseException, console: Console, *, show_traceback: bool) -> int:
    """Show ``exc`` as one ``error:`` line on ``console`` (after its traceback with ``show_traceback``);
    the exit code it ends the command with."""
    if isinstance(exc, (click.exceptions.Abort, KeyboardInterrupt)):
        _line(console, "interrupted")
        return INTERRUPTED
    if isinstance(exc, Terminated):
        _line(console, "terminated")
        return TERMINATED
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):  # `medload`, `medload cache`: the help it asks for
        exc.show()
        return exc.exit_code
    if isinstance(exc, click.ClickException):  # a bad option or argument
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if isinstance(exc, click.UsageError) and ctx else ""
        _line(console, exc.format_message() + hint)
        return exc.exit_code
    if show_traceback:
        traceback.print_exception(exc, file=sys.stderr)
    message, code = _explain(exc)
    _line(console, message)
    return code


def _explain(exc: BaseException) -> tuple[str, int]:
    """The message and exit code of an error that is not click's."""
    if isinstance(exc, MedloadError):
        return str(exc), TOO_NEW if isinstance(exc, StoreTooNewError) else ERROR
    if isinstance(exc, OSError) and exc.strerror:
        where = " ".join(f"{name}" for name in (exc.filename, exc.filename2) if name is not None)
        default = "check the path and the disk"
        advice = default if exc.errno is None else _OS_ADVICE.get(exc.errno, default)
        return f"{exc.strerror}{': ' + where if where else ''}: {advice}", ERROR
    if type(exc).__module__ == "lmdb":
        return (f"LMDB: {exc}: a file of the store may be damaged or unreadable: run `medload verify` on the "
                "store (add -v for the traceback)"), ERROR
    if isinstance(exc, MemoryError):
        return "out of memory: close other programs, or give fewer workers or smaller batches", ERROR
    return (f"unexpected {type(exc).__name__}: {exc} -- a bug in medload: run the command again with --debug and "
            "report the traceback it shows"), BUG


def _line(console: Console, message: str) -> None:
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
