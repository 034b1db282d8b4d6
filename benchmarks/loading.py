"""2.5D loading throughput and peak memory: medload against MONAI's pipelines, .npy memmaps and ceilings.

Usage: python benchmarks/loading.py [--quick] [--json OUT] [--workers 0,2] [--batches N] [--device cpu]

Writes synthetic 512x512 CT (DICOM folders, medload stores, .npy volumes) to a temporary directory and
times every contender of ``medload.bench.peers`` on the same random (series, z) samples, each in a fresh
process: samples/s until a windowed float32 batch (B, 3, 512, 512) is on the device, at each DataLoader
num_workers, with ratios to npy_memmap and to the ceiling measured in the same run, and the peak PSS of
each contender's process tree. ``--help`` lists the other options; the harness is ``medload.bench.loading``.
"""

from medload.bench.loading import main

if __name__ == "__main__":
    main()
