"""``medload lineage check``: whether a store still holds exactly the data a lineage record names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from medload.cli.app import cli


@cli.group()
def lineage() -> None:
    """Lineage records: which series, with which content, a training run drew from (see docs/lineage.md)."""


@lineage.command()
@click.argument("record", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("store", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON object: record, series, ok, changes, notes.")
def check(record: Path, store: Path, as_json: bool) -> None:
    """Compare STORE with lineage RECORD series by series, naming each series that changed, is gone or cannot
    be read; exit 1 when any did, 0 when STORE holds exactly the recorded data."""
    from medload.lineage import check as compare
    from medload.lineage import load

    result = compare(load(record), store)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        sys.exit(0 if result.ok else 1)
    for c in result.changes:
        click.echo(f"{c.what}  {c.key}: {c.detail}")
    for note in result.notes:
        click.echo(f"note  {note}")
    counts = ", ".join(f"{sum(c.what == w for c in result.changes)} {w}" for w in dict.fromkeys(c.what for c in result.changes))
    state = (f"ok: all {result.series} series of lineage record {result.record[:12]} hold the recorded data" if result.ok
             else f"CHANGED: {counts} of the {result.series} series of lineage record {result.record[:12]}")
    click.echo(f"{store}: {state}")
    sys.exit(0 if result.ok else 1)
