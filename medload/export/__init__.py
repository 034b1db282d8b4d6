"""Exports of a store for other training frameworks: an nnU-Net v2 raw dataset (:mod:`medload.export.nnunet`)."""

from medload.export.nnunet import NnunetCase, NnunetExport, export_nnunet

__all__ = ["NnunetCase", "NnunetExport", "export_nnunet"]
