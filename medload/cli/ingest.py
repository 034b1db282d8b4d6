"""``medload ingest``: files, folders, archives or a PACS (DICOMweb or DIMSE) into a store, with a closing summary."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.markup import escape
from rich.table import Table

from medload.cli.app import cli, console, renamed, short, size
from medload.cli.options import ca_bundle_option, credentials_option, ingest_key_options
from medload.config import MedloadConfig, with_overrides
from medload.storage.codec import CODECS, DEFAULT_CODEC
from medload.storage.records import percent

if TYPE_CHECKING:
    from medload.deid import KeyFile


class _Source(click.Path):
    """An existing file, folder or archive, or a ``dicomweb://`` / ``dicomwebs://`` / ``dimse://`` URL (kept
    as text)."""

    def convert(self, value, param, ctx):
        from medload.pacs.endpoint import is_remote_url

        return str(value) if is_remote_url(value) else super().convert(value, param, ctx)


@cli.command()
@click.argument("sources", nargs=-1, required=True, type=_Source(exists=True, path_type=Path))
@click.argument("store", type=click.Path(path_type=Path))
@click.option("--workers", type=int, default=None,
              help="Decode processes (default: one per usable core, as many as fit in memory); not a training "
                   "loader's --num-workers.")
@click.option("--scheduler", default=None, metavar="local[:N]|tcp://HOST:PORT|tls://HOST:PORT|slurm[:JOBS]",
              help="Run the header pass and decoding as tasks on a Dask cluster: a LocalCluster of N workers (default "
                   "--workers, else one per core), a running scheduler, or Slurm jobs via dask-jobqueue (docs/dask.md).")
@click.option("--windows", default=None, help="Also store uint8 planes for these windows, e.g. lung,soft_tissue,350/50.")
@click.option("--codec", type=click.Choice(sorted(CODECS)), default=None,
              help=f"Slice codec of a new store (default {DEFAULT_CODEC}).")
@click.option("--tilt-policy", type=click.Choice(["reject", "shear"]), default=None,
              help="Gantry-tilted (sheared) stacks: reject (default), or keep with the sheared affine.")
@click.option("--shard-bytes", default=None, help="Publish a shard past this size, e.g. 2GB (default 4GB).")
@click.option("--worker-memory", default=None,
              help="Memory cap of each decoding process, e.g. 4GB (default); an input needing more is quarantined. "
                   "0: no cap.")
@click.option("--decode-timeout", type=float, default=None,
              help="Seconds one input may take in a decoding process (default 60); a longer one is quarantined. "
                   "0: no limit.")
@click.option("--plausibility", type=click.Choice(["reject", "flag", "off"]), default=None,
              help="CT pixels that decode but cannot be real (values no scanner writes, a slice unlike its "
                   "neighbours): reject the series (default), flag it, or do not check.")
@click.option("--time-series", type=click.Choice(["split", "reject"]), default=None,
              help="Stacks at the same positions over time (fMRI, perfusion, 4-D CT): one volume per time point "
                   "(default, flags t_01...), or reject the series.")
@ingest_key_options
@click.option("--strict", is_flag=True, default=None, help="Exit 1 if any input was rejected.")
@click.option("--share", default=None, metavar="private|group|group:NAME",
              help="Who may read STORE: its owner only (a new store's default), the group of its folder, or group "
                   "NAME; recorded in the store and kept by every later write (`medload share` changes it).")
@click.option("--labels", "label_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Label masks (NIfTI/NRRD named after the SeriesInstanceUID or a key prefix), SEG/RTSTRUCT files, "
                   "or a mapping file (CSV/JSON with series,label). Repeatable. SEG/RTSTRUCT among SOURCES pair "
                   "with their series by themselves.")
@click.option("--label-min-kept", type=click.FloatRange(0, 1), default=None,
              help="Reject a label with less than this fraction of its foreground inside its series (default 0.5: "
                   "the label of another series or patient); one kept above it but not whole is stored and flagged.")
@click.option("--roi-map", type=click.Path(exists=True, path_type=Path), default=None,
              help='JSON {"class": ["ROI name", ...]} giving RTSTRUCT ROIs consistent class ids.')
@click.option("--force", "force_keys", multiple=True, metavar="KEY",
              help="Write stored series KEY (hex key, or a unique prefix of 8+ digits) again from SOURCES, replacing "
                   "the stored copy and its labels (give those again with --labels). Repeatable; exit 1 if its "
                   "files are not among SOURCES.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--query", default=None, help="dicomweb:// or dimse:// source: matching keys (QIDO-RS, or C-FIND), e.g. "
                                            "'Modality=CT&StudyDate=20150101-20151231' (default: every series).")
@click.option("--calling-aet", default=None,
              help="dimse:// source: medload's own AE title (default MEDLOAD), as registered in the PACS with "
                   "permission to query (C-FIND) and retrieve (C-GET). Plain DIMSE is unencrypted: use it on a "
                   "trusted network only.")
@credentials_option
@ca_bundle_option
@click.option("--connections", type=int, default=None, help="dicomweb:// source: instances retrieved at once (default 8).")
@click.option("--spool-instances", type=int, default=None,
              help="dicomweb:// or dimse:// source: instances spooled on disk at once (default 1000; a larger series "
                   "is spooled whole).")
@click.pass_obj
@renamed("--shard-size", "--shard-bytes")
def ingest(config: MedloadConfig, sources: tuple[Path | str, ...], store: Path, workers: int | None,
           windows: str | None, codec: str | None, tilt_policy: str | None, shard_bytes: str | None,
           worker_memory: str | None, decode_timeout: float | None, plausibility: str | None,
           time_series: str | None, key_file: KeyFile, strict: bool | None, share: str | None,
           label_paths: tuple[Path, ...], label_min_kept: float | None, roi_map: Path | None,
           force_keys: tuple[str, ...], no_progress: bool, scheduler: str | None, query: str | None,
           credentials: Path | None, ca_bundle: Path | None, connections: int | None,
           spool_instances: int | None, calling_aet: str | None) -> None:
    """Ingest DICOM files, folders and zip/tar archives (SOURCES) into STORE; or the series a PACS finds:
    one SOURCE dicomweb://HOST:PORT/PATH (dicomwebs:// for TLS), or dimse://CALLED_AET@HOST:PORT (C-FIND and
    C-GET, no inbound port needed; plain DIMSE is unencrypted)."""
    from medload.ingest.run import ingest as run_ingest

    _refuse_swapped(sources, store)
    cfg = with_overrides(config.ingest, workers=workers, codec=codec, tilt_policy=tilt_policy,
                         windows=windows,  # "lung,soft_tissue": IngestConfig splits it
                         shard_bytes=size(shard_bytes), worker_memory=size(worker_memory),
                         decode_timeout=decode_timeout, plausibility=plausibility, time_series=time_series,
                         label_min_kept=label_min_kept, strict=strict or None, share=share)
    remote = {"query": query, "credentials": credentials, "ca_bundle": ca_bundle, "connections": connections,
              "spool_instances": spool_instances, "calling_aet": calling_aet}
    if any(isinstance(s, str) for s in sources):
        if scheduler is not None:
            raise click.UsageError("--scheduler does not combine with a dicomweb:// or dimse:// source yet")
        unsupported = label_paths or roi_map or force_keys
        report = _ingest_remote(sources, store, cfg, key_file, not no_progress, unsupported, **remote)
    elif any(v is not None for v in remote.values()):
        raise click.UsageError("--query, --credentials, --ca-bundle, --connections, --spool-instances and "
                               "--calling-aet apply to a dicomweb:// or dimse:// source only")
    else:
        report = run_ingest(list(sources), store, config=cfg, key_file=key_file, progress=not no_progress,
                            labels=label_paths, roi_map=_read_roi_map(roi_map), force=force_keys, scheduler=scheduler)
    _print_ingest_summary(report)
    sys.exit(report.exit_code(cfg.strict))


def _refuse_swapped(sources: tuple[Path | str, ...], store: Path) -> None:
    """A STORE that is not a store but holds DICOM, with a store among the SOURCES: the arguments are swapped."""
    from medload.storage.manifest import manifest_path

    if not store.is_dir() or manifest_path(store).exists():
        return
    dicom = _a_dicom_file(store)
    if dicom is None:
        return  # StoreWriter refuses any other non-empty folder, naming what it holds
    stores = [s for s in sources if isinstance(s, Path) and manifest_path(s).exists()]
    swapped = f"; SOURCES {stores[0]} is a medload store: swapped arguments?" if stores else ""
    raise click.UsageError(f"STORE {store} looks like a DICOM folder ({dicom} is DICOM), not a store{swapped} "
                           "The store is the last argument: medload ingest SOURCES... STORE")


def _a_dicom_file(folder: Path, limit: int = 200) -> Path | None:
    """A DICOM Part 10 file under ``folder`` (as ingest's discovery tells one), looking at most ``limit`` files."""
    import os

    from medload.ingest.archives import HEAD_BYTES, content_kind

    seen = 0
    for top, _, names in os.walk(folder):
        for name in names:
            path = Path(top) / name
            try:
                with open(path, "rb") as f:
                    if content_kind(f.read(HEAD_BYTES)) == "dicom":
                        return path
            except OSError:
                pass
            seen += 1
            if seen >= limit:
                return None
    return None


def _ingest_remote(sources, store, cfg, key_file, progress, unsupported, *, query, credentials, ca_bundle,
                   connections, spool_instances, calling_aet):
    from medload.pacs.endpoint import is_dimse_url
    from medload.pacs.ingest import RetrieveOptions, ingest_dicomweb, ingest_dimse

    if len(sources) != 1:
        raise click.UsageError("a dicomweb:// or dimse:// source is ingested on its own: give it as the only SOURCE")
    if unsupported:
        raise click.UsageError("--labels, --roi-map and --force do not combine with a dicomweb:// or dimse:// source "
                               "(SEG and RTSTRUCT objects the search finds are retrieved and ingested like any other "
                               "instance)")
    sizes = {k: v for k, v in {"connections": connections, "spool_instances": spool_instances}.items() if v is not None}
    if is_dimse_url(sources[0]):
        if credentials is not None or ca_bundle is not None or connections is not None:
            raise click.UsageError("--credentials, --ca-bundle and --connections apply to dicomweb:// sources: a DIMSE "
                                   "PACS authorises medload by its AE title (--calling-aet) and host, over one "
                                   "unencrypted association")
        return ingest_dimse(sources[0], store, query=query or "", calling_aet=calling_aet or "MEDLOAD", config=cfg,
                            key_file=key_file, progress=progress, options=RetrieveOptions(**sizes))
    if calling_aet is not None:
        raise click.UsageError("--calling-aet applies to dimse:// sources only")
    return ingest_dicomweb(sources[0], store, query=query or "", credentials=credentials, ca_bundle=ca_bundle,
                           config=cfg, key_file=key_file, progress=progress, options=RetrieveOptions(**sizes))


def _read_roi_map(path: Path | None) -> dict[str, list[str]] | None:
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
        return {str(name): [str(a) for a in aliases] for name, aliases in doc.items()}
    except (ValueError, AttributeError, TypeError) as exc:
        raise click.BadParameter(f'{path} must hold {{"class": ["ROI name", ...]}} ({exc})') from None


def _print_ingest_summary(report) -> None:
    """The series table, the files not stored by status and reason, and the totals: short lines, never broken
    inside a word or a number (rich wraps a terminal's lines at spaces; elsewhere nothing is wrapped)."""
    if report.series:
        table = Table(title=f"ingest into {escape(report.store)}")
        for col in ("series", "status", "modality", "shape (D,H,W)", "reason"):
            table.add_column(col)
        for s in report.series:
            shape = "x".join(map(str, s.shape)) if s.shape else f"{s.planes} planes"
            table.add_row(short(s.key), s.status, s.modality, shape, escape(s.reason or ""))
        console.print(table)
    files = [r for r in report.rejects if r.series is None]
    for status in _FILE_STATUSES:
        reasons = Counter(r.reason for r in files if r.status == status)
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            example = next(r.source for r in files if r.status == status and r.reason == reason)
            _say(escape(f"  {status} {n} file(s): {reason}  [e.g. {example}]"))
    for outcome in report.labels:
        where = f"series {short(outcome.key)}" if outcome.key else "no series"
        detail = ", ".join(outcome.classes) if outcome.classes else (outcome.reason or "")
        if outcome.kept is not None and outcome.kept < 1:
            detail += f" (cut: {percent(outcome.kept)} of its foreground lies inside the series, the rest outside it)"
        _say(escape(f"  label {outcome.status}: {outcome.source} ({outcome.kind}) -> {where}: {detail}"))
    c = report.counts
    _say(f"[bold]series: {c['ingested']} ingested, {c['present']} already present, {c['skipped']} skipped, "
         f"{c['rejected']} rejected[/bold]"
         + (f", {c['replaced']} replaced" if c["replaced"] else "")
         + (f", [red]{c['not_found']} forced series not found among the sources[/red]" if c["not_found"] else "")
         + (f", {c['conflict']} in conflict" if c["conflict"] else "")
         + (f", [red]{c['failed']} failed (run the ingest again to retry them)[/red]" if c["failed"] else ""))
    by_status = Counter(r.status for r in files)
    _say(f"files: {by_status['skipped']} skipped, {by_status['rejected']} rejected, {by_status['ignored']} ignored "
         "(not DICOM)" + ("; `medload rejects STORE --all` lists them" if files else ""))
    _say(f"read {report.files} files, {report.bytes / 1e6:.1f} MB in {report.seconds:.1f} s "
         f"({report.files_per_second:.0f} files/s, {report.megabytes_per_second:.0f} MB/s)")


_FILE_STATUSES = ("skipped", "rejected", "ignored")


def _say(text: str) -> None:
    """One line of the summary: wrapped at spaces to a terminal's width, never wrapped elsewhere (a log, a pipe)."""
    console.print(text, soft_wrap=not console.is_terminal)
