"""Write synthetic CT series: one CT Image Storage file per slice, or one Enhanced CT file."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset
from pydicom.tag import Tag
from pydicom.uid import UID, CTImageStorage, EnhancedCTImageStorage

from medload.errors import ConfigError
from medload.synthetic.dataset import Identity, add_identity, new_dataset, save, synthetic_uid
from medload.synthetic.geometry import affine_ras, ds_values, orientation_cosines, slice_offsets, slice_positions
from medload.synthetic.phantom import phantom_hu
from medload.synthetic.pixels import PixelValues, pixel_values, set_pixel_data
from medload.synthetic.spec import GeneratedSeries, SeriesSpec

__all__ = ["make_series", "make_study"]

log = logging.getLogger(__name__)


def _is_sorted(order: np.ndarray) -> bool:
    """Whether ``order`` is the identity or its reverse."""
    ramp = np.arange(len(order))
    return bool(np.array_equal(order, ramp) or np.array_equal(order, ramp[::-1]))


def _permutation(n: int, rng: np.random.Generator) -> np.ndarray:
    """A random permutation that, for n > 2, is neither the identity nor its reverse."""
    while True:
        perm = rng.permutation(n)
        if n <= 2 or not _is_sorted(perm):
            return perm


def _file_names(n: int, rng: np.random.Generator, shuffle: bool, series_number: int) -> list[str]:
    """Random hex names whose sorted order is not the slice order, or ordered names without shuffle."""
    if not shuffle:
        return [f"S{series_number:03d}_IM{k + 1:04d}.dcm" for k in range(n)]
    while True:
        names = [rng.bytes(8).hex() + ".dcm" for _ in range(n)]
        if len(set(names)) == n and (n <= 2 or not _is_sorted(np.argsort(names))):
            return names


def _check(spec: SeriesSpec) -> None:
    """Raise ConfigError for sizes, spacings, origin or image type that cannot be written."""
    if spec.rows < 1 or spec.cols < 1:
        raise ConfigError(f"rows and cols must be positive, got {spec.rows}x{spec.cols}")
    if len(spec.pixel_spacing) != 2 or min(spec.pixel_spacing) <= 0 or spec.slice_spacing <= 0:
        raise ConfigError(f"spacings must be positive, got {spec.pixel_spacing} and {spec.slice_spacing}")
    if spec.origin is not None and len(spec.origin) != 3:
        raise ConfigError(f"origin must be 3 LPS coordinates, got {spec.origin}")
    if not spec.image_type:
        raise ConfigError("image_type needs at least one value")
    if len(spec.series_description) > 64:
        raise ConfigError(f"series_description is longer than 64 characters (LO): {spec.series_description!r}")


def _ct_acquisition(ds: Dataset, spec: SeriesSpec) -> None:
    """KVP, ConvolutionKernel, XRayTubeCurrent, ExposureTime, SliceThickness, GantryDetectorTilt."""
    ds.KVP = 120
    ds.ConvolutionKernel = "STANDARD"
    ds.XRayTubeCurrent = 200
    ds.ExposureTime = 500
    ds.SliceThickness = ds_values([spec.slice_spacing])[0]
    ds.GantryDetectorTilt = ds_values([spec.tilt_deg])[0]
    ds.ReconstructionDiameter = ds_values([spec.cols * spec.pixel_spacing[1]])[0]


def _image_pixel(ds: Dataset, spec: SeriesSpec) -> None:
    """Rows, Columns, SamplesPerPixel, PhotometricInterpretation, Bits*, PixelRepresentation, padding."""
    ds.Rows, ds.Columns = spec.rows, spec.cols
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.BitsAllocated = 16
    ds.BitsStored = spec.bits_stored
    ds.HighBit = spec.bits_stored - 1
    ds.PixelRepresentation = int(spec.signed)
    if spec.pixel_padding_value is not None:
        ds.PixelPaddingValue = spec.pixel_padding_value


def _write_slices(
    out_dir: Path, spec: SeriesSpec, ident: Identity, values: PixelValues, ipp: np.ndarray,
    iop: list[str], locations: np.ndarray, rng: np.random.Generator, shuffle: bool,
) -> list[Path]:
    """One CT Image Storage file per slice; InstanceNumber (0020,0013) is a random permutation.

    SliceLocation (0020,1041) is the position projected on the slice normal.
    """
    n = len(ipp)
    instance_numbers = _permutation(n, rng) + 1 if shuffle else np.arange(1, n + 1)
    paths = [out_dir / name for name in _file_names(n, rng, shuffle, ident.series_number)]
    for k, path in enumerate(paths):
        ds = new_dataset(CTImageStorage, synthetic_uid("instance", ident.series_uid, k))
        add_identity(ds, ident)
        ds.ImageType = list(spec.image_type)
        ds.AcquisitionNumber = 1
        ds.InstanceNumber = int(instance_numbers[k])
        _ct_acquisition(ds, spec)
        ds.ImagePositionPatient = ds_values(ipp[k])
        ds.ImageOrientationPatient = iop
        ds.PixelSpacing = ds_values(spec.pixel_spacing)
        ds.SliceLocation = ds_values([locations[k]])[0]
        _image_pixel(ds, spec)
        ds.RescaleIntercept = ds_values([values.intercepts[k]])[0]
        ds.RescaleSlope = ds_values([spec.rescale_slope])[0]
        ds.RescaleType = "HU"
        ds.WindowCenter, ds.WindowWidth = "40", "400"
        set_pixel_data(ds, values.stored[k], spec.transfer_syntax)
        save(ds, path)
    return paths


def _item(**elements: object) -> Dataset:
    item = Dataset()
    for keyword, value in elements.items():
        setattr(item, keyword, value)
    return item


def _write_enhanced(
    out_dir: Path, spec: SeriesSpec, ident: Identity, values: PixelValues, ipp: np.ndarray,
    iop: list[str], rng: np.random.Generator, shuffle: bool,
) -> Path:
    """One Enhanced CT Image Storage file; frames are stored in a shuffled order.

    Shared functional groups: PixelMeasuresSequence (PixelSpacing, SliceThickness),
    PlaneOrientationSequence (ImageOrientationPatient), CTImageFrameTypeSequence, FrameVOILUTSequence,
    CTXRayDetailsSequence (KVP), CTReconstructionSequence (ConvolutionKernel). Per frame:
    FrameContentSequence (StackID, InStackPositionNumber, DimensionIndexValues), PlanePositionSequence
    (ImagePositionPatient) and PixelValueTransformationSequence (RescaleIntercept/Slope/Type).
    """
    n = len(ipp)
    order = _permutation(n, rng) if shuffle else np.arange(n)
    path = out_dir / _file_names(1, rng, shuffle, ident.series_number)[0]
    ds = new_dataset(EnhancedCTImageStorage, synthetic_uid("instance", ident.series_uid, 0))
    add_identity(ds, ident)
    image_type = list(spec.image_type) + ["NONE"] * max(0, 4 - len(spec.image_type))
    ds.ImageType = image_type
    ds.InstanceNumber = 1
    ds.AcquisitionNumber = 1
    ds.AcquisitionDateTime = ds.AcquisitionDate + ds.AcquisitionTime
    ds.ContentQualification = "RESEARCH"
    ds.PixelPresentation = "MONOCHROME"
    ds.VolumetricProperties = "VOLUME"
    ds.VolumeBasedCalculationTechnique = "NONE"
    ds.BurnedInAnnotation = "NO"
    ds.LossyImageCompression = "00"
    ds.PresentationLUTShape = "IDENTITY"
    ds.NumberOfFrames = n
    _image_pixel(ds, spec)
    dim_uid = synthetic_uid("dimension-organization", ident.series_uid)
    ds.DimensionOrganizationSequence = [_item(DimensionOrganizationUID=dim_uid)]
    ds.DimensionIndexSequence = [
        _item(DimensionOrganizationUID=dim_uid, DimensionIndexPointer=Tag(pointer),
              FunctionalGroupPointer=Tag("FrameContentSequence"))
        for pointer in ("StackID", "InStackPositionNumber")
    ]
    ds.SharedFunctionalGroupsSequence = [_item(
        PixelMeasuresSequence=[_item(PixelSpacing=ds_values(spec.pixel_spacing),
                                     SliceThickness=ds_values([spec.slice_spacing])[0])],
        PlaneOrientationSequence=[_item(ImageOrientationPatient=iop)],
        CTImageFrameTypeSequence=[_item(FrameType=image_type, PixelPresentation="MONOCHROME",
                                        VolumetricProperties="VOLUME", VolumeBasedCalculationTechnique="NONE")],
        FrameVOILUTSequence=[_item(WindowCenter="40", WindowWidth="400")],
        CTXRayDetailsSequence=[_item(KVP=120)],
        CTReconstructionSequence=[_item(ConvolutionKernel="STANDARD")],
    )]
    ds.PerFrameFunctionalGroupsSequence = [_item(
        FrameContentSequence=[_item(StackID="1", InStackPositionNumber=int(k) + 1,
                                    DimensionIndexValues=[1, int(k) + 1])],
        PlanePositionSequence=[_item(ImagePositionPatient=ds_values(ipp[k]))],
        PixelValueTransformationSequence=[_item(RescaleIntercept=ds_values([values.intercepts[k]])[0],
                                                RescaleSlope=ds_values([spec.rescale_slope])[0], RescaleType="HU")],
    ) for k in order]
    set_pixel_data(ds, values.stored[order], spec.transfer_syntax)
    save(ds, path)
    return path


def make_series(
    out_dir: Path,
    spec: SeriesSpec = SeriesSpec(),
    *,
    seed: int = 0,
    study_uid: str | None = None,
    patient_id: str = "SYN-0001",
    patient_name: str = "Doe^Synthetic",
    shuffle: bool = True,
    series_number: int = 1,
    hu: np.ndarray | None = None,
) -> GeneratedSeries:
    """Write one synthetic series into ``out_dir`` and return its ground truth.

    Everything (phantom, oblique rotation, origin, UIDs, names, InstanceNumber order) is drawn from
    ``seed``, so the same arguments give byte-identical files. ``hu`` (slices along the normal, Rows,
    Columns) is written instead of the phantom: an image whose values a test chooses. Raises ConfigError
    for a spec that cannot be written (see :class:`SeriesSpec`); existing files are never overwritten.
    """
    _check(spec)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    study_uid = study_uid or synthetic_uid("study", patient_id, seed)
    ident = Identity(patient_id, patient_name, study_uid, synthetic_uid("series", study_uid, seed, series_number),
                     series_number, spec.modality, spec.series_description)

    row_cos, col_cos = orientation_cosines(spec.orientation, rng)
    offsets = slice_offsets(spec)
    origin = np.asarray(spec.origin if spec.origin is not None else np.round(rng.uniform(-150, 150, 3), 2), float)
    ipp = slice_positions(origin, row_cos, col_cos, offsets, spec.tilt_deg)
    shape = (len(ipp), spec.rows, spec.cols)
    if hu is not None and np.shape(hu) != shape:
        raise ConfigError(f"hu has shape {np.shape(hu)}, the series {shape} (slices, rows, columns)")
    values = pixel_values(phantom_hu(shape, rng) if hu is None else np.asarray(hu), spec, rng)
    iop = ds_values(np.concatenate([row_cos, col_cos]))
    if spec.multiframe:
        paths = [_write_enhanced(out_dir, spec, ident, values, ipp, iop, rng, shuffle)]
    else:
        locations = ipp @ np.cross(row_cos, col_cos)
        paths = _write_slices(out_dir, spec, ident, values, ipp, iop, locations, rng, shuffle)
    log.info("wrote series %s (%d slices, %s, %d files) to %s", ident.series_uid, len(ipp),
             UID(spec.transfer_syntax).name, len(paths), out_dir)
    return GeneratedSeries(
        spec=spec, paths=paths, hu=values.hu, ipp=ipp,
        affine_ras=affine_ras(row_cos, col_cos, spec.pixel_spacing, ipp, spec.slice_spacing),
        series_uid=ident.series_uid, study_uid=study_uid, patient_id=patient_id, patient_name=patient_name,
    )


def make_study(
    out_dir: Path, specs: Sequence[SeriesSpec], *, seed: int = 0, shuffle: bool = True
) -> list[GeneratedSeries]:
    """Write several series of one study and one patient into the same folder (SeriesNumber 1, 2, ...)."""
    if not specs:
        raise ConfigError("make_study needs at least one SeriesSpec")
    study_uid = synthetic_uid("study", "make_study", seed)
    seeds = np.random.SeedSequence(seed).generate_state(len(specs))
    return [
        make_series(out_dir, spec, seed=int(s), study_uid=study_uid, shuffle=shuffle, series_number=i + 1)
        for i, (spec, s) in enumerate(zip(specs, seeds))
    ]
