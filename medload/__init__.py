"""medload: CT/DICOM archives to correct volumes in an LMDB slice store, and fast training input.

Examples:
    >>> import medload
    >>> from medload.ingest import ingest
    >>> report = ingest("sample_data/philips_ct_head/dicom", "stores/sample")
    >>> store = medload.open_store("stores/sample")
    >>> hu = store.read(store.series()[0].key, 0, 3)  # (3, rows, columns) int16
    >>> hu.shape, hu.dtype
    ((3, 512, 512), dtype('int16'))
"""

from medload import viz, windows  # viz loads matplotlib only when it draws
from medload.config import IngestConfig
from medload.errors import MedloadError
from medload.storage.records import RejectRecord, SeriesRecord
from medload.storage.store import Store, open_store
from medload.version import __version__

_TRAINING = {"SliceDataset", "SlabDataset", "make_loader", "MedloadReader"}


def __getattr__(name: str):
    """The training names import torch and MONAI: load them on first use, so ``import medload`` (and
    the command line) stays fast."""
    if name in _TRAINING:
        import medload.data

        return getattr(medload.data, name)
    raise AttributeError(f"module 'medload' has no attribute {name!r}")


__all__ = ["open_store", "Store", "SliceDataset", "SlabDataset", "make_loader", "MedloadReader", "IngestConfig", "SeriesRecord", "RejectRecord", "windows", "viz",
           "MedloadError", "__version__"]
