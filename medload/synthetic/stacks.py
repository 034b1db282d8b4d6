"""Synthetic series holding several complete stacks at the same positions, as scanners write them.

:func:`make_shared_positions` writes one SeriesInstanceUID whose stacks differ only by what tells them
apart in the headers (see :mod:`medload.ingest.splits`), each with its own pixels:

====================  =========================================================================  ==================
kind                  what the stacks differ by                                                  labels
====================  =========================================================================  ==================
``swi``               MR images, ImageType (0008,0008) ``...\\M_SWI\\M\\SW_M`` / ``...\\P_SWI\\P\\SW_P``  magnitude, phase
``b0map``             one Enhanced MR file: FrameType ``...\\M_FFE\\M`` with EffectiveEchoTime 1.52 ms  field_map, magnitude
                      / ``...\\B0\\FIELD_MAP`` with 0 ms (per-frame MRImageFrameTypeSequence and
                      MREchoSequence)
``echo``              one Enhanced MR file: per-frame MREchoSequence EffectiveEchoTime 5, 10, 15...  echo_1, echo_2...
``dwi``               MR images: DiffusionBValue (0018,9087) 0, then 1000 along z, y, x...        b0, b1000_dir01...
``fmri``              MR images: TemporalPositionIdentifier and AcquisitionNumber per volume,       t_01, t_02...
                      AcquisitionTime per slice (interleaved, as a 2-D sequence writes it)
``perfusion``         CT images: only AcquisitionTime per rotation (+1 ms per slice)               t_01, t_02...
``cardiac``           one Enhanced CT file: per-frame FrameContentSequence TemporalPositionIndex   t_01, t_02...
``pcasl``             one Enhanced MR file: label and control frames told apart only by             dim_2005_1011_1, _2
                      DimensionIndexValues, on a Philips private dimension (2005,1011)
====================  =========================================================================  ==================

and the kinds of :mod:`medload.synthetic.fourd` (vendor tags, InstanceNumber, ties on acquisition time).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pydicom
from pydicom.dataset import Dataset
from pydicom.tag import BaseTag, Tag
from pydicom.uid import EnhancedMRImageStorage, MRImageStorage

from medload.errors import ConfigError
from medload.synthetic.dataset import synthetic_uid
from medload.synthetic.fourd import PRIVATE_KINDS, private_stack_attributes
from medload.synthetic.series import make_series
from medload.synthetic.spec import GeneratedSeries, SeriesSpec

__all__ = ["SharedStacks", "make_shared_positions", "SHARED_POSITION_KINDS"]

#: the private dimension of ``pcasl`` (a Philips pCASL label/control index), as DimensionIndexPointer
PCASL_DIMENSION = Tag(0x2005, 0x1011)
_ENHANCED = {"b0map", "echo", "cardiac", "pcasl"}
#: the third dimension of an Enhanced kind (after StackID and InStackPositionNumber): what tells its stacks apart
_DIMENSION: dict[str, tuple[str | BaseTag, str | BaseTag]] = {"b0map": ("FrameType", "MRImageFrameTypeSequence"), "echo": ("EffectiveEchoTime", "MREchoSequence"),
              "cardiac": ("TemporalPositionIndex", "FrameContentSequence"),
              "pcasl": (PCASL_DIMENSION, Tag(0x2005, 0x140F))}
SHARED_POSITION_KINDS = ("swi", "b0map", "echo", "dwi", "fmri", "perfusion", "cardiac", "pcasl", *PRIVATE_KINDS)


@dataclass
class SharedStacks:
    """What :func:`make_shared_positions` wrote: the files, and each stack's ground truth by the label
    its split should get (``stacks["phase"].hu``, ``.affine_ras``; their ``paths`` are empty, the files
    of every stack are ``paths``)."""

    kind: str
    paths: list[Path]
    series_uid: str
    stacks: dict[str, GeneratedSeries] = field(default_factory=dict)


def _item(**elements: object) -> Dataset:
    item = Dataset()
    for keyword, value in elements.items():
        setattr(item, keyword, value)
    return item


def _labels(kind: str, count: int) -> list[str]:
    if kind == "swi":
        return ["magnitude", "phase"]
    if kind == "b0map":
        return ["magnitude", "field_map"]
    if kind == "echo":
        return [f"echo_{k}" for k in range(1, count + 1)]
    if kind == "pcasl":
        return ["dim_2005_1011_1", "dim_2005_1011_2"]
    if kind in ("dwi", "ge_dwi", "siemens_dwi", "siemens_csa"):
        return ["b0"] + [f"b1000_dir{k:02d}" for k in range(1, count)]
    width = max(2, len(str(count)))
    return [f"t_{k:0{width}d}" for k in range(1, count + 1)]


def _classic(ds: Dataset, kind: str, s: int, k: int, n_slices: int) -> None:
    """Per-stack attributes of single-frame image ``k`` of stack ``s``."""
    if kind != "perfusion":
        ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = MRImageStorage
        ds.Modality = "MR"
        ds.EchoTime = "20"
        del ds.RescaleType
    if kind == "swi":
        ds.ImageType = ["ORIGINAL", "PRIMARY", "M_SWI", "M", "SW_M"] if s == 0 else \
            ["ORIGINAL", "PRIMARY", "P_SWI", "P", "SW_P"]
    elif kind == "dwi":
        ds.DiffusionBValue = 0.0 if s == 0 else 1000.0
        if s:
            ds.DiffusionGradientOrientation = [float(v) for v in np.eye(3)[2 - (s - 1) % 3]]  # z, y, x: ascending
    elif kind == "fmri":
        ds.TemporalPositionIdentifier = s + 1
        ds.AcquisitionNumber = s + 1
        order = (k * 2) % n_slices + (k * 2) // n_slices  # interleaved: slice times not in position order
        ds.AcquisitionTime = f"{100000 + 2 * s:06d}.{order * 100:06d}"
    elif kind == "perfusion":
        ds.AcquisitionTime = f"{100000 + s:06d}.{k * 1000:06d}"
    elif kind in PRIVATE_KINDS:
        private_stack_attributes(ds, kind, s)
    ds.InstanceNumber = s * n_slices + k + 1


def _merge_enhanced(parts: list[Path], kind: str, out: Path) -> Path:
    """One Enhanced file holding the frames of every part (one part per stack), with per-frame
    attributes telling the stacks apart."""
    datasets = [pydicom.dcmread(p) for p in parts]
    ds = datasets[0]
    per_frame = []
    for s, part in enumerate(datasets):
        for item in part.PerFrameFunctionalGroupsSequence:
            if kind == "b0map":
                frame_type = ["ORIGINAL", "PRIMARY", "M_FFE", "M"] if s == 0 else ["ORIGINAL", "PRIMARY", "B0", "FIELD_MAP"]
                item.MRImageFrameTypeSequence = [_item(FrameType=frame_type, PixelPresentation="MONOCHROME",
                                                       VolumetricProperties="VOLUME",
                                                       VolumeBasedCalculationTechnique="NONE",
                                                       ComplexImageComponent="MAGNITUDE")]
                item.MREchoSequence = [_item(EffectiveEchoTime=1.52 if s == 0 else 0.0)]
            elif kind == "echo":
                item.MREchoSequence = [_item(EffectiveEchoTime=5.0 * (s + 1))]
            elif kind == "pcasl":
                pass  # label and control: told apart by DimensionIndexValues alone
            else:
                item.FrameContentSequence[0].TemporalPositionIndex = s + 1
            content = item.FrameContentSequence[0]
            content.DimensionIndexValues = [1, int(content.InStackPositionNumber), s + 1]
            per_frame.append(item)
    pointer, group = _DIMENSION[kind]
    ds.DimensionIndexSequence.append(_item(DimensionOrganizationUID=ds.DimensionIndexSequence[0].DimensionOrganizationUID,
                                           DimensionIndexPointer=Tag(pointer), FunctionalGroupPointer=Tag(group)))
    ds.PerFrameFunctionalGroupsSequence = per_frame
    ds.NumberOfFrames = len(per_frame)
    # as scanners write it: without it a reader may take the spacing from the first and last of all frames
    first, second = (f.PlanePositionSequence[0].ImagePositionPatient for f in datasets[0].PerFrameFunctionalGroupsSequence[:2])
    measures = ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0]
    measures.SpacingBetweenSlices = f"{float(np.linalg.norm(np.subtract(second, first))):g}"
    ds.PixelData = b"".join(part.PixelData for part in datasets)
    if kind in ("b0map", "echo", "pcasl"):
        ds.SOPClassUID = ds.file_meta.MediaStorageSOPClassUID = EnhancedMRImageStorage
        ds.Modality = "MR"
        shared = ds.SharedFunctionalGroupsSequence[0]
        frame_type = shared.CTImageFrameTypeSequence[0]
        del shared.CTImageFrameTypeSequence, shared.CTXRayDetailsSequence, shared.CTReconstructionSequence
        if kind in ("echo", "pcasl"):
            shared.MRImageFrameTypeSequence = [frame_type]
    ds.save_as(out, enforce_file_format=True)
    return out


def make_shared_positions(out_dir: Path, kind: str, *, count: int | None = None, seed: int = 0,
                          n_slices: int = 4, rows: int = 24, cols: int = 20) -> SharedStacks:
    """Write one series of ``count`` stacks at the same ``n_slices`` axial positions into ``out_dir``
    (kinds in the module docstring; ``count`` defaults to 2 for ``swi``/``b0map``, else 3)."""
    if kind not in SHARED_POSITION_KINDS:
        raise ConfigError(f"kind {kind!r}: use one of {', '.join(SHARED_POSITION_KINDS)}")
    count = count or (2 if kind in ("swi", "b0map", "pcasl") else 3)
    if kind in ("swi", "b0map", "pcasl") and count != 2:
        raise ConfigError(f"a {kind} series has 2 stacks, not {count}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    series_uid = synthetic_uid("shared-positions", kind, seed)
    spec = SeriesSpec(n_slices=n_slices, rows=rows, cols=cols, origin=(-10.0, -12.0, 30.0), slice_spacing=3.0,
                      multiframe=kind in _ENHANCED)
    result = SharedStacks(kind, [], series_uid)
    with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
        parts = []
        for s, label in enumerate(_labels(kind, count)):
            gen = make_series(Path(scratch) / str(s), spec, seed=seed * 100 + s, study_uid=synthetic_uid("study", seed),
                              shuffle=False)
            result.stacks[label] = gen
            for k, path in enumerate(gen.paths):
                ds = pydicom.dcmread(path)
                ds.SeriesInstanceUID = series_uid
                if kind not in _ENHANCED:
                    _classic(ds, kind, s, k, n_slices)
                ds.save_as(path, enforce_file_format=True)
            parts += gen.paths
        if kind in _ENHANCED:
            result.paths = [_merge_enhanced(parts, kind, out_dir / f"{kind}_{seed}.dcm")]
        else:
            for s, gen in enumerate(result.stacks.values()):
                for k, path in enumerate(gen.paths):
                    target = out_dir / f"{kind}_{seed}_{s:02d}_{k:03d}.dcm"
                    target.write_bytes(path.read_bytes())
                    result.paths.append(target)
    for gen in result.stacks.values():
        gen.paths = []
    return result
