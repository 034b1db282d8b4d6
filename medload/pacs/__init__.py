"""Ingest from a PACS: DICOMweb (PS3.18: QIDO-RS search, WADO-RS retrieval) into the same ingest as files.

``is_dicomweb_url`` is light; ``ingest_dicomweb`` and ``RetrieveOptions`` load the ingest machinery on
first use, so the command line can recognise a ``dicomweb://`` source cheaply.
"""

from medload.pacs.endpoint import is_dicomweb_url

__all__ = ["ingest_dicomweb", "RetrieveOptions", "is_dicomweb_url"]


def __getattr__(name: str):
    if name in ("ingest_dicomweb", "RetrieveOptions"):
        from medload.pacs import ingest

        return getattr(ingest, name)
    raise AttributeError(f"module 'medload.pacs' has no attribute {name!r}")
