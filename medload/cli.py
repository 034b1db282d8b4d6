"""``medload`` command line: a thin surface over the package (no logic lives only here)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import click
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from medload.allocator import keep_large_buffers_in_heap
from medload.config import MedloadConfig, load_config, parse_size, with_overrides
from medload.errors import MedloadError
from medload.storage.codec import CODECS, DEFAULT_CODEC

__all__ = ["main"]

# Not a terminal (a pipe, a log file): wide enough that tables and messages do not wrap.
_out = Console(width=None if sys.stdout.isatty() else 160)
_err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def _short(key: str) -> str:
    return key[:12]


def _size(value: str | None) -> int | None:
    return None if value is None else parse_size(value)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--config", "config_file", type=click.Path(exists=True, path_type=Path), default=None,
              help="TOML settings ([ingest], [cache]); command-line flags override them.")
@click.pass_context
def cli(ctx: click.Context, verbose: int, config_file: Path | None) -> None:
    """medload: CT/DICOM archives to an LMDB slice store for PyTorch/MONAI training."""
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(message)s", handlers=[RichHandler(console=_err, show_path=False)])
    ctx.obj = load_config(config_file)


@cli.command()
@click.argument("sources", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--workers", type=int, default=None, help="Decoding processes (default: all cores; 1: in-process).")
@click.option("--windows", default=None, help="Also store uint8 planes for these windows, e.g. lung,soft_tissue,350/50.")
@click.option("--codec", type=click.Choice(sorted(CODECS)), default=None,
              help=f"Slice codec of a new store (default {DEFAULT_CODEC}).")
@click.option("--tilt-policy", type=click.Choice(["reject", "shear"]), default=None,
              help="Gantry-tilted (sheared) stacks: reject (default), or keep with the sheared affine.")
@click.option("--shard-size", default=None, help="Publish a shard past this size (default 4GB).")
@click.option("--key-file", type=click.Path(path_type=Path), default=None,
              help="Pseudonymisation key (default $MEDLOAD_KEY_FILE or ~/.config/medload/pseudonym.key).")
@click.option("--strict", is_flag=True, default=None, help="Exit 1 if any input was rejected.")
@click.option("--labels", "label_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Label masks (NIfTI/NRRD named after the SeriesInstanceUID or a key prefix), SEG/RTSTRUCT files, "
                   "or a mapping file (CSV/JSON with series,label). Repeatable. SEG/RTSTRUCT among SOURCES pair "
                   "with their series by themselves.")
@click.option("--roi-map", type=click.Path(exists=True, path_type=Path), default=None,
              help='JSON {"class": ["ROI name", ...]} giving RTSTRUCT ROIs consistent class ids.')
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.pass_obj
def ingest(config: MedloadConfig, sources: tuple[Path, ...], store: Path, workers: int | None, windows: str | None,
           codec: str | None, tilt_policy: str | None, shard_size: str | None, key_file: Path | None,
           strict: bool | None, label_paths: tuple[Path, ...], roi_map: Path | None, no_progress: bool) -> None:
    """Ingest DICOM files, folders and zip/tar archives (SOURCES) into STORE."""
    from medload.ingest.run import ingest as run_ingest

    cfg = with_overrides(config.ingest, workers=workers, codec=codec, tilt_policy=tilt_policy,
                         windows=None if windows is None else tuple(w for w in windows.split(",") if w),
                         shard_bytes=_size(shard_size), strict=strict or None)
    report = run_ingest(list(sources), store, config=cfg, key_file=key_file, progress=not no_progress,
                        labels=label_paths, roi_map=_read_roi_map(roi_map))
    _print_ingest_summary(report)
    sys.exit(report.exit_code(cfg.strict))


def _read_roi_map(path: Path | None) -> dict[str, list[str]] | None:
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
        return {str(name): [str(a) for a in aliases] for name, aliases in doc.items()}
    except (ValueError, AttributeError, TypeError) as exc:
        raise click.BadParameter(f'{path} must hold {{"class": ["ROI name", ...]}} ({exc})') from None


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
    for outcome in report.labels:
        where = f"series {_short(outcome.key)}" if outcome.key else "no series"
        detail = ", ".join(outcome.classes) if outcome.classes else (outcome.reason or "")
        _out.print(f"  label {outcome.status}: {outcome.source} ({outcome.kind}) -> {where}: {detail}")
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
@click.option("--label", is_flag=True, help="Export the series' label map instead of its image.")
def export(store: Path, key: str, out: Path, label: bool) -> None:
    """Write series KEY (a unique key prefix is enough) of STORE as NIfTI to OUT (.nii or .nii.gz)."""
    from medload.storage.nifti import export_nifti
    from medload.storage.store import open_store

    path = export_nifti(open_store(store), key, out, label=label)
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


@cli.group()
def cache() -> None:
    """The hot-shard directory on local SSD (L2): copy shards there, see what it holds, empty it."""


def _hot_config(config: MedloadConfig, hot_dir: Path | None, budget: str | None, max_rate: str | None):
    cfg = with_overrides(config.cache, hot_dir=hot_dir, hot_budget=_size(budget), max_rate=_size(max_rate))
    if cfg.hot_dir is None:
        raise click.UsageError("give --hot-dir (or hot_dir in the [cache] table of --config)")
    if cfg.hot_budget <= 0:
        raise click.UsageError("give --budget, e.g. --budget 50GB (or hot_budget in [cache] of --config)")
    return cfg


_HOT_OPTIONS = [
    click.option("--hot-dir", type=click.Path(path_type=Path), default=None, help="Local-SSD directory for shard copies."),
    click.option("--budget", default=None, help="Bytes the hot directory may hold, e.g. 50GB."),
]


def _hot_options(fn):
    for option in reversed(_HOT_OPTIONS):
        fn = option(fn)
    return fn


@cache.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@_hot_options
@click.option("--series", "series_keys", multiple=True, help="Only the shards of these series (key or prefix; repeat).")
@click.option("--max-rate", default=None, help="Copy at most this many bytes/s, e.g. 200MB (spare a shared NFS).")
@click.pass_obj
def warm(config: MedloadConfig, store: Path, hot_dir: Path | None, budget: str | None, series_keys: tuple[str, ...],
         max_rate: str | None) -> None:
    """Copy the shards of STORE (or of some series) to the hot directory, verified, within the budget."""
    from medload.cache.hot_shards import HotShards
    from medload.progress import progress_bar
    from medload.storage.manifest import shard_path
    from medload.storage.store import open_store

    cfg = _hot_config(config, hot_dir, budget, max_rate)
    st = open_store(store)
    wanted = {st.record(k).shard for k in series_keys} if series_keys else {s.name for s in st.manifest.shards}
    entries = [s for s in st.manifest.shards if s.name in wanted]
    total = sum(e.bytes for e in entries)
    if total > cfg.hot_budget:
        raise MedloadError(f"the {len(entries)} shard(s) asked for hold {total / 1e9:.2f} GB but the hot budget is "
                           f"{cfg.hot_budget / 1e9:.2f} GB: raise --budget or warm fewer series (--series)")
    hot = HotShards(cfg.hot_dir, cfg.hot_budget, max_rate=cfg.max_rate)
    copied = elsewhere = 0
    with progress_bar("copying shards", len(entries), enabled=sys.stderr.isatty()) as advance:
        for entry in entries:
            if hot.path_of(entry) is None:
                if hot.fetch(shard_path(store, entry.name) / "data.mdb", entry) is None:
                    elsewhere += 1
                else:
                    copied += 1
            advance(1)
    _out.print(f"{len(entries)} shard(s), {total / 1e6:.1f} MB: {copied} copied, {len(entries) - copied - elsewhere} "
               f"already hot" + (f", {elsewhere} being copied by another process" if elsewhere else "")
               + f"; {cfg.hot_dir} holds {hot.status().used / 1e6:.1f} of {cfg.hot_budget / 1e6:.1f} MB")


@cache.command()
@click.argument("store", required=False, type=click.Path(exists=True, path_type=Path))
@_hot_options
@click.pass_obj
def status(config: MedloadConfig, store: Path | None, hot_dir: Path | None, budget: str | None) -> None:
    """What the hot directory holds; with STORE, which of its shards are hot."""
    from medload.cache.hot_shards import HotShards
    from medload.storage.store import open_store

    cfg = _hot_config(config, hot_dir, budget, None)
    state = HotShards(cfg.hot_dir, cfg.hot_budget).status()
    mine = {s.name for s in open_store(store).manifest.shards} if store else set()
    table = Table(title=f"{state.hot_dir}: {state.used / 1e6:.1f} of {state.budget / 1e6:.1f} MB used")
    for col in ("shard", "MB", "last used", *(["in STORE"] if store else [])):
        table.add_column(col)
    for e in state.entries:
        row = [e.name, f"{e.bytes / 1e6:.1f}", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))]
        table.add_row(*row, *(["yes" if e.name in mine else ""] if store else []))
    _out.print(table)
    if state.partial:
        _out.print(f"copies in progress: {', '.join(state.partial)}")
    if store:
        hot_names = {e.name for e in state.entries}
        _out.print(f"{len(mine & hot_names)} of {len(mine)} shard(s) of {store} are hot")


@cache.command()
@_hot_options
@click.pass_obj
def clear(config: MedloadConfig, hot_dir: Path | None, budget: str | None) -> None:
    """Remove every copy from the hot directory (copies in progress elsewhere are left alone)."""
    from medload.cache.hot_shards import HotShards

    cfg = _hot_config(config, hot_dir, budget or "1", None)
    freed = HotShards(cfg.hot_dir, cfg.hot_budget).clear()
    _out.print(f"freed {freed / 1e6:.1f} MB in {cfg.hot_dir}")


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
        _err.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
