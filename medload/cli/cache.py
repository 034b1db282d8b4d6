"""``medload cache warm|status|clear``: the hot-shard directory on local SSD (L2)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.table import Table

from medload.cli.app import cli, console, renamed, size
from medload.config import MedloadConfig, format_size, with_overrides
from medload.errors import MedloadError


@cli.group()
def cache() -> None:
    """The hot-shard directory on local SSD (L2): copy shards there, see what it holds, empty it."""


def _budgeted(config: MedloadConfig, hot_budget: str | None) -> bool:
    return hot_budget is not None or config.cache.hot_budget > 0


def _hot_config(config: MedloadConfig, hot_dir: Path | None, hot_budget: str | None, max_rate: str | None, *,
                need_budget: bool = True):
    if not need_budget and not _budgeted(config, hot_budget):
        hot_budget = "1"  # looking at or clearing the directory needs no budget: a placeholder the config accepts
    cfg = with_overrides(config.cache, hot_dir=hot_dir, hot_budget=size(hot_budget), max_rate=size(max_rate))
    if cfg.hot_dir is None:
        raise click.UsageError("give --hot-dir (or hot_dir in the [cache] table of --config)")
    if cfg.hot_budget <= 0:
        raise click.UsageError("give --hot-budget, e.g. --hot-budget 50GB (or hot_budget in [cache] of --config)")
    return cfg


_HOT_OPTIONS = [
    click.option("--hot-dir", type=click.Path(path_type=Path), default=None, help="Local-SSD directory for shard copies."),
    click.option("--hot-budget", default=None, help="Bytes the hot directory may hold, e.g. 50GB."),
]


def _hot_options(fn):
    fn = renamed("--budget", "--hot-budget")(fn)
    for option in reversed(_HOT_OPTIONS):
        fn = option(fn)
    return fn


@cache.command()
@click.argument("store", type=click.Path(exists=True, path_type=Path))
@_hot_options
@click.option("--series", "series_keys", multiple=True, help="Only the shards of these series (key or prefix; repeat).")
@click.option("--max-rate", default=None, help="Copy at most this many bytes/s, e.g. 200MB (spare a shared NFS).")
@click.option("--rank", type=int, default=None, help="Only the shards this training rank reads (with --world).")
@click.option("--world", type=int, default=None, help="Number of training ranks (with --rank).")
@click.option("--seed", type=int, default=0, show_default=True, help="The training run's seed (with --rank).")
@click.pass_obj
def warm(config: MedloadConfig, store: Path, hot_dir: Path | None, hot_budget: str | None, series_keys: tuple[str, ...],
         max_rate: str | None, rank: int | None, world: int | None, seed: int) -> None:
    """Copy the shards of STORE (or of some series) to the hot directory, verified, within the budget.

    With --rank R --world W: only the shards rank R of W reads when it trains on these series with
    DistributedPatientSampler (by patient, preferring local shards; same --seed as the run), also for the
    rest of an epoch resumed on W ranks from a state saved on another number (the same assignment).
    """
    from medload.progress import progress_bar
    from medload.storage.cache.hot_shards import HotShards
    from medload.storage.manifest import shard_path
    from medload.storage.store import open_store

    if (rank is None) != (world is None):
        raise click.UsageError("give --rank and --world together, e.g. --rank 0 --world 8")
    cfg = _hot_config(config, hot_dir, hot_budget, max_rate)
    st = open_store(store)
    if rank is not None and world is not None:  # given together (checked above)
        from medload.data.distributed import shards_for_rank

        records = [st.record(k) for k in series_keys] if series_keys else st.series()
        wanted = set(shards_for_rank(records, rank, world, seed=seed))
    else:
        wanted = {st.record(k).shard for k in series_keys} if series_keys else {s.name for s in st.manifest.shards}
    entries = [s for s in st.manifest.shards if s.name in wanted]
    total = sum(e.bytes for e in entries)
    if total > cfg.hot_budget:
        held, budget = format_size(total), format_size(cfg.hot_budget)
        if held == budget:  # close sizes round alike: give the bytes
            held, budget = f"{total:,} bytes", f"{cfg.hot_budget:,} bytes"
        raise MedloadError(f"the {len(entries)} shard(s) asked for hold {held} but the hot budget is {budget}: raise "
                           "--hot-budget or warm fewer series (--series)")
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
    console.print((f"rank {rank} of {world}: " if rank is not None else "")
               + f"{len(entries)} shard(s), {total / 1e6:.1f} MB: {copied} copied, {len(entries) - copied - elsewhere} "
               f"already hot" + (f", {elsewhere} being copied by another process" if elsewhere else "")
               + f"; {cfg.hot_dir} holds {hot.status().used / 1e6:.1f} of {cfg.hot_budget / 1e6:.1f} MB")


@cache.command()
@click.argument("store", required=False, type=click.Path(exists=True, path_type=Path))
@_hot_options
@click.pass_obj
def status(config: MedloadConfig, store: Path | None, hot_dir: Path | None, hot_budget: str | None) -> None:
    """What the hot directory holds; with STORE, which of its shards are hot."""
    from medload.storage.cache.hot_shards import HotShards
    from medload.storage.store import open_store

    cfg = _hot_config(config, hot_dir, hot_budget, None, need_budget=False)
    state = HotShards(cfg.hot_dir, cfg.hot_budget).status()
    mine = {s.name for s in open_store(store).manifest.shards} if store else set()
    of = f"of {state.budget / 1e6:.1f} MB " if _budgeted(config, hot_budget) else ""
    table = Table(title=f"{state.hot_dir}: {state.used / 1e6:.1f} MB {of}used")
    for col in ("shard", "MB", "last used", *(["in STORE"] if store else [])):
        table.add_column(col)
    for e in state.entries:
        row = [e.name, f"{e.bytes / 1e6:.1f}", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.last_used))]
        table.add_row(*row, *(["yes" if e.name in mine else ""] if store else []))
    console.print(table)
    if state.partial:
        console.print(f"copies in progress: {', '.join(state.partial)}")
    if store:
        hot_names = {e.name for e in state.entries}
        console.print(f"{len(mine & hot_names)} of {len(mine)} shard(s) of {store} are hot")


@cache.command()
@_hot_options
@click.pass_obj
def clear(config: MedloadConfig, hot_dir: Path | None, hot_budget: str | None) -> None:
    """Remove every copy from the hot directory (copies in progress elsewhere are left alone)."""
    from medload.storage.cache.hot_shards import HotShards

    cfg = _hot_config(config, hot_dir, hot_budget, None, need_budget=False)
    freed = HotShards(cfg.hot_dir, cfg.hot_budget).clear()
    console.print(f"freed {freed / 1e6:.1f} MB in {cfg.hot_dir}")
