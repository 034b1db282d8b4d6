"""Segmentation labels: NIfTI/NRRD masks, DICOM SEG and RTSTRUCT, brought onto the grid of their series."""

from medload.labels.grid import LabelProblem, LabelVolume, SeriesGrid
from medload.labels.masks import mask_to_grid
from medload.labels.rtstruct import rtstruct_to_grid
from medload.labels.seg import seg_to_grid

__all__ = ["SeriesGrid", "LabelVolume", "LabelProblem", "mask_to_grid", "seg_to_grid", "rtstruct_to_grid"]
