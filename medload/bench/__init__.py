"""Benchmarks of medload against its peers (MONAI's pipelines, nnU-Net-style .npy), run from ``benchmarks/``."""
