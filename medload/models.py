"""The segmentation models and training step that ``pipelines/train_segmentation.py`` trains and
``medload profile`` times: a MONAI UNet (2.5D, slabs), a MONAI DynUNet configured as nnU-Net configures
its 3D U-Net for a patch size (3D patches), Dice loss on logits, AdamW."""

from __future__ import annotations

import torch

__all__ = ["segmentation_unet", "patch_dynunet", "TrainStep"]


def segmentation_unet(spatial_dims: int, in_channels: int, *, small: bool = False,
                      out_channels: int = 1) -> torch.nn.Module:
    """A MONAI UNet with ``out_channels`` output channels (logits: one foreground, or one per class):
    widths 32-256, or 8-32 when ``small`` (a CPU-sized model, as ``--quick`` uses).

    Examples:
        >>> net = segmentation_unet(2, 3, small=True)
        >>> net(torch.zeros(1, 3, 32, 32)).shape
        torch.Size([1, 1, 32, 32])
    """
    from monai.networks.nets import UNet

    width = (8, 16, 32) if small else (32, 64, 128, 256)
    return UNet(spatial_dims=spatial_dims, in_channels=in_channels, out_channels=out_channels, channels=width,
                strides=(2,) * (len(width) - 1), num_res_units=1)


def patch_dynunet(patch: tuple[int, int, int] | list[int], in_channels: int = 1, out_channels: int = 1, *,
                  small: bool = False) -> torch.nn.Module:
    """A MONAI DynUNet for ``patch`` ``(D, H, W)`` inputs, laid out as nnU-Net lays out its 3D U-Net
    (Isensee et al., Nature Methods 2021): 3x3x3 convolutions, instance norm, each level halving every axis
    whose size there is even and at least 8, at most 5 levels (4 down-samplings), widths 32, 64, 128, 256,
    320 (capped at 320). ``small``: 3 levels of widths 8, 16, 32, a CPU-sized model (``--quick``).
    A patch whose axes cannot be halved still gives a valid (shallower) network.

    Examples:
        >>> net = patch_dynunet((16, 32, 32), small=True)
        >>> net(torch.zeros(1, 1, 16, 32, 32)).shape
        torch.Size([1, 1, 16, 32, 32])
    """
    from monai.networks.nets import DynUNet

    levels, base, cap = (3, 8, 32) if small else (5, 32, 320)
    size, strides = [int(n) for n in patch], [[1, 1, 1]]
    while len(strides) < levels:
        step = [2 if n % 2 == 0 and n >= 8 else 1 for n in size]
        if step == [1, 1, 1]:
            break
        strides.append(step)
        size = [n // s for n, s in zip(size, step)]
    widths = [min(base * 2**k, cap) for k in range(len(strides))]
    return DynUNet(spatial_dims=3, in_channels=in_channels, out_channels=out_channels,
                   kernel_size=[[3, 3, 3]] * len(strides), strides=strides, upsample_kernel_size=strides[1:],
                   filters=widths, norm_name="instance", res_block=False)


class TrainStep:
    """One optimisation step of ``model``: forward, Dice loss (sigmoid), backward, AdamW update.

    Examples:
        >>> step = TrainStep(segmentation_unet(2, 3, small=True), lr=3e-3)
        >>> loss = step(torch.rand(2, 3, 32, 32), (torch.rand(2, 1, 32, 32) > 0.5).float())
        >>> loss.shape
        torch.Size([])
    """

    def __init__(self, model: torch.nn.Module, lr: float = 3e-3) -> None:
        from monai.losses import DiceLoss

        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.loss = DiceLoss(sigmoid=True)

    def __call__(self, image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Train on one batch; returns the loss (detached)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(self.model(image), target)
        loss.backward()
        self.optimizer.step()
        return loss.detach()
