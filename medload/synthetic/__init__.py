"""Synthetic CT DICOM series with known ground truth, for tests and benchmarks.

:func:`make_series` writes one series (single-frame CT Image Storage or Enhanced CT) and returns its
ground-truth HU, positions and RAS affine; :func:`make_study` writes several series of one study into
one folder. :func:`write_localizer`, :func:`write_secondary_capture` and :func:`write_broken_files`
write the non-volume and broken files an ingester must skip or quarantine; :func:`make_rtstruct`
writes an RTSTRUCT with known polygons for a generated series. :func:`write_bad_corpus` writes more
than 200 broken inputs of every kind (:mod:`medload.synthetic.broken` makes each) among good series.
:func:`add_modality_lut` gives an image a Modality LUT Sequence. :func:`make_shared_positions` writes one series of several stacks at the same positions (magnitude and
phase, B0 map, echoes, diffusion, fMRI, CT perfusion, cardiac phases), with each stack's ground truth.
"""

from medload.synthetic.corpus import BadCorpus, BadInput, write_bad_corpus
from medload.synthetic.extras import add_modality_lut, write_broken_files, write_localizer, write_secondary_capture
from medload.synthetic.phantom import phantom_hu
from medload.synthetic.rtstruct import make_rtstruct, square_polygon
from medload.synthetic.series import make_series, make_study
from medload.synthetic.spec import COMPRESSED_SYNTAXES, NATIVE_SYNTAXES, PADDING_HU, GeneratedSeries, SeriesSpec
from medload.synthetic.stacks import SHARED_POSITION_KINDS, SharedStacks, make_shared_positions

__all__ = [
    "SeriesSpec",
    "GeneratedSeries",
    "NATIVE_SYNTAXES",
    "COMPRESSED_SYNTAXES",
    "PADDING_HU",
    "phantom_hu",
    "make_series",
    "make_study",
    "write_localizer",
    "write_secondary_capture",
    "write_broken_files",
    "write_bad_corpus",
    "BadCorpus",
    "BadInput",
    "make_rtstruct",
    "square_polygon",
    "make_shared_positions",
    "add_modality_lut",
    "SharedStacks",
    "SHARED_POSITION_KINDS",
]
