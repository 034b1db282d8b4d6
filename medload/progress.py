"""Progress bars for long work (ingest, verify, bench), drawn on stderr by rich; off by default."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["progress_bar"]


@contextmanager
def progress_bar(description: str, total: int, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; draws a bar with rate and ETA when ``enabled``, else does nothing."""
    if not enabled or total <= 0:
        def ignore(n: int = 1) -> None:
            """No bar: nothing to advance."""

        yield ignore
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            progress.advance(task, n)

        yield advance
