"""Segmentation augmentation of whole batches, on the training device.

`BatchAugment.draw` draws every random number of one batch in one place, from a `torch.Generator` on the
target device; `BatchAugment.apply` applies them deterministically, in this order:

1. flips (per sample, per spatial axis): `torch.where` between the batch and its flip, so exact;
2. one affine resampling of the whole batch: one `F.affine_grid` (zoom, rotation, translation about the
   centre of the grid) shared by `F.grid_sample` bilinear for the image and nearest for the label;
   padding is the per-sample minimum for the image and background (0) for the label;
3. intensity ``image * gain + offset`` and gaussian noise, image only.

No host syncs and no Python loops over the batch, so it runs inside a CUDA training step.

Given to `medload.data.make_loader` (``augment=``), a `BatchAugment` is bound to the loader
(`BatchAugment.bind`): it takes the loader's device and spatial dims, and refuses intensity or noise
augmentation (tuned for 0..1) on raw HU batches.

Plain `affine_grid`/`grid_sample` rather than `monai.networks.layers.AffineTransform` (MONAI 1.6.1): that
module builds its normalisation matrices on the host each call (`normalize_transform`, `np.linalg.inv`
in `to_norm_affine`: host-device copies, i.e. syncs), pads only with zeros/border/reflection (not a
per-sample value), takes one mode per module (so two grids for image + label), and its
``zero_centered=True`` normalisation with ``align_corners=False`` scales axes by (d-1)/d, which is not
rigid on non-square grids. Voxel spacing is not used: rotations are rigid in voxel units.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from medload.data.state_version import checked, stamp
from medload.errors import ConfigError

__all__ = ["AugmentConfig", "AugmentParams", "BatchAugment", "rotation_matrix"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class AugmentConfig:
    """Probabilities and ranges of the batch augmentation (see module docstring)."""

    flip_prob: float = 0.5  # per spatial axis, per sample
    affine_prob: float = 0.8  # per sample
    rotate_deg: float = 15.0  # in-plane rotation range ±; for 3D: about each axis ±
    scale: tuple[float, float] = (0.9, 1.1)  # isotropic zoom range
    translate: float = 0.05  # ± fraction of each spatial size
    intensity_prob: float = 0.5
    intensity_scale: float = 0.1  # image * (1 + U(-s, s))
    intensity_shift: float = 0.1  # image + U(-t, t)
    noise_prob: float = 0.3
    noise_std: float = 0.02  # gaussian, std drawn U(0, noise_std)

    def __post_init__(self) -> None:
        for f in fields(self):
            values = getattr(self, f.name)
            for v in values if isinstance(values, tuple) else (values,):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise ConfigError(f"AugmentConfig.{f.name} = {values!r}: use finite numbers")
        for name in ("flip_prob", "affine_prob", "intensity_prob", "noise_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"AugmentConfig.{name} = {getattr(self, name)}: a probability is in [0, 1]")
        if not 0.0 <= self.rotate_deg <= 180.0:
            raise ConfigError(f"AugmentConfig.rotate_deg = {self.rotate_deg}: use degrees in [0, 180]")
        if len(self.scale) != 2 or not 0.0 < self.scale[0] <= self.scale[1]:
            raise ConfigError(f"AugmentConfig.scale = {self.scale}: use (low, high) with 0 < low <= high")
        if not 0.0 <= self.translate <= 0.5:
            raise ConfigError(f"AugmentConfig.translate = {self.translate}: use a fraction of the size in [0, 0.5]")
        if not 0.0 <= self.intensity_scale < 1.0:
            raise ConfigError(f"AugmentConfig.intensity_scale = {self.intensity_scale}: use a value in [0, 1)")
        for name in ("intensity_shift", "noise_std"):
            if getattr(self, name) < 0:
                raise ConfigError(f"AugmentConfig.{name} = {getattr(self, name)}: use a value >= 0")

    @property
    def has_intensity(self) -> bool:
        """Whether intensity scale/shift can change a sample."""
        return self.intensity_prob > 0 and (self.intensity_scale > 0 or self.intensity_shift > 0)

    @property
    def has_noise(self) -> bool:
        """Whether gaussian noise can be added to a sample."""
        return self.noise_prob > 0 and self.noise_std > 0


@dataclass(frozen=True)
class AugmentParams:
    """Every random number of one batch of B samples with S spatial axes; ``None`` skips that step.

    Axes are in tensor order, (H, W) or (D, H, W). The affine step runs when any of `affine`, `angles`,
    `zoom`, `translate` is set (a missing mask means every sample, a missing part is the identity): the
    input point at offset ``p`` (voxels, from the centre of the grid) moves to
    ``zoom * rotation_matrix(angles) @ p + translate * size``. Intensity runs when `gain` or `offset` is set.
    """

    flip: Tensor | None = None  # (B, S) bool: flip sample b along spatial axis s (first step)
    affine: Tensor | None = None  # (B,) bool: resample sample b; the others pass through unchanged
    angles: Tensor | None = None  # (B, 1) in 2D, (B, 3) in 3D: radians, see rotation_matrix
    zoom: Tensor | None = None  # (B,) isotropic factor; > 1 enlarges
    translate: Tensor | None = None  # (B, S) fraction of each spatial size
    gain: Tensor | None = None  # (B,) image * gain + offset
    offset: Tensor | None = None  # (B,)
    noise_std: Tensor | None = None  # (B,) std of the added gaussian noise; 0 = none
    noise_seed: int = 0  # seeds the noise field, drawn in apply because only there its shape is known

    @property
    def has_affine(self) -> bool:
        """Whether apply resamples."""
        return any(t is not None for t in (self.affine, self.angles, self.zoom, self.translate))


def rotation_matrix(angles: Tensor) -> Tensor:
    """Rotation matrices in tensor axis order: (B, 1) radians → (B, 2, 2); (B, 3) → (B, 3, 3).

    A rotation by ``a`` in the plane of axes (i, j) maps (i, j) → (i cos a − j sin a, i sin a + j cos a).
    2D: the plane (H, W). 3D: ``R = R_D @ R_H @ R_W`` with angles about D (plane (H, W)), about H (plane
    (W, D)) and about W (plane (D, H)).
    """
    if angles.ndim != 2 or angles.shape[1] not in (1, 3):
        raise ConfigError(f"angles must be (B, 1) in 2D or (B, 3) in 3D, got shape {tuple(angles.shape)}")
    c, s = angles.cos(), angles.sin()
    one, zero = torch.ones_like(c[:, 0]), torch.zeros_like(c[:, 0])

    def mat(rows: list[list[Tensor]]) -> Tensor:
        return torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)

    if angles.shape[1] == 1:
        return mat([[c[:, 0], -s[:, 0]], [s[:, 0], c[:, 0]]])
    cd, sd, ch, sh, cw, sw = c[:, 0], s[:, 0], c[:, 1], s[:, 1], c[:, 2], s[:, 2]
    r_d = mat([[one, zero, zero], [zero, cd, -sd], [zero, sd, cd]])
    r_h = mat([[ch, zero, sh], [zero, one, zero], [-sh, zero, ch]])
    r_w = mat([[cw, -sw, zero], [sw, cw, zero], [zero, zero, one]])
    return r_d @ r_h @ r_w


def _seed(*parts: object) -> int:
    """A 63-bit seed mixed from the parts (stable across runs and machines)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1)


