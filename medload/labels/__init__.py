"""Segmentation labels: NIfTI/NRRD masks, DICOM SEG and RTSTRUCT, brought onto the grid of their series."""
