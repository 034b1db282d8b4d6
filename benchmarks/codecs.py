"""Measure slice codecs on real CT slices: compression ratio, encode and decode speed (one thread).

Usage: python benchmarks/codecs.py [DICOM_DIR ...]   (default: the shipped Philips head CT)

Every candidate round-trips every slice exactly (checked), so only speed and size differ. The figures
printed here are the ones recorded in the README's "Slice codec" section.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import blosc2
import lz4.frame
import numpy as np
import pydicom
import zstandard
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIRS = [REPO / "sample_data" / "philips_ct_head" / "dicom" / "S2010"]


def load_slices(dirs: list[Path]) -> list[np.ndarray]:
    """HU int16 slices of every CT file in the folders (rescale applied)."""
    out = []
    for d in dirs:
        for p in sorted(d.iterdir()):
            ds = pydicom.dcmread(p)
            hu = ds.pixel_array.astype(np.int32) * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
            out.append(np.ascontiguousarray(hu.astype(np.int16)))
    return out


def _blosc(codec: blosc2.Codec, level: int, filt: blosc2.Filter):
    cparams = {"codec": codec, "clevel": level, "filters": [filt], "typesize": 2, "nthreads": 1}

    def enc(a: np.ndarray) -> bytes:
        return blosc2.compress2(a, **cparams)

    def dec(b: bytes, a: np.ndarray) -> np.ndarray:
        return np.frombuffer(blosc2.decompress2(b), dtype=a.dtype)

    return enc, dec


def candidates():
    zc1, zc3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    zd = zstandard.ZstdDecompressor()
    yield "raw", (lambda a: a.tobytes()), (lambda b, a: np.frombuffer(b, a.dtype))
    yield "zstd-1", (lambda a: zc1.compress(a.tobytes())), (lambda b, a: np.frombuffer(zd.decompress(b), a.dtype))
    yield "zstd-3", (lambda a: zc3.compress(a.tobytes())), (lambda b, a: np.frombuffer(zd.decompress(b), a.dtype))
    yield "lz4", (lambda a: lz4.frame.compress(a.tobytes())), (lambda b, a: np.frombuffer(lz4.frame.decompress(b), a.dtype))
    for name, codec in (("lz4", blosc2.Codec.LZ4), ("zstd", blosc2.Codec.ZSTD)):
        for level in (1, 5):
            for fname, filt in (("shuffle", blosc2.Filter.SHUFFLE), ("bitshuffle", blosc2.Filter.BITSHUFFLE)):
                yield (f"blosc2-{name}-{fname}-{level}", *_blosc(codec, level, filt))


def measure(slices: list[np.ndarray], repeats: int = 5) -> list[dict]:
    raw_bytes = sum(a.nbytes for a in slices)
    rows = []
    for name, enc, dec in candidates():
        blobs = [enc(a) for a in slices]
        for a, b in zip(slices, blobs):
            if not np.array_equal(dec(b, a).reshape(a.shape), a):
                raise RuntimeError(f"{name} does not round-trip")
        t_enc, t_dec = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for a in slices:
                enc(a)
            t_enc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for a, b in zip(slices, blobs):
                dec(b, a)
            t_dec.append(time.perf_counter() - t0)
        rows.append({
            "codec": name,
            "ratio": raw_bytes / sum(len(b) for b in blobs),
            "encode_MBps": raw_bytes / np.median(t_enc) / 1e6,
            "decode_MBps": raw_bytes / np.median(t_dec) / 1e6,
        })
    return rows


def main() -> None:
    dirs = [Path(a) for a in sys.argv[1:]] or DEFAULT_DIRS
    slices = load_slices(dirs)
    rows = measure(slices)
    table = Table(title=f"{len(slices)} CT slices, {sum(a.nbytes for a in slices) / 1e6:.1f} MB int16, one thread, median of 5")
    for col in ("codec", "ratio", "encode MB/s", "decode MB/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["codec"], f"{r['ratio']:.2f}", f"{r['encode_MBps']:.0f}", f"{r['decode_MBps']:.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
