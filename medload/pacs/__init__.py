"""Ingest from a PACS into the same ingest as files: DICOMweb (PS3.18: QIDO-RS search, WADO-RS retrieval)
or DIMSE (PS3.4/PS3.7: C-FIND, C-GET).

``is_dicomweb_url`` and ``is_dimse_url`` are light; ``ingest_dicomweb``, ``ingest_dimse`` and
``RetrieveOptions`` load the ingest machinery on first use, so the command line can recognise a
``dicomweb://`` or ``dimse://`` source cheaply.
"""

from medload.pacs.endpoint import is_dicomweb_url, is_dimse_url

__all__ = ["ingest_dicomweb", "ingest_dimse", "RetrieveOptions", "is_dicomweb_url", "is_dimse_url"]


def __getattr__(name: str):
    if name in ("ingest_dicomweb", "ingest_dimse", "RetrieveOptions"):
        from medload.pacs import ingest

        return getattr(ingest, name)
    raise AttributeError(f"module 'medload.pacs' has no attribute {name!r}")
