"""The ``medload`` command group, its console output and its entry point."""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from medload.allocator import keep_large_buffers_in_heap
from medload.cli.failures import report, stop_on_sigterm
from medload.config import load_config, parse_size
from medload.errors import ConfigError

__all__ = ["cli", "main", "console", "err_console", "short", "size", "read_config", "renamed", "Device", "Suffix"]

# Not a terminal (a pipe, a log file): wide enough that tables and messages do not wrap.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def short(key: str) -> str:
    """The first 12 hex digits of a series key: enough to name it on screen (and as a key prefix)."""
    return key[:12]


def size(value: str | None) -> int | None:
    """Bytes from a size option such as ``4GB``, or None when the option was not given."""
    return None if value is None else parse_size(value)


class Device(click.ParamType):
    """A torch device this machine has: ``cpu``, ``cuda`` or ``cuda:N`` (kept as text)."""

    name = "device"

    def convert(self, value, param, ctx):
        from medload.devices import checked_device

        try:
            checked_device(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


class Suffix(click.Path):
    """A file path to write whose name ends with one of ``suffixes`` (``.nii``, ``.png``...)."""

    def __init__(self, *suffixes: str) -> None:
        super().__init__(dir_okay=False, path_type=Path)
        self.suffixes = suffixes

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        if not str(path).lower().endswith(self.suffixes):
            self.fail(f"{value}: the file name must end with {' or '.join(self.suffixes)}", param, ctx)
        return path


def _warn(message: str) -> None:
    """A warning on stderr, as plain text (messages hold brackets such as ``[cache]``)."""
    err_console.print(f"[yellow]warning:[/yellow] {escape(message)}", soft_wrap=True, highlight=False)


def read_config(path: Path | None):
    """:func:`~medload.config.load_config`, its warnings (old key names) shown on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        config = load_config(path)
    for w in caught:
        _warn(str(w.message))
    return config


def renamed(old: str, new: str):
    """Decorator of a command: the option ``old`` is the old spelling of ``new``, hidden from ``--help``
    and still accepted, with a warning on stderr, until the next release."""
    old_name, new_name = (flag.lstrip("-").replace("-", "_") for flag in (old, new))

    def decorate(fn):
        @functools.wraps(fn)
        def command(*args, **kwargs):
            value = kwargs.pop(old_name)
            if value is not None:
                if click.get_current_context().get_parameter_source(new_name) is ParameterSource.COMMANDLINE:
                    raise click.UsageError(f"{old} and {new} are one option: give {new} only")
                _warn(f"{old} is now {new}; the old spelling stops working in the next release")
                kwargs[new_name] = value
            return fn(*args, **kwargs)

        return click.option(old, old_name, default=None, hidden=True)(command)

    return decorate


class _Run:
    """How this run reports an error (set from the group's options)."""

    show_traceback = False


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug); an error shows its traceback.")
@click.option("--debug", is_flag=True, help="Debug log output, and the traceback of an error (as -vv).")
@click.version_option(package_name="medload", message="medload %(version)s")
@click.option("--config", "config_file", type=click.Path(exists=True, path_type=Path), default=None,
              help="TOML settings ([ingest], [cache], [loader]); command-line flags override them.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, debug: bool, config_file: Path | None) -> None:
    """medload: CT/DICOM archives to an LMDB slice store for PyTorch/MONAI training.

    An error ends a command with one line (what went wrong, what to do) and exit code 2 (70: a bug);
    -v or --debug adds its traceback.
    """
    verbose = 2 if debug else verbose
    _Run.show_traceback = verbose > 0
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    # the handler has the level too: libraries that set their own loggers to INFO (Dask does) stay quiet without -v
    handler = RichHandler(console=err_console, show_path=False, level=level)
    logging.basicConfig(level=level, format="%(message)s", handlers=[handler])
    ctx.obj = read_config(config_file)


def main() -> None:
    """Entry point of the ``medload`` console script: every error ends it as :mod:`medload.cli.failures` says."""
    keep_large_buffers_in_heap()  # our own process: slice-sized buffers are reused, not mapped anew each time
    stop_on_sigterm()
    try:
        cli(standalone_mode=False)
    except SystemExit:
        raise
    except BrokenPipeError:  # the reader of our output went away (`medload ls STORE | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except BaseException as exc:  # noqa: BLE001 -- the one place every error of a command ends up
        sys.exit(report(exc, err_console, show_traceback=_Run.show_traceback))

