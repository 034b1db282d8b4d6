"""Write synthetic CT series into one folder: ``python sample_data/make_synthetic.py OUT_DIR``.

By default three series of one study: axial unsigned 12-bit, oblique signed 16-bit with per-slice
RescaleIntercept, and oblique RLE Lossless; all with shuffled file names and InstanceNumbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from pydicom.uid import UID, RLELossless

from medload.synthetic import SeriesSpec, make_study

PRESETS = (
    SeriesSpec(),
    SeriesSpec(orientation="oblique", signed=True, bits_stored=16, per_slice_intercept=True),
    SeriesSpec(orientation="oblique", transfer_syntax=RLELossless),
)


def describe(spec: SeriesSpec) -> str:
    """A SeriesDescription (0008,103E) saying how the series was written."""
    kind = f"{'int' if spec.signed else 'uint'}{spec.bits_stored}"
    text = f"{spec.orientation} {kind} {UID(spec.transfer_syntax).keyword}"
    return text + (" per-slice intercept" if spec.per_slice_intercept else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write into (created if missing)")
    parser.add_argument("--series", type=int, default=len(PRESETS), help="number of series (cycles the presets)")
    parser.add_argument("--seed", type=int, default=0, help="seed: the same seed writes the same files")
    parser.add_argument("--oblique", action="store_true", help="make every series oblique")
    parser.add_argument("--compressed", action="store_true", help="write every series as RLE Lossless")
    args = parser.parse_args(argv)
    if args.series < 1:
        parser.error("--series must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    specs = []
    for i in range(args.series):
        spec = PRESETS[i % len(PRESETS)]
        if args.oblique:
            spec = dataclasses.replace(spec, orientation="oblique")
        if args.compressed:
            spec = dataclasses.replace(spec, transfer_syntax=RLELossless)
        specs.append(dataclasses.replace(spec, series_description=describe(spec)))
    for series in make_study(args.out_dir, specs, seed=args.seed):
        logging.info("%s: %d file(s), %s, %r", series.series_uid, len(series.paths), series.hu.shape,
                     series.spec.series_description)


if __name__ == "__main__":
    main()
