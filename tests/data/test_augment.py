"""Batch augmentation: image/label alignment, exact flips and no-ops, reproducibility, known geometry."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES

from medload.data.augment import AugmentConfig, AugmentParams, BatchAugment, rotation_matrix
from medload.errors import ConfigError

OFF = dict(flip_prob=0.0, affine_prob=0.0, intensity_prob=0.0, noise_prob=0.0)


def _blobs(batch: int, spatial: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """(B, 1, *spatial) uint8 class map (0, 1, 2) of random balls."""
    gen = torch.Generator().manual_seed(seed)
    axes = torch.meshgrid(*[torch.arange(n, dtype=torch.float32) for n in spatial], indexing="ij")
    label = torch.zeros(batch, 1, *spatial, dtype=torch.uint8)
    for b in range(batch):
        for k in range(5):
            u = torch.rand(len(spatial) + 1, generator=gen).tolist()
            centre = [n * (0.25 + 0.5 * v) for n, v in zip(spatial, u)]
            radius = 2.5 + u[-1] * min(spatial) / 6
            inside = sum((a - c) ** 2 for a, c in zip(axes, centre)) <= radius**2
            label[b, 0][inside] = 1 + k % 2
    return label


def _image_of(label: torch.Tensor, channels: int) -> torch.Tensor:
    """100 * label plus a small smooth background that differs per channel."""
    spatial = label.shape[2:]
    axes = torch.meshgrid(*[torch.arange(n, dtype=torch.float32, device=label.device) for n in spatial],
                          indexing="ij")
    chans = [0.15 * (1 + torch.sin(axes[-1] / (4 + c)) * torch.cos(axes[-2] / 5)) for c in range(channels)]
    return 100.0 * label.float() + torch.stack(chans)[None]


def _interior(label: torch.Tensor) -> torch.Tensor:
    """Voxels whose 3^S neighbourhood holds one class: excludes a 1-voxel band around every boundary."""
    pool = F.max_pool2d if label.ndim == 4 else F.max_pool3d
    x = label.float()
    return pool(x, 3, 1, 1) == -pool(-x, 3, 1, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("spatial_dims", "spatial", "channels"), [(2, (48, 56), 3), (3, (20, 28, 24), 1)])
@pytest.mark.parametrize("label_dtype", [torch.uint8, torch.int64])
def test_image_and_label_stay_aligned(spatial_dims, spatial, channels, label_dtype, device):
    batch = 6
    label = _blobs(batch, spatial, seed=spatial_dims).to(label_dtype).to(device)
    image = _image_of(label, channels)
    aug = BatchAugment(AugmentConfig(affine_prob=1.0, rotate_deg=25.0), device=device, seed=5,
                       spatial_dims=spatial_dims)
    for epoch in range(2):
        aug.set_epoch(epoch)
        out_img, out_lab = aug(image, label)
        assert out_img.shape == image.shape and out_img.dtype == image.dtype and out_img.device == image.device
        assert out_lab.shape == label.shape and out_lab.dtype == label_dtype and out_lab.device == label.device
        assert not torch.equal(out_lab, label)
        assert set(out_lab.unique().tolist()) <= {0, 1, 2}
        guess = ((out_img + 50.0) / 100.0).floor().clamp(0, 2)  # survives gain 1 ± 0.1, offset, noise
        inside = _interior(out_lab).expand_as(out_img)
        truth = out_lab.expand_as(out_img)
        for cls in (1, 2):
            a, b = (guess == cls) & inside, (truth == cls) & inside
            dice = 2 * (a & b).sum() / (a.sum() + b.sum())
            assert dice > 0.97, (epoch, cls, float(dice))
        assert (guess[inside] == truth[inside].float()).float().mean() > 0.99


def test_one_hot_float_label_stays_one_hot_with_background_padding():
    label = _blobs(4, (40, 40), seed=3)
    one_hot = F.one_hot(label[:, 0].long(), 3).permute(0, 3, 1, 2).float()
    aug = BatchAugment(AugmentConfig(affine_prob=1.0, scale=(0.7, 0.8), **{"flip_prob": 0.0}), seed=1)
    _, out = aug(_image_of(label, 1), one_hot)
    assert out.dtype == torch.float32 and out.shape == one_hot.shape
    assert torch.equal(out.sum(1), torch.ones_like(out[:, 0]))  # exactly one class everywhere, padding too
    assert torch.equal(out.amax(1), torch.ones_like(out[:, 0]))
    assert torch.equal(out[:, :, 0, 0], torch.tensor([[1.0, 0.0, 0.0]] * 4))  # zoomed out: corner is padding


@pytest.mark.parametrize(("spatial_dims", "shape"), [(2, (16, 3, 9, 10)), (3, (16, 2, 5, 6, 7))])
def test_flips_only_are_exact(spatial_dims, shape):
    image = torch.rand(shape, generator=torch.Generator().manual_seed(0))
    label = (image[:, :1] > 0.5).to(torch.uint8)
    aug = BatchAugment(AugmentConfig(**{**OFF, "flip_prob": 0.5}), seed=3, spatial_dims=spatial_dims)
    params = aug.draw(shape[0])  # seed 3: some samples flipped on no axis (1 - (7/8)**16 of seeds in 3D)
    out_img, out_lab = aug.apply(params, image, label)
    assert 0 < params.flip.sum() < params.flip.numel()
    assert (~params.flip.any(1)).any()  # some samples untouched
    for b in range(shape[0]):
        dims = [axis + 1 for axis in range(spatial_dims) if params.flip[b, axis]]
        want_img = image[b].flip(dims) if dims else image[b]
        want_lab = label[b].flip(dims) if dims else label[b]
        assert torch.equal(out_img[b], want_img) and torch.equal(out_lab[b], want_lab)


def test_zero_probability_config_is_identity():
    image, label = torch.rand(4, 3, 12, 13), torch.randint(0, 3, (4, 1, 12, 13))
    aug = BatchAugment(AugmentConfig(**OFF))
    params = aug.draw(4)
    assert params.flip is None and not params.has_affine and params.gain is None and params.noise_std is None
    out_img, out_lab = aug.apply(params, image, label)
    assert torch.equal(out_img, image) and torch.equal(out_lab, label)
    # affine switched on but with empty ranges: skipped, still exact
    flat = AugmentConfig(**{**OFF, "affine_prob": 1.0}, rotate_deg=0.0, scale=(1.0, 1.0), translate=0.0)
    out_img, out_lab = BatchAugment(flat)(image, label)
    assert torch.equal(out_img, image) and torch.equal(out_lab, label)


def test_identity_affine_params_resample_to_the_input():
    image, label = torch.rand(3, 2, 11, 14), torch.randint(0, 4, (3, 1, 11, 14))
    aug = BatchAugment()
    out_img, out_lab = aug.apply(AugmentParams(angles=torch.zeros(3, 1)), image, label)
    torch.testing.assert_close(out_img, image, atol=1e-5, rtol=0)
    assert torch.equal(out_lab, label)
    # samples outside the affine mask are bit-identical
    params = AugmentParams(affine=torch.tensor([True, False, True]), angles=torch.full((3, 1), 0.3))
    out_img, out_lab = aug.apply(params, image, label)
    assert torch.equal(out_img[1], image[1]) and torch.equal(out_lab[1], label[1])
    assert not torch.equal(out_img[0], image[0])


def test_reproducible_per_seed_and_epoch_and_global_rng_untouched():
    image, label = torch.rand(5, 3, 20, 20), torch.randint(0, 3, (5, 1, 20, 20), dtype=torch.uint8)
    cfg = AugmentConfig(noise_prob=1.0, intensity_prob=1.0)
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()

    def run(seed: int, epoch: int) -> list[torch.Tensor]:
        aug = BatchAugment(cfg, seed=seed)
        aug.set_epoch(epoch)
        return [t for _ in range(2) for t in aug(image, label)]

    first = run(7, 3)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(first, run(7, 3)))
    assert not torch.equal(first[0], first[2])  # consecutive batches differ
    assert not torch.equal(first[0], run(7, 4)[0])
    assert not torch.equal(first[0], run(8, 3)[0])
    aug = BatchAugment(cfg, seed=7)
    aug.set_epoch(3)
    aug(image, label)
    aug.set_epoch(3)  # back to the start of the epoch
    assert torch.equal(aug(image, label)[0], first[0])
    assert torch.equal(torch.random.get_rng_state(), before)


def test_rotation_by_90_degrees_matches_rot90():
    image = torch.rand(2, 1, 15, 15)
    out, _ = BatchAugment().apply(AugmentParams(angles=torch.full((2, 1), math.pi / 2)), image)
    # (h, w) -> (-w, h) is torch.rot90 from H towards W
    torch.testing.assert_close(out, torch.rot90(image, 1, dims=(2, 3)), atol=1e-5, rtol=0)


def test_rotation_matrix_conventions():
    a = torch.tensor([[0.4, -0.7, 1.1]])
    r = rotation_matrix(a)[0]
    torch.testing.assert_close(r @ r.T, torch.eye(3), atol=1e-6, rtol=0)
    assert abs(float(torch.linalg.det(r)) - 1.0) < 1e-6
    in_plane = rotation_matrix(torch.tensor([[0.4, 0.0, 0.0]]))[0]  # about D = the 2D rotation of (H, W)
    torch.testing.assert_close(in_plane[1:, 1:], rotation_matrix(torch.tensor([[0.4]]))[0])


def _centre_offsets(volume: torch.Tensor) -> torch.Tensor:
    """Voxel offsets from the grid centre of every voxel, shape (*spatial, S)."""
    axes = torch.meshgrid(*[torch.arange(n, dtype=torch.float32) - (n - 1) / 2 for n in volume.shape], indexing="ij")
    return torch.stack(axes, dim=-1)


@pytest.mark.parametrize(
    ("spatial", "angles", "zoom", "translate", "point"),
    [
        ((33, 41), [0.5], 1.0, [0.0, 0.0], (7.0, -9.0)),
        ((33, 41), [-0.35], 1.1, [0.06, -0.05], (-6.0, 10.0)),
        ((17, 21, 25), [0.3, -0.2, 0.25], 1.0, [0.0, 0.0, 0.0], (3.0, -4.0, 5.0)),
        ((17, 21, 25), [-0.25, 0.15, -0.3], 0.95, [0.05, 0.0, -0.04], (-3.0, 5.0, 4.0)),
    ],
)
def test_known_rotation_moves_a_voxel_where_the_matrix_says(spatial, angles, zoom, translate, point):
    nd = len(spatial)
    centre = [(n - 1) / 2 for n in spatial]
    image = torch.zeros(1, 1, *spatial)
    label = torch.zeros(1, 1, *spatial, dtype=torch.int64)
    index = tuple(int(c + p) for c, p in zip(centre, point))
    image[(0, 0) + index] = 1.0
    # a 3^S block: one label voxel can legitimately vanish under nearest resampling of a rotation
    label[(0, 0) + tuple(slice(i - 1, i + 2) for i in index)] = 2
    params = AugmentParams(
        angles=torch.tensor([angles]), zoom=torch.tensor([zoom]), translate=torch.tensor([translate])
    )
    out_img, out_lab = BatchAugment(spatial_dims=nd).apply(params, image, label)
    r = rotation_matrix(torch.tensor([angles]))[0]
    expected = zoom * r @ torch.tensor(point) + torch.tensor(translate) * torch.tensor(spatial, dtype=torch.float32)
    offsets = _centre_offsets(out_img[0, 0])
    peak = offsets.reshape(-1, nd)[out_img.flatten().argmax()]
    assert torch.linalg.norm(peak - expected) <= 1.0, (peak, expected)
    hits = offsets[out_lab[0, 0] == 2]
    assert len(hits) >= 3 ** (nd - 1) and set(out_lab.unique().tolist()) == {0, 2}
    assert torch.linalg.norm(hits.mean(0) - expected) <= 1.0, (hits.mean(0), expected)
    assert (torch.linalg.norm(hits - expected, dim=1) <= zoom * math.sqrt(nd) + 1.0).all(), (hits, expected)


def test_intensity_statistics_match_the_config():
    batch, s, t = 20000, 0.1, 0.2
    image = torch.tensor([0.0, 1.0]).expand(batch, 1, 1, 2).contiguous()
    cfg = AugmentConfig(**{**OFF, "intensity_prob": 0.5}, intensity_scale=s, intensity_shift=t)
    out, _ = BatchAugment(cfg, seed=3)(image)
    offset = out[:, 0, 0, 0]
    gain = out[:, 0, 0, 1] - offset
    on = (gain != 1.0) | (offset != 0.0)
    assert abs(on.float().mean() - 0.5) < 0.02
    a, b = gain[on] - 1.0, offset[on]
    assert a.abs().max() <= s + 1e-6 and a.abs().max() > 0.98 * s
    assert b.abs().max() <= t + 1e-6 and b.abs().max() > 0.98 * t
    assert abs(a.mean()) < 0.01 * s * 3 and abs(b.mean()) < 0.01 * t * 3
    assert abs(a.var() / (s**2 / 3) - 1) < 0.05 and abs(b.var() / (t**2 / 3) - 1) < 0.05  # uniform


def test_noise_statistics_match_the_config():
    batch, std = 4000, 0.02
    image = torch.full((batch, 2, 16, 16), 0.5)
    cfg = AugmentConfig(**{**OFF, "noise_prob": 0.3}, noise_std=std)
    out, _ = BatchAugment(cfg, seed=4)(image)
    noise = out - image
    per_sample = noise.flatten(1).std(dim=1)
    on = per_sample > 0
    assert abs(on.float().mean() - 0.3) < 0.03
    assert torch.equal(out[~on], image[~on])
    assert per_sample.max() <= std * 1.15 and abs(noise[on].mean()) < 1e-4
    assert abs(per_sample[on].mean() / (std / 2) - 1) < 0.06  # std ~ U(0, noise_std)


def test_half_precision_image_keeps_its_dtype():
    label = _blobs(2, (32, 32), seed=9)
    image = (_image_of(label, 2) / 200).half()
    out_img, out_lab = BatchAugment(AugmentConfig(affine_prob=1.0, noise_prob=1.0), seed=1)(image, label)
    assert out_img.dtype == torch.float16 and out_lab.dtype == torch.uint8 and torch.isfinite(out_img).all()


@pytest.mark.parametrize(
    ("spatial_dims", "image", "label"),
    [
        (2, torch.rand(3, 8, 8), None),  # missing channel axis
        (2, torch.rand(2, 1, 4, 8, 8), None),  # a slab given to a 2D augment
        (3, torch.rand(2, 1, 8, 8), None),
        (2, torch.randint(0, 9, (2, 1, 8, 8)), None),  # integer image
        (2, torch.rand(2, 1, 8, 8), torch.zeros(2, 1, 8, 9, dtype=torch.uint8)),  # spatial mismatch
        (2, torch.rand(2, 1, 8, 8), torch.zeros(3, 1, 8, 8, dtype=torch.uint8)),  # batch mismatch
        (2, torch.rand(2, 1, 8, 8), torch.zeros(2, 8, 8, dtype=torch.uint8)),  # missing channel axis
        (2, torch.rand(2, 1, 8, 8), [[0]]),
    ],
)
def test_bad_inputs_raise_config_error(spatial_dims, image, label):
    with pytest.raises(ConfigError):
        BatchAugment(spatial_dims=spatial_dims)(image, label)


def test_bad_params_and_configs_raise_config_error():
    aug = BatchAugment()
    with pytest.raises(ConfigError, match="draw"):
        aug.apply(aug.draw(4), torch.rand(3, 1, 8, 8))
    with pytest.raises(ConfigError, match="angles"):
        aug.apply(AugmentParams(angles=torch.zeros(2, 3)), torch.rand(2, 1, 8, 8))
    for bad in (
        dict(flip_prob=1.5),
        dict(scale=(1.2, 1.0)),
        dict(scale=(0.0, 1.0)),
        dict(translate=-0.1),
        dict(noise_std=float("nan")),
        dict(intensity_scale=1.0),
    ):
        with pytest.raises(ConfigError):
            AugmentConfig(**bad)
    with pytest.raises(ConfigError, match="spatial_dims"):
        BatchAugment(spatial_dims=4)
    with pytest.raises(ConfigError, match="batch_size"):
        aug.draw(0)
