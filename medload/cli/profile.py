"""``medload profile``: where a training loop's time goes on this store and machine (:mod:`medload.data.profile`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from medload.cli.app import Device, cli, console, read_config, renamed
from medload.config import FROM_CONFIG, FromConfig, MedloadConfig


def _workers(value: str | None) -> int | str | FromConfig:
    if value is None:
        return FROM_CONFIG
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: give a number of workers (0, 2...) or 'auto'") from None


@cli.command("profile")
@click.argument("store", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="TOML settings; its [cache] section says how the store is read and its [loader] section how the "
                   "loader runs (instead of the global --config).")
@click.option("--batch-size", type=int, default=None, help="Samples per batch (default: [loader] batch_size, else 4).")
@click.option("--num-workers", default=None,
              help="Loader processes (DataLoader workers), or 'auto' (default: [loader] num_workers, else 0).")
@click.option("--steps", type=int, default=20, show_default=True, help="Training steps to time.")
@click.option("--window", default=None,
              help="Window preset, WIDTH/LEVEL (350/50) or W350/L50 (default: [loader] window, else soft_tissue).")
@click.option("--context", type=int, default=1, show_default=True, help="2.5D neighbour slices on each side.")
@click.option("--device", type=Device(), default="cpu", show_default=True, help="cpu, cuda, cuda:1...")
@click.option("--model", type=click.Choice(["small", "full", "none"]), default="small", show_default=True,
              help="The pipeline's UNet (small: --quick's widths) or none (the loader alone).")
@click.option("--augment", is_flag=True, help="Add BatchAugment on the device, as training does.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of the table.")
@click.pass_obj
@renamed("--workers", "--num-workers")
def profile_cmd(config: MedloadConfig, store: Path, config_file: Path | None, batch_size: int | None,
                num_workers: str | None, steps: int, window: str | None, context: int, device: str, model: str,
                augment: bool, as_json: bool) -> None:
    """Time each stage of the training input (store reads per cache tier, decode, collate, copy, window,
    augment, waiting) and a training step; print a table and a verdict (input- or compute-bound)."""
    from medload.data.profile import profile_training
    from medload.storage.store import open_store

    settings = read_config(config_file) if config_file is not None else config
    report, tuning = profile_training(open_store(store, cache=settings.cache),
                                      batch_size=FROM_CONFIG if batch_size is None else batch_size,
                                      num_workers=_workers(num_workers), steps=steps,
                                      window=FROM_CONFIG if window is None else window, context=context,
                                      device=device, model=model, augment=augment, config=settings.loader)
    if as_json:
        click.echo(json.dumps({**report.to_dict(), "tuning": None if tuning is None else tuning.to_dict()}, indent=2))
        return
    console.print(report.table())
    if report.next_ms is not None:
        wall_ms, cpu_ms = report.next_ms
        console.print(f"the training thread spent {wall_ms:.2f} ms per batch inside next(loader), {cpu_ms:.2f} ms "
                      "of it on the CPU", soft_wrap=True, highlight=False)
    if tuning is not None:
        console.print(f"num_workers=auto chose {tuning.reason}", soft_wrap=True, highlight=False)
    console.print(report.verdict(), soft_wrap=True, highlight=False)
