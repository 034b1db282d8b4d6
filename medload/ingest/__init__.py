"""Ingest: DICOM files, folders and archives → checked volumes in a medload store."""

from medload.ingest.run import ingest

__all__ = ["ingest"]
