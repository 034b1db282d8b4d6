"""Training data: 2.5D and 3D datasets over a store, the fast loader, samplers, augmentation, MONAI reader."""

from medload.data.datasets import SlabDataset, SliceDataset
from medload.data.loader import DeviceLoader, make_loader
from medload.data.monai_reader import MedloadReader

__all__ = ["SliceDataset", "SlabDataset", "make_loader", "DeviceLoader", "MedloadReader"]
