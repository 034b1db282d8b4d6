"""The GPU variant of the patch section (:mod:`medload.bench.patches`): each contender's batches train a
MONAI ``DynUNet`` (nnU-Net's architecture: 5 levels, 32 base channels doubling to 320, instance norm),
with bf16 autocast, SGD as nnU-Net (lr 0.01, momentum 0.99, Nesterov) and cross-entropy; the ceiling is
the same model on one batch already on the device (``resident``), so a contender's samples/s over it is
the share of the device its loader keeps busy (Isensee et al., Nature Methods 2021, for the network)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from medload.bench.patches_data import PatchSettings

__all__ = ["Trainer", "FILTERS"]

FILTERS = (32, 64, 128, 256, 320)
"""Channels of the 5 levels (nnU-Net caps them at 320 in 3D)."""


class Trainer:
    """One training step per batch of ``settings.batch_size`` patches on ``device``."""

    def __init__(self, settings: PatchSettings, device: str) -> None:
        from monai.networks.nets import DynUNet

        from medload.bench.patches_data import CLASSES

        self.settings, self.device = settings, torch.device(device)
        self.classes = len(CLASSES)
        self.model = DynUNet(3, 1, self.classes, kernel_size=[3] * len(FILTERS), strides=[1] + [2] * (len(FILTERS) - 1),
                             upsample_kernel_size=[2] * (len(FILTERS) - 1), filters=list(FILTERS),
                             norm_name="instance").to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.99, nesterov=True)
        self.loss = torch.nn.CrossEntropyLoss()

    def resident(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same batch, on the device, for ever (the ceiling's input)."""
        shape = (self.settings.batch_size, 1, *self.settings.patch)
        gen = torch.Generator(device=self.device).manual_seed(0)
        image = torch.randn(shape, device=self.device, generator=gen)
        label = torch.randint(0, self.classes, shape, device=self.device, generator=gen)
        while True:
            yield image, label

    def step(self, image: torch.Tensor, label: torch.Tensor) -> None:
        """A forward and backward pass under bf16 autocast, and an optimizer step; waits for the device."""
        image = image.to(self.device, torch.float32, non_blocking=True)
        target = label.to(self.device, non_blocking=True).long()[:, 0].clamp_(0, self.classes - 1)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss(self.model(image).float(), target)
        loss.backward()
        self.optimizer.step()
        loss.item()  # waits for the step, so that the clock measures it
