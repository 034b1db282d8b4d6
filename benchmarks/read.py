"""Random 2.5D reads (3 x 512 x 512) per second through each cache tier, against the raw limit.

Usage: python benchmarks/read.py [--store DIR] [--series 4] [--slices 48] [--reads 2000] [--json OUT]

Without --store, ingests synthetic 512x512 CT into a temporary store. All contenders read the same
random (series, z) sequence in this one process, with the store's pages in the page cache:

- raw LMDB get+copy: three ``txn.get`` of the slice keys and a copy of the bytes (the floor of any read);
- raw LMDB get+decode: the same plus blosc2 decoding into a reused buffer -- no checksum, no Python
  around it: the limit an L3 read is measured against;
- L3 read: ``Store.read`` with no L1 and no hot directory (cursor range scan, checksum, decode);
- L3 read, verify=False: the same without checksums (their cost);
- L2 hit: ``Store.read`` served from verified hot copies of the shards (no L1);
- L1 hit: ``Store.read`` with every slice already in the in-process LRU;
- L1 hit, out=: the same into a reused buffer (as the training loader reads, into its batch slots);
- copy floor: three decoded slices, out of CPU cache, copied into a new array -- what any L1 hit that
  returns a fresh array must cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from medload.config import CacheConfig, IngestConfig
from medload.storage import shard as sh
from medload.storage.codec import CODECS
from medload.storage.keys import slice_key
from medload.storage.manifest import shard_path
from medload.storage.store import open_store

_HEADER = 16  # bytes of a value's header before the codec payload (medload.storage.codec)
_CHECK = 8


def build_store(root: Path, series: int, slices: int) -> Path:
    from medload.ingest import ingest
    from medload.synthetic import SeriesSpec, make_series

    for i in range(series):
        make_series(root / "src", SeriesSpec(n_slices=slices, rows=512, cols=512, slice_spacing=1.0), seed=200 + i,
                    series_number=i + 1)
    ingest(root / "src", root / "store", config=IngestConfig(workers=1))
    return root / "store"


def timed(fn, picks, repeats: int = 3) -> list[float]:
    """Seconds per read, for each repeat over the whole pick sequence (one warm-up pass first)."""
    for key, z in picks[: len(picks) // 4]:
        fn(key, z)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for key, z in picks:
            fn(key, z)
        out.append((time.perf_counter() - t0) / len(picks))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path)
    ap.add_argument("--series", type=int, default=4)
    ap.add_argument("--slices", type=int, default=48)
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not os.environ.get("MEDLOAD_KEY_FILE"):  # a throw-away key, never the user's own
            from medload.deid import create_key

            os.environ["MEDLOAD_KEY_FILE"] = str(create_key(tmp / "bench.key"))
        path = args.store or build_store(tmp, args.series, args.slices)
        base = open_store(path, CacheConfig(l1_bytes=0))
        records = [r for r in base.series() if r.shape[0] >= 3]
        rng = np.random.default_rng(0)
        picks = []
        for _ in range(args.reads):
            rec = records[rng.integers(len(records))]
            picks.append((rec.key, int(rng.integers(rec.shape[0] - 2))))
        by_key = {r.key: r for r in records}
        shape = (3, *records[0].shape[1:])

        buf = np.empty(shape, dtype=np.int16)
        envs = {name: sh.reader_env(shard_path(path, name)) for name in {r.shard for r in records}}

        def raw(key: str, z: int, decode: bool) -> None:
            rec = by_key[key]
            env = envs[rec.shard]
            with env.begin(buffers=True) as txn:
                db = sh.open_dbs(env, [sh.SLICES], create=False, txn=txn)[sh.SLICES]
                for i in range(3):
                    v = txn.get(slice_key(rec.key_bytes, z + i), db=db)
                    if decode:
                        CODECS[base.manifest.codec].decompress_into(v[_HEADER : len(v) - _CHECK], buf[i])
                    else:
                        bytes(v)

        l3 = open_store(path, CacheConfig(l1_bytes=0))
        hot = open_store(path, CacheConfig(l1_bytes=0, hot_dir=tmp / "hot", hot_budget=1 << 40, fetch="never"))
        for entry in hot.manifest.shards:
            hot._tiers.hot.fetch(shard_path(path, entry.name) / "data.mdb", entry)
        l1 = open_store(path, CacheConfig(l1_bytes=2 << 30))
        decoded = {}
        for rec in records:
            volume = l1.read(rec.key)
            decoded.update({(rec.key, z): volume[z].copy() for z in range(rec.shape[0])})

        reused = np.empty(shape, dtype=np.int16)

        def copy_floor(key: str, z: int) -> None:
            out = np.empty(shape, dtype=np.int16)
            for i in range(3):
                out[i] = decoded[(key, z + i)]
        contenders = {
            "raw LMDB get+copy": lambda k, z: raw(k, z, False),
            "raw LMDB get+decode (limit)": lambda k, z: raw(k, z, True),
            "L3 read": lambda k, z: l3.read(k, z, z + 3),
            "L3 read, verify=False": lambda k, z: l3.read(k, z, z + 3, verify=False),
            "L2 hit (hot copy)": lambda k, z: hot.read(k, z, z + 3),
            "L1 hit": lambda k, z: l1.read(k, z, z + 3),
            "L1 hit, out= reused buffer": lambda k, z: l1.read(k, z, z + 3, out=reused),
            "copy floor (3 decoded slices)": copy_floor,
        }
        rows = []
        for name, fn in contenders.items():
            times = timed(fn, picks)
            med = statistics.median(times)
            rows.append({"contender": name, "us_per_read": med * 1e6, "us_min": min(times) * 1e6,
                         "us_max": max(times) * 1e6, "reads_per_s": 1 / med})
        tiers = {"l1": l1.stats(), "l2": hot.stats(), "l3": l3.stats()}
    by = {r["contender"]: r for r in rows}
    limit = by["raw LMDB get+decode (limit)"]["us_per_read"]
    l3_us = by["L3 read"]["us_per_read"]
    for r in rows:
        r["x_limit"] = r["us_per_read"] / limit
        r["speedup_vs_l3"] = l3_us / r["us_per_read"]
    table = Table(title=f"random 2.5D reads {shape[0]}x{shape[1]}x{shape[2]} int16, {args.reads} reads x 3 repeats, "
                        f"{len(records)} series (median, min-max)")
    for col in ("contender", "us/read", "reads/s", "time vs raw limit", "speed vs L3"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["contender"], f"{r['us_per_read']:.0f} ({r['us_min']:.0f}-{r['us_max']:.0f})",
                      f"{r['reads_per_s']:.0f}", f"{r['x_limit']:.2f}", f"{r['speedup_vs_l3']:.1f}")
    Console(width=150).print(table)
    Console(width=150).print({k: v for k, v in tiers["l1"].items()}, tiers["l2"]["l2"], tiers["l3"]["l3"])
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "tiers": tiers}, indent=2))


if __name__ == "__main__":
    main()
