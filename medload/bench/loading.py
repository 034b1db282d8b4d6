"""Loading benchmark harness: one fresh process per contender, timing, peak memory, cache counters (the
data and sample list are :mod:`medload.bench.loading_data`'s).

Every contender of :mod:`medload.bench.peers` turns the same random list of samples -- ``(series, first
slice z0)``, ``depth`` slices each -- into batches of windowed float32 on the target device: 2.5D
``(B, 3, rows, columns)`` or 3D ``(B, 1, depth, rows, columns)``. Each run is a fresh process
(memory and allocator state never leak from one contender to the next), forked from a server that has
done the contender's imports (:mod:`medload.bench.forkserver`), started with the data in the page
cache; it sets up (fills its caches), then makes ``repeats`` passes of ``warmup`` batches followed
by up to ``batches`` timed ones (a fresh iterator each pass, so DataLoader workers start in the
warm-up). A pass stops early once ``max_pass_s`` seconds of timed batches have elapsed (at least one
timed batch always counts), and its warm-up after one batch if that took ``max_pass_s``: slow
contenders are measured on fewer samples rather than for minutes.
A batch counts once it is checked (shape, dtype, device) and, on a GPU, synchronised. Meanwhile a
thread of this process samples the PSS of the run's whole process tree, the server included (shared
import pages count once, as in a standalone process; :class:`~medload.bench.common.peak_pss`).
A contender that fails is reported with its error, one that cannot apply to the data as skipped with
the reason; neither is ever dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from medload.bench.common import error_text, peak_pss, spread, tree_bytes
from medload.bench.loading_data import KINDS, Prepared, prepare, warm_page_cache
from medload.bench.peers import CEILINGS, CONTENDERS, INT16, MEDLOAD, PeerUnavailable, resolve
from medload.errors import ConfigError

if TYPE_CHECKING:
    from medload.bench.forkserver import ForkServer

__all__ = ["Settings", "Servers", "run_contender", "run_loading", "BATCH_SIZE", "REFERENCE", "main"]

BATCH_SIZE = 8
REFERENCE = "npy_memmap"


# ---- one run, inside its own process -------------------------------------------------------------
def _check(batch, shape: tuple[int, ...], dtype, device) -> None:
    import torch

    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"batch is a {type(batch).__name__}, not a tensor")
    if tuple(batch.shape) != shape or batch.dtype != dtype or batch.device.type != device.type:
        raise ValueError(f"batch is {tuple(batch.shape)} {batch.dtype} on {batch.device}, "
                         f"expected {shape} {dtype} on {device}")


def run_contender(name: str, prep: Prepared, *, batch_size: int, num_workers: int, device: str, warmup: int,
                  batches: int, repeats: int, max_pass_s: float | None = None, pss_root: int | None = None) -> dict:
    """Set up contender ``name`` and time ``repeats`` passes. Returns ``setup_s``, ``seconds`` and
    ``samples`` per pass, and ``cache`` (the medload contenders' summed cache counters, else None).

    ``pss_root``: a process whose tree's PSS is also read here after set-up and after each pass, while
    the loader is alive (``pss_in_run_mb``): short runs would otherwise end between two samples."""
    import torch

    from medload.bench.common import tree_pss_mb

    pss = []

    dev = torch.device(device)
    dtype = torch.int16 if name in INT16 else torch.float32
    shape = (batch_size, *prep.sample_shape)
    setup_t0 = time.perf_counter()
    loader = resolve(name)(prep, batch_size, num_workers, device)
    setup = time.perf_counter() - setup_t0
    if pss_root is not None:
        pss.append(tree_pss_mb(pss_root))
    seconds, samples = [], []
    for _ in range(repeats):
        it = iter(loader)
        n, timed = 0, 0
        t0: float | None = None  # when the timed batches began (after the warm-up)
        w0 = time.perf_counter()
        try:
            while timed < batches:
                now = time.perf_counter()
                if t0 is None and (n >= warmup or (n > 0 and max_pass_s is not None and now - w0 >= max_pass_s)):
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()  # warm-up over (or cut short: a slow contender)
                elif t0 is not None and timed > 0 and max_pass_s is not None and now - t0 >= max_pass_s:
                    break
                try:
                    batch = next(it)
                except StopIteration:
                    raise RuntimeError(f"yielded {n} batches, expected {warmup + batches}") from None
                _check(batch, shape, dtype, dev)
                n += 1
                timed += t0 is not None
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if t0 is None:  # the loop times at least one batch unless none was asked for
                raise ConfigError(f"batches must be >= 1, got {batches}")
            seconds.append(time.perf_counter() - t0)
            samples.append(timed * batch_size)
            if pss_root is not None:
                pss.append(tree_pss_mb(pss_root))
        finally:
            getattr(it, "close", lambda: None)()
            del it
    stats = getattr(loader, "cache_stats", None)
    return {"setup_s": setup, "seconds": seconds, "samples": samples, "cache": stats() if stats else None,
            "pss_in_run_mb": max(pss, default=None)}


def _child(spec_json: str) -> None:
    spec = json.loads(spec_json)
    out = Path(spec.pop("out"))
    try:
        result = run_contender(spec.pop("name"), Prepared.load(Path(spec.pop("prep"))), **spec)
    except PeerUnavailable as exc:  # reported as a skipped row, with the reason
        result = {"skipped": str(exc)}
    except Exception as exc:  # reported as a failed row, with its message
        result = {"error": error_text(exc)}
    out.write_text(json.dumps(result))


@dataclass(frozen=True)
class Settings:
    """How each contender is run (see the module docstring)."""

    warmup: int = 3
    batches: int = 30
    repeats: int = 3
    max_pass_s: float | None = 10.0
    device: str = "cpu"
    batch_size: int = BATCH_SIZE
    timeout: float = 1800.0


SERVER_MODULES = {"base": ["medload.bench.loading"],
                  "medload": ["medload.bench.loading", "medload.bench.counted"],
                  "monai": ["medload.bench.loading", "medload.bench.counted", "medload.bench.monai_peers"]}
"""What each fork server imports: a contender's server has imported what it needs and nothing more
(medload.data does not import MONAI), so no contender's memory holds another's libraries."""
BASE_CONTENDERS = ("npy_memmap", "ceiling_float32", "ceiling_int16")


def server_group(name: str) -> str:
    return "base" if name in BASE_CONTENDERS else "medload" if name in (*MEDLOAD, *INT16) else "monai"


class Servers:
    """The fork servers of a benchmark, at most one alive at a time (two would share library pages and
    lower each other's PSS); :meth:`get` starts the one a contender needs, closing the other.
    ``modules``: what each group's server imports (default :data:`SERVER_MODULES`)."""

    def __init__(self, modules: dict[str, list[str]] | None = None) -> None:
        self.modules = SERVER_MODULES if modules is None else modules
        self.group: str | None = None
        self.server: ForkServer | None = None

    def get(self, group: str):
        from medload.bench.forkserver import ForkServer

        if group != self.group or self.server is None or self.server.proc.poll() is not None:
            self.close()
            self.server, self.group = ForkServer(self.modules[group]), group
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.server = self.group = None

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run_in_child(prep: Prepared, prep_path: Path, name: str, workers: int, settings: Settings, log_dir: Path,
                  servers: Servers) -> dict:
    tag = name.replace("/", "_").replace(":", "_").replace(".", "_")
    out = log_dir / f"{tag}-w{workers}.json"
    log = log_dir / f"{tag}-w{workers}.log"
    spec = {"name": name, "prep": str(prep_path), "out": str(out), "batch_size": settings.batch_size,
            "num_workers": workers, "device": settings.device, "warmup": settings.warmup, "batches": settings.batches,
            "repeats": settings.repeats, "max_pass_s": settings.max_pass_s}
    server = servers.get(server_group(name))
    spec["pss_root"] = server.pid
    warm_page_cache(prep)
    with peak_pss(server.pid) as peak:  # the server and its child: shared import pages count once
        code, timed_out = server.run("medload.bench.loading:_child", json.dumps(spec), log, settings.timeout)
    result = json.loads(out.read_text()) if out.exists() else {}
    if not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
        why = f"timed out after {settings.timeout:g} s" if timed_out else f"exit status {code}"
        result = {"error": f"{why}: {' | '.join(tail)}"}
    result["peak_pss_mb"] = max(peak.mb, result.pop("pss_in_run_mb", None) or 0.0)
    return result


def _row(name: str, workers: int, threads: int | None, res: dict, settings: Settings, prep: Prepared) -> dict:
    row = {"contender": name, "kind": prep.kind, "num_workers": None if threads else workers, "threads": threads,
           "status": "ok", "error": None, "dtype": "int16" if name in INT16 else "float32",
           "peak_pss_mb": res.get("peak_pss_mb"), "setup_s": res.get("setup_s"), "cache": res.get("cache")}
    if "skipped" in res:
        row.update(status="skipped", reason=res["skipped"], peak_pss_mb=None)
    elif "error" in res:
        row.update(status="failed", error=res["error"])
    else:
        rates = [n / s for n, s in zip(res["samples"], res["seconds"])]
        s = spread(rates)
        row.update(seconds=res["seconds"], samples=res["samples"], samples_per_s=s["median"],
                   samples_per_s_min=s["min"], samples_per_s_max=s["max"])
        if min(res["samples"]) < settings.batches * settings.batch_size:
            row["capped"] = True  # some pass stopped at max_pass_s
    return row


def _ratios(rows: list[dict]) -> None:
    """Every row's samples/s over each other contender's at the same num_workers (ceilings: 1 thread is
    compared with 0 workers, N threads with N workers); ``x_npy_memmap``, and ``pct_of_ceiling``: of the
    ceiling of the row's dtype (``ceiling_int16`` for int16 batches, else ``ceiling_float32``)."""
    def workers(r: dict) -> int:
        return r["num_workers"] if r["threads"] is None else (0 if r["threads"] == 1 else r["threads"])

    rate = {(r["contender"], workers(r)): r.get("samples_per_s") for r in rows}
    names = list(dict.fromkeys(r["contender"] for r in rows))
    for r in rows:
        own, w = r.get("samples_per_s"), workers(r)
        r["ratios"] = {}
        for peer in names:
            theirs = rate.get((peer, w))
            if peer != r["contender"] and own and theirs:
                r["ratios"][peer] = own / theirs
        npy = rate.get((REFERENCE, w))
        ceiling = rate.get(("ceiling_int16" if r["contender"] in INT16 else "ceiling_float32", w))
        r["x_npy_memmap"] = own / npy if own and npy else None
        r["pct_of_ceiling"] = 100 * own / ceiling if own and ceiling else None


def run_loading(prep: Prepared, work: Path, *, contenders: Sequence[str] = tuple(CONTENDERS),
                workers: Sequence[int] = (0, 2), settings: Settings = Settings(), progress: bool = True,
                label: str = "", servers: Servers | None = None) -> dict:
    """Run every contender at every ``workers`` (ceilings: at 1 and max(workers) threads) in fresh
    processes on ``prep``; every figure, as a dict. ``work``: scratch space (logs, the saved sample list);
    ``servers``: the fork servers to run from (default: started here, closed at the end)."""
    from medload.progress import progress_bar

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    prep_path = work / f"prepared-{prep.kind}.json"
    prep.save(prep_path)
    log_dir = work / f"logs-{prep.kind}"
    log_dir.mkdir(exist_ok=True)
    names = [n for n in contenders if n not in CEILINGS]
    ceilings = [n for n in contenders if n in CEILINGS]
    threads = sorted({max(1, w) for w in workers})
    plan = [(n, w, None) for w in workers for n in names] + [(n, t, t) for t in threads for n in ceilings]
    own = servers is None
    servers = servers or Servers()
    # runs grouped by fork server, starting with the one already running; rows keep the plan's order
    first = servers.group
    order = sorted(range(len(plan)), key=lambda i: (server_group(plan[i][0]) != first, server_group(plan[i][0]), i))
    rows: list[dict | None] = [None] * len(plan)
    try:
        with progress_bar(f"loading {prep.kind}{label}", len(plan), enabled=progress) as advance:
            for i in order:
                name, w, nthreads = plan[i]
                res = _run_in_child(prep, prep_path, name, w, settings, log_dir, servers)
                rows[i] = _row(name, w, nthreads, res, settings, prep)
                advance(1)
    finally:
        if own:
            servers.close()
    _ratios(cast("list[dict]", rows))  # every row is filled by now
    return {"status": "ok", "kind": prep.kind, "sample_shape": list(prep.sample_shape), "depth": prep.depth,
            "rows_px": prep.rows, "cols_px": prep.cols, "batch_size": settings.batch_size,
            "series": len(prep.series), "slices": [s.depth for s in prep.series],
            "samples_per_pass": len(prep.z0), "warmup": settings.warmup, "batches": settings.batches,
            "repeats": settings.repeats, "max_pass_s": settings.max_pass_s, "device": settings.device,
            "window": "soft_tissue 400/40", "monai_note": prep.monai_note, "note": prep.note,
            "data_mb": {"store": tree_bytes(prep.store) / 1e6,
                        "store_u8": tree_bytes(prep.store_u8) / 1e6 if prep.store_u8 else None,
                        "npy": sum(tree_bytes(s.npy) for s in prep.series if s.npy) / 1e6},
            "medload": list(MEDLOAD), "rows": rows}


# ---- the command-line script (benchmarks/loading.py) ---------------------------------------------
FULL = {"series": 4, "slices": 48, "batches": 30, "warmup": 3}
QUICK = {"series": 3, "slices": 24, "batches": 8, "warmup": 2}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/loading.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"smaller data and fewer batches ({QUICK})")
    ap.add_argument("--kind", choices=list(KINDS), default="2.5d", help="2.5D stacks of 3 or 3D slabs of 32 slices")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    ap.add_argument("--workers", default="0,2", help="DataLoader num_workers values, comma-separated (default 0,2)")
    ap.add_argument("--batches", type=int, help=f"timed batches of {BATCH_SIZE} per pass")
    ap.add_argument("--warmup", type=int, help="untimed batches before each timed pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-pass-s", type=float, default=10.0, help="stop a pass's timed batches after this long")
    ap.add_argument("--series", type=int)
    ap.add_argument("--slices", type=int)
    ap.add_argument("--size", type=int, help="rows = columns of the synthetic series (default 512; 3D: 256)")
    ap.add_argument("--device", default="cpu", help="where batches must land (cpu, cuda, cuda:1...)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="comma-separated subset, in table order (or module:function of your own)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed and marked failed")
    args = ap.parse_args(argv)
    depth = KINDS[args.kind]
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, max(value, depth + 4) if key == "slices" else value)
    args.workers = [int(w) for w in args.workers.split(",")]
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(c for c in args.contenders if c not in CONTENDERS and ":" not in c)
    if unknown:
        ap.error(f"unknown contenders {unknown}: choose from {', '.join(CONTENDERS)}")
    if args.slices < depth or args.series < 1 or args.batches < 1 or args.repeats < 1 or min(args.workers) < 0:
        ap.error(f"need --slices >= {depth}, --series >= 1, --batches >= 1, --repeats >= 1, --workers >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1])
        return
    args = _parse(argv)
    from medload.bench.common import machine
    from medload.bench.report import print_tables, section_tables

    size = args.size or (256 if args.kind == "3d" else 512)
    settings = Settings(warmup=args.warmup, batches=args.batches, repeats=args.repeats, max_pass_s=args.max_pass_s,
                        device=args.device, timeout=args.timeout)
    with tempfile.TemporaryDirectory(prefix="medload-bench-") as tmp:
        prep = prepare(Path(tmp) / "data", series=args.series, slices=args.slices, rows=size, cols=size,
                       samples=(args.warmup + args.batches) * BATCH_SIZE, kind=args.kind)
        section = run_loading(prep, Path(tmp) / "work", contenders=args.contenders, workers=args.workers,
                              settings=settings)
    results = {"loading": {args.kind: section}, "config": {"machine": machine()}}
    print_tables(section_tables(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
