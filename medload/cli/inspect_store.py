"""Looking into a store: ``info``, ``ls``, ``export``, ``rejects``, ``view``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from medload.cli.app import Suffix, cli, console, short
from medload.storage.records import LabelRecord, percent


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
def info(store: Path) -> None:
    """Summary of STORE: format, shards, series (those in a shard that cannot be read as unavailable), quarantine."""
    from medload.storage.store import open_store

    st = open_store(store)
    m = st.manifest
    records = st.series()
    down = st.unavailable()
    console.print(f"[bold]{store}[/bold]: format v{m.version}, codec {m.codec}, windows {', '.join(m.windows) or 'none'}, "
               f"{len(m.shards)} shard(s), {sum(s.bytes for s in m.shards) / 1e6:.1f} MB, created by {m.created_by}")
    table = Table()
    columns = ("series", "modality", "shape (D,H,W)", "spacing mm (x,y,z)", "dtype", "manufacturer", "kernel", "flags",
               "label")
    for col in columns + (("unavailable",) if down else ()):
        table.add_column(col)
    for r in records:
        table.add_row(short(r.key), r.modality, "x".join(map(str, r.shape)), ", ".join(f"{v:.3g}" for v in r.spacing),
                      r.dtype, r.manufacturer or "", r.kernel or "", ", ".join(r.flags), _label(st.labels(r.key_bytes)),
                      *(("",) if down else ()))
    for u in down:
        for key in u.series or ():
            table.add_row(short(key), *[""] * (len(columns) - 1), "yes: below")  # a table cell wraps: reason below
    console.print(table)
    for u in down:
        known = f"{len(u.series)} series" if u.series is not None else "series not listed in store.json (format 2)"
        console.print(f"[red]unavailable[/red]: shard {escape(u.shard)} cannot be read ({known}): {escape(u.reason)}",
                      soft_wrap=True)
    if down:
        console.print(f"repair: `medload verify {store}`, then `medload repair {store} --sources DIR`", soft_wrap=True)
    counts = Counter((r.status, r.stage) for r in st.rejects())
    if counts:
        console.print("quarantine: " + "; ".join(f"{n} {status} at {stage}" for (status, stage), n in sorted(counts.items()))
                   + f" (details: medload rejects {store} --all)")
    lost = sum(len(u.series or ()) for u in down)
    console.print(f"{len(records)} series, {sum(r.shape[0] for r in records)} slices"
                  + (f"; {lost} series unavailable in {len(down)} shard(s)" if down else ""))


@cli.command(name="ls")
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON array of series records.")
def ls_(store: Path, as_json: bool) -> None:
    """List the series of STORE (keys, modality, shapes, plane -- axial, coronal, sagittal or oblique --,
    digests); those in a shard that cannot be read as unavailable, with the reason."""
    from medload.storage.orientation import series_orientation
    from medload.storage.store import open_store

    st = open_store(store)
    records, down = st.series(), st.unavailable()
    lost = [(key, u) for u in down for key in u.series or ()]
    if as_json:
        click.echo(json.dumps([{**r.to_dict(), "label_kept": _kept(st.labels(r.key_bytes)), "unavailable": None}
                               for r in records]
                              + [{"key": key, "shard": u.shard, "unavailable": u.reason} for key, u in lost], indent=1))
        return
    for r in records:
        split = f"  split {r.split}" if r.split else ""
        cut = _label(st.labels(r.key_bytes), cut_only=True)
        click.echo(f"{r.key}  {r.modality:3s} {'x'.join(map(str, r.shape)):>14s}  {series_orientation(r):8s}  "
                   f"digest {r.digest}{split}" + (f"  label {cut}" if cut else ""))
    for key, u in lost:
        click.echo(f"{key}  unavailable: shard {u.shard} cannot be read ({u.reason})")
    for u in down:
        if u.series is None:
            click.echo(f"shard {u.shard} cannot be read ({u.reason}); store.json does not list its series (format 2)")
    if down:
        click.echo(f"{len(lost)} series unavailable: `medload verify {store}`, then `medload repair {store} --sources DIR`",
                   err=True)


def _kept(label: LabelRecord | None) -> float | None:
    """The fraction of a label's foreground inside its series; None without a label, or for one stored
    before medload measured it."""
    return None if label is None else label.kept


def _label(label: LabelRecord | None, cut_only: bool = False) -> str:
    """``"mask"``, or ``"mask, cut: 80% kept"`` for a label whose foreground lay partly outside its series."""
    kept = _kept(label)
    cut = f"cut: {percent(kept)} kept" if kept is not None and kept < 1 else ""
    if cut_only or label is None:
        return cut
    return f"{label.kind}, {cut}" if cut else label.kind


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.argument("key")
@click.argument("out", type=Suffix(".nii", ".nii.gz"))
@click.option("--label", is_flag=True, help="Export the series' label map instead of its image.")
def export(store: Path, key: str, out: Path, label: bool) -> None:
    """Write series KEY (a unique key prefix is enough) of STORE as NIfTI to OUT (.nii or .nii.gz)."""
    from medload.storage.nifti import export_nifti
    from medload.storage.store import open_store

    path = export_nifti(open_store(store), key, out, label=label)
    console.print(f"wrote {path}")


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON array of quarantine records.")
@click.option("--all", "include_skipped", is_flag=True,
              help="Include skipped inputs (localizers, reports...) and those ignored as not DICOM (text, images...).")
def rejects(store: Path, as_json: bool, include_skipped: bool) -> None:
    """Inputs of STORE that were rejected (and with --all, skipped or ignored), with stage and reason."""
    from dataclasses import asdict

    from medload.storage.store import open_store

    everything = open_store(store).rejects(include_skipped=True)
    records = everything if include_skipped else [r for r in everything if r.status == "rejected"]
    if as_json:
        click.echo(json.dumps([asdict(r) for r in records], indent=1))
        return
    table = Table()
    for col in ("status", "stage", "source", "reason"):
        table.add_column(col)
    for r in records:
        table.add_row(r.status, r.stage, r.source, r.reason)
    console.print(table)
    left_out = Counter() if include_skipped else Counter(r.status for r in everything if r.status != "rejected")
    notes = [f"{left_out[status]} {words}" for status, words in _LEFT_OUT.items() if left_out[status]]
    console.print("; ".join([f"{len(records)} rejected input(s)", *notes]) + ("; --all lists them too" if notes else ""))


_LEFT_OUT = {"skipped": "skipped (not volume images, e.g. Secondary Captures)", "ignored": "ignored (not DICOM)"}


@cli.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@click.argument("key")
@click.option("-o", "--out", type=Suffix(".png"), required=True, help="PNG file to write.")
@click.option("--z", type=int, default=None, help="Slice index (default: the middle slice).")
@click.option("--window", default="soft_tissue", show_default=True,
              help="Window preset (brain, soft_tissue, lung, liver, bone), WIDTH/LEVEL such as 350/50, or W350/L50.")
@click.option("--label", is_flag=True, help="Tint the series' label classes over the image.")
@click.option("--montage", type=int, default=None, metavar="N", help="N slices spread over the series in a grid.")
def view(store: Path, key: str, out: Path, z: int | None, window: str, label: bool, montage: int | None) -> None:
    """Write slice Z of series KEY of STORE as a PNG in a window, one pixel per voxel (no display needed)."""
    from medload.extras import require

    require("matplotlib", "viz", "medload view")
    import matplotlib

    matplotlib.use("Agg")  # headless: never open a window
    from medload.storage.store import open_store
    from medload.viz import write_png

    path = write_png(open_store(store), key, out, z, window=window, label=label, count=montage)
    console.print(f"wrote {path}")
