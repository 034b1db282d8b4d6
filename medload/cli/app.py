"""The ``medload`` command group, its console output and its entry point."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.logging import RichHandler

from medload.allocator import keep_large_buffers_in_heap
from medload.config import load_config, parse_size
from medload.errors import MedloadError

__all__ = ["cli", "main", "console", "err_console", "short", "size"]

# Not a terminal (a pipe, a log file): wide enough that tables and messages do not wrap.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def short(key: str) -> str:
    """The first 12 hex digits of a series key: enough to name it on screen (and as a key prefix)."""
    return key[:12]


def size(value: str | None) -> int | None:
    """Bytes from a size option such as ``4GB``, or None when the option was not given."""
    return None if value is None else parse_size(value)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--config", "config_file", type=click.Path(exists=True, path_type=Path), default=None,
              help="TOML settings ([ingest], [cache]); command-line flags override them.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, config_file: Path | None) -> None:
    """medload: CT/DICOM archives to an LMDB slice store for PyTorch/MONAI training."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(message)s", handlers=[RichHandler(console=err_console, show_path=False)])
    ctx.obj = load_config(config_file)


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
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        sys.exit(2)

