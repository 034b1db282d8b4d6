"""Ingest throughput: medload at 1 and N workers against bare pydicom read+decode, dcm2niix and SimpleITK,
on the same files, in the same run.

Usage: python benchmarks/ingest.py [--data DIR [--replicate N]] [--series 8] [--slices 64] [--repeats 5]
                                   [--json OUT] [--plot PNG] [--only REGEX] [--codec raw ...]

Without --data, generates synthetic 512x512 CT series (realistic HU statistics) in a temporary folder.
``--replicate N`` copies the DICOM files of --data N times with new UIDs (pydicom rewrite, every other
tag kept), to time a larger archive with real scanner headers. The rows run medload at 1, 2, 4, ...
workers up to every core next to pydicom in as many processes (``--plot``: that curve as a PNG);
``--only`` keeps the contenders whose names the regular expression finds (``ingest_curve.sh`` uses both). The contenders and the method are
described in ``medload.bench.ingest``; ``medload bench --sections ingest`` runs the same code.
"""

from medload.bench.ingest import main

if __name__ == "__main__":
    main()
