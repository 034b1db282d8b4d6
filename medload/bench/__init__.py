"""Benchmarks of medload against its peers (pydicom, dcm2niix, SimpleITK, MONAI's pipelines, nnU-Net-style .npy):
``medload bench`` (:func:`medload.bench.run.run_bench`) and the scripts in ``benchmarks/``."""

from medload.extras import require_all

require_all("bench", "medload bench (its peers and plots)")
