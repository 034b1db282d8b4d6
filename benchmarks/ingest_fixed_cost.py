"""What each ingest worker costs before its first file: CPU seconds and minor page faults of the whole
process tree of one small ingest at several worker counts (issue 32).

Usage: PYTHONPATH=. python benchmarks/ingest_fixed_cost.py [--workers 1,2,4,8] [--repeats 3] [--data DIR]

Each ingest runs in a fresh process (imports untimed, the allocator tuned as the ``medload`` command
does) and reports its wall seconds, its own CPU and its children's (reaped by the end: task, header and
decoding processes) from ``getrusage``; the median of ``--repeats`` per count. Without ``--data``, two
synthetic series of 8 slices: one task writes them, so every worker past the first only starts, and the
growth of the children's CPU from one count to the next is what a worker costs by being there.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _child(src: Path, workers: int, key: Path, store: Path) -> dict:
    from medload.allocator import keep_large_buffers_in_heap

    keep_large_buffers_in_heap()
    from medload.config import IngestConfig
    from medload.ingest.run import ingest

    self0, kids0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    ingest(src, store, config=IngestConfig(workers=workers), key_file=key)
    wall = time.perf_counter() - t0
    self1, kids1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)

    def cpu(a: resource.struct_rusage, b: resource.struct_rusage) -> float:
        return b.ru_utime - a.ru_utime + b.ru_stime - a.ru_stime

    return {"wall": wall, "ingest_cpu": cpu(self0, self1), "children_cpu": cpu(kids0, kids1),
            "children_sys": kids1.ru_stime - kids0.ru_stime, "children_faults": kids1.ru_minflt - kids0.ru_minflt}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        src, workers, key, store = sys.argv[2:6]
        print(json.dumps(_child(Path(src), int(workers), Path(key), Path(store))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", type=Path)
    args = ap.parse_args()
    from medload.bench.ingest import make_data
    from medload.deid import create_key

    with tempfile.TemporaryDirectory(prefix="medload-fixed-") as tmp:
        src = args.data or make_data(Path(tmp), 2, 8)
        key = create_key(Path(tmp) / "k.key")
        for n in (int(x) for x in args.workers.split(",")):
            runs = []
            for r in range(args.repeats):
                out = subprocess.run([sys.executable, __file__, "--child", str(src), str(n), str(key), f"{tmp}/s{n}-{r}"],
                                     capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"{n:3d} workers: wall {med['wall']:.3f} s, ingest process CPU {med['ingest_cpu']:.3f} s, children "
                  f"CPU {med['children_cpu']:.3f} s (system {med['children_sys']:.3f}), children's minor faults "
                  f"{med['children_faults']:,.0f}")


if __name__ == "__main__":
    main()