class BatchAugment:
    """Flips, affine, intensity and noise on (B, C, *spatial) batches; image and label stay aligned.

    Args:
        config: probabilities and ranges.
        device: where parameters are drawn (the training device); None: the loader's (see `bind`),
            the CPU when called without a loader.
        seed: the same seed and epoch give the same augmentation; the global torch RNG is never used.
        spatial_dims: 2 for (B, C, H, W) 2.5D stacks, 3 for (B, C, D, H, W) slabs; None: the loader's,
            2 when called without a loader.
    """

    def __init__(
        self,
        config: AugmentConfig = AugmentConfig(),
        *,
        device: str | torch.device | None = None,
        seed: int = 0,
        spatial_dims: int | None = None,
    ) -> None:
        if not isinstance(config, AugmentConfig):
            raise ConfigError(f"config must be an AugmentConfig, got {type(config).__name__}")
        if spatial_dims is not None:
            _check_dims(spatial_dims, "spatial_dims")
        self.config = config
        self.seed = int(seed)
        self._device = None if device is None else _device_of(device)
        self._spatial_dims = spatial_dims
        self._given = (self._device, spatial_dims)  # what the user asked for; None: the loader decides
        self._bound: tuple[torch.device, int] | None = None
        self._gen: torch.Generator | None = None  # made at the first draw, on the device known by then
        self.set_epoch(0)

    @property
    def device(self) -> torch.device:
        """Where parameters are drawn: as given, else the bound loader's, else the CPU."""
        return torch.device("cpu") if self._device is None else self._device

    @property
    def spatial_dims(self) -> int:
        """2 or 3: as given, else the bound loader's, else 2."""
        return 2 if self._spatial_dims is None else self._spatial_dims

    def bind(self, *, device: torch.device, spatial_dims: int, scaled: bool) -> BatchAugment:
        """Take the device and spatial dims of the loader that applies this augmentation (once, in
        `make_loader`); ``scaled``: its batches are in 0..1 (a window or a stored uint8 plane), not HU.

        Raises ConfigError where a device or spatial_dims given to the constructor contradicts the
        loader, where another loader with other ones already bound it, and where intensity or noise
        augmentation (tuned for 0..1) would run on raw HU.
        """
        device = _device_of(device)
        _check_dims(spatial_dims, "the loader's spatial_dims")
        given_device, given_dims = self._given
        shape = {2: "2.5D (B, C, H, W)", 3: "3D (B, C, D, H, W)"}
        if given_dims is not None and given_dims != spatial_dims:
            raise ConfigError(
                f"BatchAugment(spatial_dims={given_dims}) on a loader of {shape[spatial_dims]} batches: "
                f"drop spatial_dims= (it is taken from the loader) or use spatial_dims={spatial_dims}"
            )
        if given_device is not None and given_device != device:
            raise ConfigError(
                f"BatchAugment(device={str(given_device)!r}) on a loader that puts batches on {str(device)!r}: "
                f"drop device= (it is taken from the loader) or give both the same device"
            )
        if self._bound is not None and self._bound != (device, spatial_dims):
            raise ConfigError(
                f"this BatchAugment is bound to a loader of {shape[self._bound[1]]} batches on "
                f"{str(self._bound[0])!r}, not {shape[spatial_dims]} on {str(device)!r}: use one BatchAugment per loader"
            )
        if not scaled and (self.config.has_intensity or self.config.has_noise):
            raise ConfigError(
                "intensity/noise augmentation is tuned for images in 0..1, and this loader gives raw HU: "
                "set window= on the loader (e.g. window=\"soft_tissue\"), or disable intensity augmentation in "
                "AugmentConfig (intensity_prob=0.0, noise_prob=0.0)"
            )
        self._bound = (device, spatial_dims)
        self._device, self._spatial_dims = device, spatial_dims
        return self

    def set_epoch(self, epoch: int) -> None:
        """Start the draws of ``epoch``: every epoch's augmentation is reproducible on its own."""
        self.epoch = int(epoch)
        self._draws = 0

    def state_dict(self) -> dict:
        """Seeds and counters that restore the draws mid-epoch: ``{"version", "augment", "seed", "epoch",
        "draws"}`` (batches drawn this epoch; the loader's state counts only those its caller consumed)."""
        return stamp({"augment": type(self).__name__, "seed": self.seed, "epoch": self.epoch, "draws": self._draws})

    def load_state_dict(self, state: dict) -> None:
        """Continue the draws where ``state`` (from :meth:`state_dict`) left off."""
        state = checked(state, "augment", type(self).__name__)
        if state["seed"] != self.seed:
            raise ConfigError(f"the state is of a BatchAugment seeded {state['seed']}, this one is seeded {self.seed}: "
                              f"use BatchAugment(..., seed={state['seed']}) to resume that run")
        self.set_epoch(state["epoch"])
        self._draws = int(state["draws"])

    def _generator(self) -> torch.Generator:
        """The parameter generator on `device`, seeded for the next draw from (seed, epoch, draw number):
        each batch's parameters depend on where it is in the epoch only, so a restored state redraws them."""
        if self._gen is None or self._gen.device != self.device:
            self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(_seed("params", self.seed, self.epoch, self._draws))
        return self._gen

    def draw(self, batch_size: int) -> AugmentParams:
        """Draw the parameters of one batch (advances this object's generator)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size = {batch_size!r}: use a positive int")
        cfg, nd = self.config, self.spatial_dims
        n_rot = 1 if nd == 2 else 3
        # one draw, always the same columns, so changing one probability leaves the other streams alone
        u = torch.rand(batch_size, 2 * nd + n_rot + 7, generator=self._generator(), device=self.device)
        u_flip, u_aff, u_ang, u_zoom, u_tr, u_int, u_gain, u_off, u_noise, u_std = torch.split(
            u, [nd, 1, n_rot, 1, nd, 1, 1, 1, 1, 1], dim=1
        )
        self._draws += 1

        def sym(v: Tensor, half_width: float) -> Tensor:  # U(-w, w)
            return (2.0 * v - 1.0) * half_width

        flip = u_flip < cfg.flip_prob if cfg.flip_prob > 0 else None
        affine = angles = zoom = translate = None
        degenerate = cfg.rotate_deg == 0 and cfg.scale[0] == cfg.scale[1] == 1 and cfg.translate == 0
        if cfg.affine_prob > 0 and not degenerate:
            affine = u_aff[:, 0] < cfg.affine_prob
            angles = sym(u_ang, math.radians(cfg.rotate_deg))
            zoom = cfg.scale[0] + (cfg.scale[1] - cfg.scale[0]) * u_zoom[:, 0]
            translate = sym(u_tr, cfg.translate)
        gain = offset = None
        if cfg.has_intensity:
            on = (u_int[:, 0] < cfg.intensity_prob).float()
            gain = 1.0 + on * sym(u_gain[:, 0], cfg.intensity_scale)
            offset = on * sym(u_off[:, 0], cfg.intensity_shift)
        noise_std = None
        if cfg.has_noise:
            noise_std = (u_noise[:, 0] < cfg.noise_prob).float() * u_std[:, 0] * cfg.noise_std
        return AugmentParams(
            flip=flip,
            affine=affine,
            angles=angles,
            zoom=zoom,
            translate=translate,
            gain=gain,
            offset=offset,
            noise_std=noise_std,
            noise_seed=_seed("noise", self.seed, self.epoch, self._draws),
        )

    def __call__(self, image: Tensor, label: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Draw parameters for this batch and apply them."""
        _check_inputs(image, label, self.spatial_dims)
        return self.apply(self.draw(image.shape[0]), image, label)

    @torch.no_grad()
    def apply(
        self, params: AugmentParams, image: Tensor, label: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Apply `params` to image (B, C, *spatial) and label (B, K, *spatial); deterministic.

        Returns new tensors of the input dtypes and shapes (the inputs themselves where nothing applies).
        """
        _check_inputs(image, label, self.spatial_dims)
        batch, nd, dev = image.shape[0], self.spatial_dims, image.device
        p = _params_on(params, batch, nd, dev)
        bshape = (batch,) + (1,) * (image.ndim - 1)
        if p.flip is not None:
            for axis in range(nd):
                on = p.flip[:, axis].view(bshape)
                image = torch.where(on, image.flip(axis + 2), image)
                if label is not None:
                    label = torch.where(on, label.flip(axis + 2), label)
        if p.has_affine:
            image, label = _resample(p, image, label)
        if p.gain is not None or p.offset is not None:
            work = _work_dtype(image.dtype)
            x = image.to(work)
            if p.gain is not None:
                x = x * p.gain.to(work).view(bshape)
            if p.offset is not None:
                x = x + p.offset.to(work).view(bshape)
            image = x.to(image.dtype)
        if p.noise_std is not None:
            work = _work_dtype(image.dtype)
            gen = torch.Generator(device=dev)
            gen.manual_seed(p.noise_seed)
            noise = torch.randn(image.shape, generator=gen, device=dev, dtype=work)
            image = (image.to(work) + noise * p.noise_std.to(work).view(bshape)).to(image.dtype)
        return image, label


def _device_of(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device, a bare "cuda" resolved to the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_dims(spatial_dims: object, what: str) -> None:
    """Raise ConfigError unless ``spatial_dims`` is 2 or 3."""
    if isinstance(spatial_dims, bool) or spatial_dims not in (2, 3):
        raise ConfigError(f"{what} = {spatial_dims!r}: use 2 (B, C, H, W) or 3 (B, C, D, H, W)")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (grids and sums need the precision), else the dtype itself."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _check_inputs(image: Tensor, label: Tensor | None, nd: int) -> None:
    """Raise ConfigError for shapes and dtypes apply cannot use (host-side checks only, no syncs)."""
    want = "(B, C, H, W)" if nd == 2 else "(B, C, D, H, W)"
    if not isinstance(image, Tensor):
        raise ConfigError(f"image must be a torch.Tensor {want}, got {type(image).__name__}")
    if image.ndim != nd + 2:
        other = "spatial_dims=3 for (B, C, D, H, W)" if nd == 2 else "spatial_dims=2 for (B, C, H, W)"
        raise ConfigError(f"image must be {want}, got shape {tuple(image.shape)}: reshape it, or use {other}")
    if not image.is_floating_point():
        raise ConfigError(f"image must be a float tensor (window it to 0..1 first), got {image.dtype}")
    if image.numel() == 0:
        raise ConfigError(f"image is empty, shape {tuple(image.shape)}")
    if label is None:
        return
    if not isinstance(label, Tensor):
        raise ConfigError(f"label must be a torch.Tensor or None, got {type(label).__name__}")
    if label.ndim != image.ndim or label.shape[0] != image.shape[0] or label.shape[2:] != image.shape[2:]:
        raise ConfigError(
            f"label shape {tuple(label.shape)} does not match image {tuple(image.shape)}: "
            f"use (B, 1, *spatial) class maps or (B, K, *spatial) one-hot with the image's B and spatial size"
        )
    if label.device != image.device:
        raise ConfigError(f"label is on {label.device}, image on {image.device}: move both to one device")
    if label.is_complex():
        raise ConfigError(f"label dtype {label.dtype}: use an integer class map or a float one-hot")


def _params_on(params: AugmentParams, batch: int, nd: int, device: torch.device) -> AugmentParams:
    """`params` with shapes checked against the batch and tensors moved to `device`."""
    if not isinstance(params, AugmentParams):
        raise ConfigError(f"params must be AugmentParams (from BatchAugment.draw), got {type(params).__name__}")
    n_rot = 1 if nd == 2 else 3
    want = {"flip": (batch, nd), "angles": (batch, n_rot), "translate": (batch, nd)}
    moved = {}
    for f in fields(params):
        value = getattr(params, f.name)
        if isinstance(value, Tensor):
            shape = want.get(f.name, (batch,))
            if tuple(value.shape) != shape:
                raise ConfigError(
                    f"AugmentParams.{f.name} has shape {tuple(value.shape)}, expected {shape} for this batch: "
                    f"draw parameters with draw(batch_size={batch}) of a BatchAugment(spatial_dims={nd})"
                )
            value = value.to(device=device, non_blocking=True)
            if f.name in ("flip", "affine"):
                value = value.bool()
        moved[f.name] = value
    return AugmentParams(**moved)


def _theta(p: AugmentParams, batch: int, sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """(B, S, S+1) pull matrices for `F.affine_grid` (normalised, align_corners=False, x-first order)."""
    nd = len(sizes)
    angles = p.angles if p.angles is not None else torch.zeros(batch, 1 if nd == 2 else 3, device=device)
    inv = rotation_matrix(angles.to(dtype)).transpose(1, 2)  # R^-1 = R^T
    if p.zoom is not None:
        inv = inv / p.zoom.to(dtype).view(batch, 1, 1)
    # voxel offsets p = q * N / 2 for normalised q, so in normalised units M = diag(1/N) inv diag(N)
    m = inv.clone()
    for i, n in enumerate(sizes):
        m[:, i, :] /= n
        m[:, :, i] *= n
    # input = M (output - t), with t = translate * N voxels = 2 * translate normalised
    if p.translate is not None:
        b = -(m @ (2.0 * p.translate.to(dtype)).unsqueeze(-1))
    else:
        b = torch.zeros(batch, nd, 1, dtype=dtype, device=device)
    return torch.cat([m.flip(1, 2), b.flip(1)], dim=-1)  # (D, H, W) → grid order (x, y[, z])


def _resample(p: AugmentParams, image: Tensor, label: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One batched affine_grid; bilinear image (min-padded), nearest label (background-padded)."""
    batch, dev, work = image.shape[0], image.device, _work_dtype(image.dtype)
    theta = _theta(p, batch, tuple(image.shape[2:]), work, dev)
    grid = F.affine_grid(theta, [batch, 1, *image.shape[2:]], align_corners=False)
    on = p.affine.view((batch,) + (1,) * (image.ndim - 1)) if p.affine is not None else None

    def keep(new: Tensor, old: Tensor) -> Tensor:  # samples the mask leaves out stay bit-identical
        return new if on is None else torch.where(on, new, old)

    x = image.to(work)
    low = x.amin(dim=tuple(range(1, x.ndim)), keepdim=True)
    x = F.grid_sample(x - low, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + low
    image_out = keep(x.to(image.dtype), image)
    if label is None:
        return image_out, None
    y = label.to(work)
    one_hot = label.is_floating_point() and label.shape[1] > 1
    if one_hot:  # channel 0 is background: invert it so that zero padding means background
        y = torch.cat([1.0 - y[:, :1], y[:, 1:]], dim=1)
    y = F.grid_sample(y, grid, mode="nearest", padding_mode="zeros", align_corners=False)
    if one_hot:
        y = torch.cat([1.0 - y[:, :1], y[:, 1:]], dim=1)
    return image_out, keep(y.to(label.dtype), label)
