"""``medload bench``: medload against MONAI's pipelines and other peers, measured side by side in one run."""

from __future__ import annotations

from pathlib import Path

import click

from medload.cli.app import Device, cli


@cli.command()
@click.option("--quick", is_flag=True, help="Less data and fewer batches (a few minutes on 2 cores).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write every printed figure to this JSON file.")
@click.option("--data", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="A folder of your own DICOM instead of synthetic CT.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a PNG of samples/s per contender.")
@click.option("--sections", default="ingest,loading,scaling,scale,gpu", show_default=True,
              help="Comma-separated subset to run (gpu runs only where CUDA is available; "
                   "add autotune to measure num_workers=\"auto\" against a grid, patches for 3D training patches "
                   "against nnU-Net's and MONAI's loaders).")
@click.option("--scale", "scale_series", type=click.IntRange(min=2), default=None,
              help="Series of 128 slices in the scale section's store (default 100: 3 GB, 12x the L1).")
@click.option("--patch-series", type=click.IntRange(min=1), default=None,
              help="Series of 96 x 384x384 in the patches section's store (default 64: about 0.85 GB, 3x the L1).")
@click.option("--scale-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the scale section's data here (about 0.3 GB per series) and reuse them next time.")
@click.option("--device", type=Device(), default="cpu", show_default=True, help="Where loading batches land: cpu, cuda, cuda:1...")
@click.option("--readme", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the results as markdown tables (command, date, machine) to this file.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def bench(quick: bool, json_out: Path | None, data: Path | None, plot: Path | None, sections: str,
          scale_series: int | None, patch_series: int | None, scale_dir: Path | None, device: str, readme: Path | None, no_progress: bool) -> None:
    """Benchmark ingest, 2.5D/3D loading, loading at archive scale and (with CUDA) the GPU path against peers,
    in this run."""
    from dataclasses import replace

    from medload.bench.run import FULL, QUICK, readme_tables, run_bench

    config = QUICK if quick else FULL
    if scale_series is not None:
        config = replace(config, scale_series=scale_series)
    if patch_series is not None:
        config = replace(config, patch_series=patch_series)
    results = run_bench(quick=quick, json_out=json_out, data=data, plot=plot, sections=sections.split(","),
                        device=device, progress=not no_progress, config=config, scale_dir=scale_dir)
    if readme is not None:
        readme.write_text(readme_tables(results))
