"""Train a MONAI UNet on a medload store: 2.5D (2D UNet, neighbour slices as channels) or 3D slabs.

    python pipelines/train_segmentation.py --store stores/sample --quick
    python pipelines/train_segmentation.py --store STORE --epochs 50 --batch-size 16 --workers 8 --device cuda
    python pipelines/train_segmentation.py --store STORE --3d --depth 32

Everything here is the package's public API: SliceDataset/SlabDataset, make_loader (int16 batches,
windowed on the device), BatchAugment (on the device), partition_by_patient (a patient-level
validation split), MONAI's UNet and DiceLoss. Per epoch it prints the training loss and the
validation Dice; it saves the best model and a JSON summary in --out.

Labels come from the store (``medload ingest --labels``). A store without labels (such as the sample
study) can still be trained end to end with ``--demo-target bone``: the target is then "voxels above
300 HU" of the centre slice (2.5D) or of the slab (3D), computed from the HU on the device.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from monai.losses import DiceLoss
from monai.metrics import DiceMetric
from monai.networks.nets import UNet

from medload import open_store, windows
from medload.data import AugmentConfig, BatchAugment, SlabDataset, SliceDataset, make_loader, partition_by_patient

log = logging.getLogger("train_segmentation")

_BONE_HU = 300.0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("runs/segmentation"))
    ap.add_argument("--3d", dest="three_d", action="store_true", help="3D UNet on slabs instead of 2.5D")
    ap.add_argument("--context", type=int, default=1, help="2.5D: neighbour slices on each side")
    ap.add_argument("--depth", type=int, default=16, help="3D: slab depth")
    ap.add_argument("--window", default="soft_tissue")
    ap.add_argument("--demo-target", choices=["bone"], help="train on a threshold target when the store has no labels")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--downsample", type=int, default=1, help="average-pool inputs by this factor (speed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a short CPU-sized run: 4 epochs, small net, 2x downsampled")
    args = ap.parse_args(argv)
    if args.quick:
        args.epochs, args.batch_size, args.downsample, args.workers = 4, 4, 2, 0
    return args


def split_by_patient(dataset, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Validation = one of five patient groups; with a single patient, the last fifth of each series."""
    index = dataset.index
    if len(np.unique(index.patients)) >= 2:
        parts = partition_by_patient(index.patients, 5, seed=seed, epoch=0)
        val = parts[0] if len(parts[0]) else parts[1]
        return np.setdiff1d(np.arange(len(index)), val), np.sort(val)
    last = np.zeros(len(index), dtype=bool)
    for s in np.unique(index.series):
        rows = np.flatnonzero(index.series == s)
        last[rows[int(len(rows) * 0.8):]] = True
    return np.flatnonzero(~last), np.flatnonzero(last)


def target_of(batch: dict, hu_center: torch.Tensor | None, demo: str | None) -> torch.Tensor:
    if demo == "bone":
        return (hu_center > _BONE_HU).to(torch.float32)
    return (batch["label"] > 0).to(torch.float32)  # foreground vs background


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    store = open_store(args.store, cache="1GB")
    if args.three_d:
        dataset = SlabDataset(store, depth=args.depth, stride=args.depth // 2)
    else:
        dataset = SliceDataset(store, context=args.context)
    if not dataset.labels and args.demo_target is None:
        raise SystemExit(f"{args.store} has no labels: ingest them (medload ingest --labels) or pass --demo-target bone")
    train_idx, val_idx = split_by_patient(dataset, args.seed)
    log.info("%d training and %d validation samples", len(train_idx), len(val_idx))
    device = torch.device(args.device)
    window = windows.get(args.window)

    # HU batches: the window is applied here, after the demo target (if any) is read from the HU
    def loader(indices, shuffle: bool):
        sampler = (torch.utils.data.SubsetRandomSampler(indices, generator=torch.Generator().manual_seed(args.seed))
                   if shuffle else indices.tolist())
        return make_loader(dataset, args.batch_size, args.workers, device, sampler=sampler)

    train, val = loader(train_idx, True), loader(val_idx, False)
    dims = 3 if args.three_d else 2
    channels = 1 if args.three_d else 2 * args.context + 1
    width = (8, 16, 32) if args.quick else (32, 64, 128, 256)
    model = UNet(spatial_dims=dims, in_channels=channels, out_channels=1, channels=width,
                 strides=(2,) * (len(width) - 1), num_res_units=1).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = DiceLoss(sigmoid=True)
    augment = BatchAugment(AugmentConfig(), device=device, seed=args.seed, spatial_dims=dims)
    dice = DiceMetric(include_background=True, reduction="mean")
    args.out.mkdir(parents=True, exist_ok=True)
    history, best = [], -1.0

    def prepare(batch: dict, train_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        hu = batch["image"]  # float HU (no window in make_loader)
        centre = hu[:, args.context : args.context + 1] if dims == 2 else hu
        target = target_of(batch, centre, args.demo_target)
        lo, hi = window.bounds
        image = ((hu - lo) / (hi - lo)).clamp_(0, 1)
        if args.downsample > 1:
            pool = F.avg_pool2d if dims == 2 else F.avg_pool3d
            image, target = pool(image, args.downsample), (pool(target, args.downsample) > 0.5).float()
        if train_mode:
            image, target = augment(image, target)
        return image, target

    for epoch in range(args.epochs):
        started = time.perf_counter()
        train.set_epoch(epoch)
        augment.set_epoch(epoch)
        model.train()
        losses = []
        for batch in train:
            image, target = prepare(batch, True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(image), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            for batch in val:
                image, target = prepare(batch, False)
                dice(y_pred=(torch.sigmoid(model(image)) > 0.5).float(), y=target)
        val_dice = float(dice.aggregate())
        dice.reset()
        history.append({"epoch": epoch, "train_loss": float(np.mean(losses)), "val_dice": val_dice,
                        "seconds": time.perf_counter() - started})
        log.info("epoch %d: train loss %.4f, validation Dice %.4f (%.1f s)", epoch, history[-1]["train_loss"],
                 val_dice, history[-1]["seconds"])
        if val_dice > best:
            best = val_dice
            torch.save(model.state_dict(), args.out / "best_model.pt")
    summary = {"store": str(args.store), "mode": "3d" if args.three_d else "2.5d", "history": history,
               "best_val_dice": best, "train_samples": int(len(train_idx)), "val_samples": int(len(val_idx))}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("best validation Dice %.4f; model and summary in %s", best, args.out)
    return summary


if __name__ == "__main__":
    main()
