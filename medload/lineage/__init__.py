"""Data lineage of a training run: which series, with which content, a model could learn from.

``dataset.lineage()`` / ``loader.lineage()`` return a :class:`LineageRecord`; :func:`save` writes it,
:func:`load` reads it back, :attr:`LineageRecord.digest` names it, :func:`check` says whether a store still
holds exactly that data (``medload lineage check RECORD STORE``). See docs/lineage.md.
"""

from medload.lineage.check import LineageCheck, SeriesChange, check
from medload.lineage.record import (
    FORMAT,
    VERSION,
    LineageError,
    LineageRecord,
    LineageSeries,
    load,
    make_record,
    save,
    store_identity,
)

__all__ = ["LineageRecord", "LineageSeries", "LineageError", "LineageCheck", "SeriesChange", "make_record",
           "store_identity", "save", "load", "check", "FORMAT", "VERSION"]
