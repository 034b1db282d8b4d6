"""``medload push-seg``: a mask on a stored series to the PACS as a DICOM SEG referencing the original series."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from medload.cli.app import cli, console, short
from medload.cli.options import ca_bundle_option, credentials_option, key_file_option
from medload.config import MedloadConfig

if TYPE_CHECKING:
    from medload.deid import KeyFile


def _segment(ctx, param, values: tuple[str, ...]) -> dict[int, str] | None:
    """``--segment 1=bone`` (repeatable) as {1: "bone"}."""
    out = {}
    for text in values:
        ident, sep, name = text.partition("=")
        if not sep or not ident.strip().isdigit() or not name.strip():
            raise click.BadParameter(f"{text!r}: write ID=NAME, e.g. --segment 1=bone")
        out[int(ident)] = name.strip()
    return out or None


@cli.command(name="push-seg")
@click.argument("store", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("key")
@click.argument("mask", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--to", "url", required=True, metavar="URL",
              help="The PACS the series was ingested from: dicomweb://HOST:PORT/PATH (STOW-RS; dicomwebs:// for TLS) "
                   "or dimse://CALLED_AET@HOST:PORT (C-STORE, unencrypted).")
@click.option("--segment", "segments", multiple=True, callback=_segment, metavar="ID=NAME",
              help="Name of class id ID, e.g. 1=bone (repeatable; ids 1..N; default class_<id>).")
@click.option("--query", default="", help="Matching keys narrowing the search for the original series (QIDO-RS or "
                                          "C-FIND), e.g. 'StudyDate=20150101-20151231'.")
@credentials_option
@ca_bundle_option
@click.option("--calling-aet", default="MEDLOAD", show_default=True,
              help="dimse://: medload's AE title, allowed by the PACS to query, retrieve and store.")
@key_file_option
@click.option("--algorithm", default="medload", show_default=True, help="Name of the algorithm that made the mask.")
@click.option("--algorithm-version", default=None, help="Its version (default: medload's).")
@click.option("--series-description", default="medload segmentation", show_default=True)
@click.option("--lineage", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The lineage record of the model's training data (loader.lineage(), export-nnunet's "
                   "medload_lineage.json): its digest goes into the SEG's Algorithm Parameters.")
@click.pass_obj
def push_seg(config: MedloadConfig, store: Path, key: str, mask: Path, url: str, segments: dict[int, str] | None,
             query: str, credentials: Path | None, ca_bundle: Path | None, calling_aet: str, key_file: KeyFile,
             algorithm: str, algorithm_version: str | None, series_description: str, lineage: Path | None) -> None:
    """Send MASK (NIfTI/NRRD on the grid of series KEY of STORE, as `medload export` writes it) to the PACS as a
    DICOM SEG that references the original series, found there by the pseudonym of its SeriesInstanceUID."""
    from medload.version import __version__
    from medload.writeback import push_seg as push

    result = push(store, key, mask, segments, to=url, credentials=credentials, ca_bundle=ca_bundle,
                  calling_aet=calling_aet, query=query, key_file=key_file, config=config.ingest,
                  algorithm=(algorithm, algorithm_version or __version__), series_description=series_description,
                  lineage=lineage)
    console.print(f"sent a SEG of series {short(result.key)} ({', '.join(result.segments)}; {result.frames} frame(s)) "
                  f"to study {short(result.study)}: SEG series {short(result.series)}")
