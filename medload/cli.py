"""``medload`` command line: a thin surface over the package (no logic lives only here)."""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from pathlib import Path

import click
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from medload.config import IngestConfig, parse_size
from medload.errors import MedloadError
from medload.storage.codec import CODECS, DEFAULT_CODEC

__all__ = ["main"]

# Not a terminal (a pipe, a log file): wide enough that tables and messages do not wrap.
_out = Console(width=None if sys.stdout.isatty() else 160)
_err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _short(key: str) -> str:
    return key[:12]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """medload: CT/DICOM archives to an LMDB slice store for PyTorch/MONAI training."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(message)s", handlers=[RichHandler(console=_err, show_path=False)])


@cli.command()
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--workers", type=int, default=None, help="Decoding processes (default: all cores; 1: in-process).")
@click.option("--windows", default="", help="Also store uint8 planes for these windows, e.g. lung,soft_tissue,350/50.")
@click.option("--codec", type=click.Choice(sorted(CODECS)), default=DEFAULT_CODEC, show_default=True,
              help="Slice codec of a new store.")
@click.option("--tilt-policy", type=click.Choice(["reject", "shear"]), default="reject", show_default=True,
              help="Gantry-tilted (sheared) stacks: reject, or keep with the sheared affine.")
@click.option("--shard-size", default="4GB", show_default=True, help="Publish a shard past this size.")
@click.option("--key-file", type=click.Path(path_type=Path), default=None,
              help="Pseudonymisation key (default $MEDLOAD_KEY_FILE or ~/.config/medload/pseudonym.key).")
@click.option("--strict", is_flag=True, help="Exit 1 if any input was rejected.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def ingest(sources: tuple[Path, ...], store: Path, workers: int | None, windows: str, codec: str, tilt_policy: str,
           shard_size: str, key_file: Path | None, strict: bool, no_progress: bool) -> None:
    """Ingest DICOM files, folders and zip/tar archives (SOURCES) into STORE."""
    from medload.ingest.run import ingest as run_ingest

    cfg = IngestConfig(workers=workers, codec=codec, windows=tuple(w for w in windows.split(",") if w),
                       tilt_policy=tilt_policy, shard_bytes=parse_size(shard_size), strict=strict)
    report = run_ingest(list(sources), store, config=cfg, key_file=key_file, progress=not no_progress)
    _print_ingest_summary(report)
    sys.exit(report.exit_code(strict))


def _print_ingest_summary(report) -> None:
    table = Table(title=f"ingest into {report.store}")
    for col in ("series", "status", "modality", "shape (D,H,W)", "reason"):
        table.add_column(col)
    for s in report.series:
        shape = "x".join(map(str, s.shape)) if s.shape else f"{s.planes} planes"
        table.add_row(_short(s.key), s.status, s.modality, shape, s.reason or "")
    _out.print(table)
    files = [r for r in report.rejects if r.series is None]
    for status in ("skipped", "rejected"):
        reasons = Counter(r.reason for r in files if r.status == status)
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            example = next(r.source for r in files if r.status == status and r.reason == reason)
            _out.print(f"  {status} {n} file(s): {reason}  [e.g. {example}]")
    c = report.counts
    _out.print(
        f"[bold]{c['ingested']} ingested, {c['present']} already present, {c['skipped']} skipped, "
        f"{c['rejected']} rejected[/bold]"
        + (f", {c['conflict']} in conflict" if c["conflict"] else "")
        + f"; {len(files)} file(s) quarantined; {report.files} files, {report.bytes / 1e6:.1f} MB in "
        f"{report.seconds:.1f} s ({report.files_per_second:.0f} files/s, {report.megabytes_per_second:.0f} MB/s)"
    )


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
def info(store: Path) -> None:
    """Summary of STORE: format, shards, series, quarantine."""
    from medload.storage.store import open_store

    st = open_store(store)
    m = st.manifest
    records = st.series()
    _out.print(f"[bold]{store}[/bold]: format v{m.version}, codec {m.codec}, windows {', '.join(m.windows) or 'none'}, "
               f"{len(m.shards)} shard(s), {sum(s.bytes for s in m.shards) / 1e6:.1f} MB, created by {m.created_by}")
    table = Table()
    for col in ("series", "modality", "shape (D,H,W)", "spacing mm (x,y,z)", "dtype", "manufacturer", "kernel", "flags"):
        table.add_column(col)
    for r in records:
        table.add_row(_short(r.key), r.modality, "x".join(map(str, r.shape)), ", ".join(f"{v:.3g}" for v in r.spacing),
                      r.dtype, r.manufacturer or "", r.kernel or "", ", ".join(r.flags))
    _out.print(table)
    counts = Counter((r.status, r.stage) for r in st.rejects())
    if counts:
        _out.print("quarantine: " + "; ".join(f"{n} {status} at {stage}" for (status, stage), n in sorted(counts.items()))
                   + f" (details: medload rejects {store} --all)")
    _out.print(f"{len(records)} series, {sum(r.shape[0] for r in records)} slices")


@cli.command(name="ls")
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON array of series records.")
def ls_(store: Path, as_json: bool) -> None:
    """List the series of STORE (keys, shapes, geometry, digests)."""
    from medload.storage.store import open_store

    records = open_store(store).series()
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in records], indent=1))
        return
    for r in records:
        click.echo(f"{r.key}  {r.modality:3s} {'x'.join(map(str, r.shape)):>14s}  digest {r.digest}")


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.argument("key")
@click.argument("out", type=click.Path(path_type=Path))
def export(store: Path, key: str, out: Path) -> None:
    """Write series KEY (a unique key prefix is enough) of STORE as NIfTI to OUT (.nii or .nii.gz)."""
    from medload.storage.nifti import export_nifti
    from medload.storage.store import open_store

    path = export_nifti(open_store(store), key, out)
    _out.print(f"wrote {path}")


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON array of quarantine records.")
@click.option("--all", "include_skipped", is_flag=True, help="Include skipped inputs (localizers, reports...).")
def rejects(store: Path, as_json: bool, include_skipped: bool) -> None:
    """Inputs of STORE that were rejected (and with --all, skipped), with stage and reason."""
    from dataclasses import asdict

    from medload.storage.store import open_store

    records = open_store(store).rejects(include_skipped=include_skipped)
    if as_json:
        click.echo(json.dumps([asdict(r) for r in records], indent=1))
        return
    table = Table()
    for col in ("status", "stage", "source", "reason"):
        table.add_column(col)
    for r in records:
        table.add_row(r.status, r.stage, r.source, r.reason)
    _out.print(table)


def main() -> None:
    """Entry point of the ``medload`` console script."""
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except MedloadError as exc:
        _err.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
