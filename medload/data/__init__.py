"""Training data: 2.5D and 3D datasets over a store, the fast loader, samplers, augmentation, MONAI reader;
3D patches at a target spacing and orientation, and sliding-window inference back onto the stored grid."""

from typing import Any

from medload.data.augment import AugmentConfig, BatchAugment
from medload.data.datasets import SlabDataset, SliceDataset
from medload.data.distributed import (
    DistributedPatientSampler,
    assign_ranks,
    locality_order,
    partition_by_patient,
    sample_layout,
    shards_for_rank,
)
from medload.data.inference import predict_series, target_grid
from medload.data.loader import DeviceLoader, make_loader
from medload.data.patch_augment import PatchAugment
from medload.data.patches import PatchDataset
from medload.data.samplers import ForegroundSampler, SeriesGroupedSampler, UniformSampler
from medload.data.splits import PatientSplit, split_patients


def __getattr__(name: str) -> Any:
    """``MedloadReader`` is a MONAI ImageReader: MONAI loads when it is first asked for, not with the
    datasets and the loader (it adds about 200 MB to every process, DataLoader workers included)."""
    if name == "MedloadReader":
        from medload.data.monai_reader import MedloadReader

        return MedloadReader
    raise AttributeError(f"module 'medload.data' has no attribute {name!r}")


__all__ = ["SliceDataset", "SlabDataset", "make_loader", "DeviceLoader", "MedloadReader", "AugmentConfig",
           "BatchAugment", "UniformSampler", "ForegroundSampler", "SeriesGroupedSampler", "DistributedPatientSampler",
           "partition_by_patient", "assign_ranks", "locality_order", "shards_for_rank", "sample_layout",
           "PatientSplit", "split_patients", "PatchDataset", "PatchAugment", "predict_series", "target_grid"]
