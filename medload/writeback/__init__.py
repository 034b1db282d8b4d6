"""Results back to the hospital: a label map on a stored series as a DICOM SEG in the PACS, next to the
original images (see docs/writeback.md).

- :func:`to_seg` finds the original series in the PACS by the keyed pseudonym of its SeriesInstanceUID
  (:mod:`medload.writeback.originals`: the store never holds the UIDs), checks that its instances still
  form the stored grid, and builds the SEG with highdicom (:mod:`medload.writeback.seg`).
- :func:`push_seg` also sends it: STOW-RS to ``dicomweb://``, C-STORE to ``dimse://``
  (:mod:`medload.writeback.pacs`).

Example:
    >>> from medload.writeback import push_seg
    >>> push_seg("stores/ct", "3f2a9c", "bone.nii.gz", {1: "bone"}, to="dicomweb://pacs:8042/dicom-web",
    ...          credentials="~/.config/medload/pacs.cred")                             # doctest: +SKIP
"""

from medload.writeback.originals import SourceSeries, WritebackError, find_source_series
from medload.writeback.pacs import PacsConnection, connect
from medload.writeback.seg import PushResult, Segment, push_seg, to_seg

__all__ = ["to_seg", "push_seg", "Segment", "PushResult", "connect", "PacsConnection", "find_source_series",
           "SourceSeries", "WritebackError"]
