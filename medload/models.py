"""The segmentation model and training step that ``pipelines/train_segmentation.py`` trains and
``medload profile`` times: a MONAI UNet, Dice loss on logits, AdamW."""

from __future__ import annotations

import torch

__all__ = ["segmentation_unet", "TrainStep"]


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
