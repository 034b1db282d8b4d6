"""``medload verify`` and ``medload repair``: find damage in a store, and re-ingest what it touched."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from medload.cli.app import cli
from medload.cli.options import key_file_option
from medload.config import MedloadConfig, with_overrides

if TYPE_CHECKING:
    from medload.deid import KeyFile


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.option("--deep", is_flag=True, help="Also match each slice's source-file hash with the files under --sources.")
@click.option("--sources", "source_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Folders or files of the original DICOM, for --deep (archives are not opened). Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: counts, damage, notes, ok.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def verify(store: Path, deep: bool, source_paths: tuple[Path, ...], as_json: bool, no_progress: bool) -> None:
    """Check STORE for damage, read-only, naming each finding; exit 1 when damaged, 0 when intact."""
    from medload.storage.verify import verify_store

    report = verify_store(store, deep=deep, sources=source_paths, progress=not no_progress)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=1))
    else:
        _print_findings(report, "damage")
        click.echo(f"{store}: {'ok' if report.ok else 'DAMAGED'}: {len(report.damage)} damage finding(s), "
                   f"{len(report.notes)} note(s); {report.shards} shard(s), {report.series} series, {report.slices} "
                   f"slices, {report.labels} label map(s) checked in {report.seconds:.1f} s")
    sys.exit(0 if report.ok else 1)


def _print_findings(report, prefix: str) -> None:
    """Each damage finding (after ``prefix``) and note, as plain text (no markup: details hold brackets)."""
    for d in report.damage:
        click.echo(f"{prefix}  {d}")
    for d in report.notes:
        click.echo(f"note  {d}")


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.option("--sources", "source_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Folders, files or archives holding the DICOM of the damaged series (a store keeps only hashes "
                   "of its sources, not their paths). Repeatable.")
@click.option("--labels", "label_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Labels of the damaged series, or lost ones (verify notes them), as for ingest --labels "
                   "(SEG/RTSTRUCT among --sources pair by themselves). Repeatable.")
@click.option("--workers", type=int, default=None, help="Decoding processes (default: one per usable core, as many as fit in memory).")
@key_file_option
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.pass_obj
def repair(config: MedloadConfig, store: Path, source_paths: tuple[Path, ...], label_paths: tuple[Path, ...],
           workers: int | None, key_file: KeyFile, no_progress: bool) -> None:
    """Verify STORE, ingest its damaged series again from --sources (replacing the damaged copies), retire
    shards that cannot be read to STORE/retired/, verify again; exit 0 only if STORE then verifies clean
    and no series lost its labels.
    A damaged store.json is restored from its copy first, and published shards it misses are adopted (no
    --sources needed for that alone, nor for storing lost labels again from --labels)."""
    from medload.ingest.repair import repair_store

    cfg = with_overrides(config.ingest, workers=workers)
    result = repair_store(store, source_paths, labels=label_paths, config=cfg, key_file=key_file,
                          progress=not no_progress)
    if result.restored:
        click.echo("restored  store.json from its copy store.json.bak")
    if result.upgraded:
        click.echo("upgraded  store.json to format 3: it lists the keys each shard holds")
    for name in result.adopted:
        click.echo(f"adopted   shard {name}: published but missing from store.json; its series are read again")
    if not result.needed:
        done = result.restored or result.upgraded or result.adopted
        click.echo(f"{store}: ok: no damage, nothing {'else ' if done else ''}to repair")
        sys.exit(0)
    for s in result.series:
        if s.status in ("replaced", "ingested"):
            click.echo(f"repaired  {s.key}: ingested again from the sources; the damaged copy is superseded")
        else:
            click.echo(f"not repaired  {s.key}: {s.status}: {s.reason or ''}")
    for name, note in result.retired.items():
        click.echo(f"retired   shard {name}: it cannot be read and its series are stored again; moved to "
                   f"{note.parent}/ with the note {note.name}")
    for name, why in result.not_retired.items():
        click.echo(f"not retired  shard {name}: {why}")
    for name in result.resealed:
        click.echo(f"resealed  shard {name}: every live value in it verifies; store.json records its present bytes")
    for o in result.labels:
        click.echo(f"labels    {o.key}: stored again from {o.source}")
    for key in result.labels_dropped:
        click.echo(f"labels lost  {key}: its stored labels went with an earlier copy: give them with --labels "
                   "(SEG/RTSTRUCT: with --sources)")
    lost = {("label", key) for key in result.labels_dropped}  # said above
    _print_findings(replace(result.after, notes=[n for n in result.after.notes if (n.kind, n.series) not in lost]),
                    "not repaired")
    state = "ok" if result.ok else "DAMAGED" if not result.after.ok else "LABELS LOST"
    click.echo(f"{store}: {state}: {len(result.before.damage)} damage finding(s) before, "
               f"{len(result.after.damage)} after; {sum(s.status in ('replaced', 'ingested') for s in result.series)} "
               f"series ingested again, {len(result.labels)} label map(s) stored again, {len(result.labels_dropped)} "
               f"lost, {len(result.resealed)} shard(s) resealed, {len(result.retired)} retired")
    sys.exit(0 if result.ok else 1)
