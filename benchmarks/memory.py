"""The allocator effects behind two design choices, measured in fresh processes side by side.

1. Ingest decode stages with and without ``keep_large_buffers_in_heap`` (medload.allocator): per-slice
   microseconds for reading the file, decoding to HU, encoding and hashing.
2. The CPU training loader with and without recycling its float batch buffers (medload.data.loader):
   samples/s per epoch and the trainer's heap (glibc mallinfo2) and PSS after three epochs.

Usage: python benchmarks/memory.py [--data DICOM_DIR] [--store STORE]
(defaults: synthetic CT generated and ingested into a temporary folder)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ["arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"]]


def _heap_mb() -> tuple[int, int]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.arena >> 20, info.uordblks >> 20


def _pss_mb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("Pss:"))


def stages(src: Path, tuned: bool) -> dict:
    """Child: per-slice microseconds of each decode stage (in-process worker code)."""
    import numpy as np
    import xxhash

    from medload.allocator import keep_large_buffers_in_heap
    from medload.config import IngestConfig
    from medload.deid import Pseudonymizer, load_key
    from medload.ingest import worker
    from medload.ingest.discover import discover, read_source
    from medload.ingest.pixels import LoadedFile, decode_plane
    from medload.storage.codec import encode_value, get_codec
    from medload.storage.digest import slice_digest

    if tuned:
        keep_large_buffers_in_heap()
    worker.init_worker(Pseudonymizer(load_key()), IngestConfig(), own_process=False)
    headers = [h for r in worker.header_batch(list(discover(src))) if isinstance(r, list) for h in r]
    codec = get_codec("blosc2-lz4")
    out = {}
    for name in ("first pass", "second pass"):  # page cache warm for both (the parent read the files)
        totals = dict(read=0.0, decode=0.0, encode=0.0, hashes=0.0)
        for h in headers:
            t0 = time.perf_counter()
            data = read_source(h.ref)
            t1 = time.perf_counter()
            values, _ = decode_plane(LoadedFile(data), h, h.modality or "CT", "int16")
            t2 = time.perf_counter()
            encode_value(values, codec)
            t3 = time.perf_counter()
            slice_digest(values), xxhash.xxh3_64_hexdigest(data), np.ndim(values)
            t4 = time.perf_counter()
            for stage, dt in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                totals[stage] += dt
        out[name] = {stage: round(v / len(headers) * 1e6, 1) for stage, v in totals.items()}
    return out


def loader(store: Path, recycle: bool) -> dict:
    """Child: three epochs of the CPU loader; samples/s per epoch, heap and PSS at the end."""
    from medload.data import SliceDataset, buffers, make_loader
    from medload.storage.store import open_store

    if not recycle:  # what every batch would cost without the recycler: a fresh float tensor
        buffers.Recycler.empty = lambda self, shape, dtype: buffers.torch.empty(shape, dtype=dtype)
    ds = SliceDataset(open_store(store, cache="2GB"), context=1)
    batches = make_loader(ds, batch_size=8, num_workers=0, window="soft_tissue")
    rates = []
    for _ in range(3):
        t0, n = time.perf_counter(), 0
        for batch in batches:
            n += batch["image"].shape[0]
        rates.append(round(n / (time.perf_counter() - t0)))
    heap, in_use = _heap_mb()
    return {"samples_per_s": rates, "heap_mb": heap, "heap_in_use_mb": in_use, "pss_mb": _pss_mb()}


def _child(kind: str, path: Path, flag: bool) -> dict:
    out = subprocess.run([sys.executable, str(HERE), "--child", kind, str(path), str(int(flag))], check=True,
                         capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        kind, path, flag = sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "1"
        print(json.dumps(stages(path, flag) if kind == "stages" else loader(path, flag)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path)
    ap.add_argument("--store", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not os.environ.get("MEDLOAD_KEY_FILE"):  # a throw-away key, never the user's own
            from medload.deid import create_key

            os.environ["MEDLOAD_KEY_FILE"] = str(create_key(tmp / "bench.key"))
        src, store = args.data, args.store
        if src is None or store is None:
            from medload.config import IngestConfig
            from medload.ingest import ingest
            from medload.synthetic import SeriesSpec, make_series

            src = src or tmp / "dicom"
            for i in range(4):
                make_series(src, SeriesSpec(n_slices=48, rows=512, cols=512), seed=300 + i, series_number=i + 1)
            store = store or tmp / "store"
            ingest(src, store, config=IngestConfig(workers=1))
        print("ingest stages, us per slice:")
        for tuned in (False, True):
            print(f"  allocator tuned={tuned}: {_child('stages', src, tuned)}")
        print("CPU loader, 2.5D batch 8, 3 epochs:")
        for recycle in (False, True):
            print(f"  recycle={recycle}: {_child('loader', store, recycle)}")


if __name__ == "__main__":
    main()
