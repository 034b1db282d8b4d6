"""Peak memory of an ingest of many small files: what the ingest process holds per file (issue 32).

Usage: PYTHONPATH=. python benchmarks/ingest_rss.py --files 100000 [--workers 2] [--keep DIR]

Writes one synthetic CT series of 100 slices of 16x16 with pydicom (medload.synthetic), then copies it
``files / 100`` times, each copy with a new SeriesInstanceUID of the same length patched into the bytes
(fast: the copies differ only in that UID), and ingests the lot in a fresh process. Prints the peak RSS of
the ingest process (``ru_maxrss`` of itself: the process that holds every file's header until its series
is planned) and of its largest child (task and decoding processes), the files/s, and the peak per
million files (the ingest process's peak, less that of an ingest of one series, scaled).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pydicom

from medload.synthetic import SeriesSpec, make_series

_CHILD = """
import json, resource, sys, time
from medload.config import IngestConfig
from medload.ingest import ingest
t0 = time.perf_counter()
report = ingest(sys.argv[1], sys.argv[2], config=IngestConfig(workers=int(sys.argv[3])), key_file=sys.argv[4])
seconds = time.perf_counter() - t0
print(json.dumps({"counts": report.counts, "files": report.files, "seconds": seconds,
                  "self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def make_files(root: Path, files: int) -> Path:
    make_series(root / "template", SeriesSpec(n_slices=100, rows=16, cols=16), seed=1000)
    template = sorted((root / "template").rglob("*.dcm"))
    uid = pydicom.dcmread(template[0], stop_before_pixels=True).SeriesInstanceUID.encode()
    datas = [p.read_bytes() for p in template]
    out = root / "dicom"
    for k in range(max(1, files // len(datas))):
        folder = out / f"c{k // 100:04d}" / f"s{k:06d}"
        folder.mkdir(parents=True)
        new = uid[:-7] + f"9{k:06d}".encode()
        for i, data in enumerate(datas):
            (folder / f"{i:03d}.dcm").write_bytes(data.replace(uid, new))
    return out


def run(src: Path, store: Path, workers: int, key: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(store), str(workers), str(key)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip()[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    from medload.deid import create_key

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="folder for the files and stores (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="medload-rss-") as tmp:
        root = args.keep or Path(tmp)
        key = create_key(root / "key")
        src = make_files(root, args.files)
        base = run(root / "template", root / "store-base", args.workers, key)
        big = run(src, root / "store", args.workers, key)
    per_million = (big["self_mb"] - base["self_mb"]) / big["files"] * 1e6
    print(f"{big['files']} files, {args.workers} workers: {big['counts']['ingested']} series in {big['seconds']:.0f} s "
          f"({big['files'] / big['seconds']:.0f} files/s); peak RSS of the ingest process {big['self_mb']:.0f} MB "
          f"(one series: {base['self_mb']:.0f} MB), of its largest child {big['children_mb']:.0f} MB; "
          f"{per_million:.0f} MB per million files")


if __name__ == "__main__":
    main()
