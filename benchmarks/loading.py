"""Loading throughput and peak memory: medload against MONAI's pipelines, .npy memmaps and ceilings.

Usage: python benchmarks/loading.py [--quick] [--kind 2.5d|3d] [--json OUT] [--workers 0,2] [--batches N]
                                    [--device cpu] [--contenders a,b,module:function]

Writes synthetic CT (DICOM folders, medload stores, .npy volumes; 512x512 for 2.5D, 256x256 for 3D) to
a temporary directory and times every contender of ``medload.bench.peers`` on the same random samples
(2.5D: 3 slices as channels; 3D: slabs of 32 slices), each in a fresh process: samples/s until a
windowed float32 batch is on the device, at each DataLoader num_workers, with ratios to npy_memmap and
to the ceiling measured in the same run, the peak PSS of each contender's process tree, and medload's
L1 hit rate. ``--help`` lists the other options; the harness is ``medload.bench.loading``, and
``medload bench`` runs it as part of the whole suite.
"""

from medload.bench.loading import main

if __name__ == "__main__":
    main()
