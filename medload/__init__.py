"""medload: CT/DICOM archives to correct volumes in an LMDB slice store, and fast training input."""

__version__ = "0.1.0"
