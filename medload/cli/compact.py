"""``medload compact``: reclaim the space of superseded copies (left by ``ingest --force`` and ``repair``)."""

from __future__ import annotations

from pathlib import Path

import click

from medload.cli.app import cli
from medload.config import format_size


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def compact(store: Path, no_progress: bool) -> None:
    """Rewrite the shards of STORE that hold superseded copies, keeping every live series bit for bit; the
    store must verify clean first. Safe to kill at any moment: the next writer tidies what it left."""
    from medload.storage.compact import compact_store

    result = compact_store(store, progress=not no_progress)
    for s in result.shards:
        copies = f"{s.superseded} superseded cop{'y' if s.superseded == 1 else 'ies'}"
        if s.new is None:
            click.echo(f"removed  shard {s.old}: it held only {copies} ({format_size(s.bytes_before)})")
        else:
            click.echo(f"rewrote  shard {s.old} as {s.new}: {copies} dropped, "
                       f"{format_size(s.bytes_before)} -> {format_size(s.bytes_after)}")
    if result.shards:
        click.echo(f"{store}: {len(result.shards)} shard(s) compacted: {format_size(result.bytes_before)} -> "
                   f"{format_size(result.bytes_after)} of shards")
    else:
        click.echo(f"{store}: nothing to compact (no superseded copies); {format_size(result.bytes_after)} of shards")
