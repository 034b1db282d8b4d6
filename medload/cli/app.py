"""The ``medload`` command group, its console output and its entry point."""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from medload.allocator import keep_large_buffers_in_heap
from medload.config import load_config, parse_size
from medload.errors import MedloadError

__all__ = ["cli", "main", "console", "err_console", "short", "size", "read_config", "renamed"]

# Not a terminal (a pipe, a log file): wide enough that tables and messages do not wrap.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def short(key: str) -> str:
    """The first 12 hex digits of a series key: enough to name it on screen (and as a key prefix)."""
    return key[:12]


def size(value: str | None) -> int | None:
    """Bytes from a size option such as ``4GB``, or None when the option was not given."""
    return None if value is None else parse_size(value)


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--config", "config_file", type=click.Path(exists=True, path_type=Path), default=None,
              help="TOML settings ([ingest], [cache]); command-line flags override them.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, config_file: Path | None) -> None:
    """medload: CT/DICOM archives to an LMDB slice store for PyTorch/MONAI training."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(message)s", handlers=[RichHandler(console=err_console, show_path=False)])
    ctx.obj = read_config(config_file)


def main() -> None:
    """Entry point of the ``medload`` console script."""
    keep_large_buffers_in_heap()  # our own process: slice-sized buffers are reused, not mapped anew each time
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except MedloadError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True, highlight=False)
        sys.exit(2)

