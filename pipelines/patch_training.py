"""3D patch training for pipelines/train_segmentation.py (``--3d --patch D H W``): nnU-Net's recipe on medload.

    python pipelines/train_segmentation.py --store STORE --3d --patch 96 96 96 --spacing 1.5 1.5 1.5 --foreground 0.33

Training batches are :class:`medload.data.PatchDataset` patches -- ``--patch`` voxels at ``--spacing`` mm
(z, y, x; default: each series' own) along ``--axcodes`` (RAS, LPS...; ``native``: each series' own
directions), a ``--foreground`` share of them centred on a labelled voxel, ``--patches-per-epoch`` of
them each epoch (default: nnU-Net's 250 iterations of the batch; ``--quick``: 8) -- read through
``make_loader``, windowed and augmented on the device. The model is a MONAI DynUNet laid out as nnU-Net
lays out its 3D U-Net for the patch (``medload.models.patch_dynunet``; ``--quick``: 3 small levels).

Validation is whole-series: every validation series (a fifth of the patients, ``split_patients``; with a
single patient, its own series, logged as such) is predicted by sliding-window inference at the training
grid (``medload.data.predict_series``: gaussian blending, the output brought back onto the series' own
voxels), and Dice is computed there, against the stored label, per class; the run's figure is the mean
over series and classes (a class absent from both prediction and label is skipped, as MONAI's Dice).
Whole series rather than a fixed set of patches: what is measured is what inference will deliver,
resampling both ways included.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from medload import windows
from medload.data import AugmentConfig, BatchAugment, PatchDataset, make_loader, predict_series, split_patients
from medload.data.index import slice_index
from medload.data.labelling import class_tables
from medload.data.patch_geometry import axcode_directions
from medload.errors import ConfigError
from medload.models import TrainStep, patch_dynunet
from medload.storage.selection import select_series

log = logging.getLogger("train_segmentation")

#: nnU-Net's iterations per epoch: an epoch is this many batches of patches
NNUNET_ITERATIONS = 250
_QUICK_PATCHES = 8


def add_patch_flags(ap: argparse.ArgumentParser) -> None:
    """The 3D patch flags of the pipeline."""
    ap.add_argument("--patch", nargs=3, type=int, default=None, metavar=("D", "H", "W"),
                    help="3D patches of D x H x W voxels (with --3d) instead of slabs")
    ap.add_argument("--spacing", nargs=3, type=float, default=None, metavar=("Z", "Y", "X"),
                    help="patches: voxel spacing in mm along D, H, W (default: each series' own)")
    ap.add_argument("--axcodes", default=None,
                    help="patches: where W, H and D point, as MONAI's Orientationd axcodes (default RAS); "
                         "native: each series' own directions")
    ap.add_argument("--foreground", type=float, default=None,
                    help="patches: share centred on a labelled voxel, in [0, 1] (default 0.33, nnU-Net's)")
    ap.add_argument("--patches-per-epoch", type=int, default=None,
                    help=f"patches: per epoch (default {NNUNET_ITERATIONS} x the batch size, nnU-Net's; --quick: "
                         f"{_QUICK_PATCHES})")


def check_patch_flags(ap: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Refuse patch flags that do not fit (``ap.error``, naming the flag); fill in the patch defaults."""
    given = [f for f, v in (("--spacing", args.spacing), ("--axcodes", args.axcodes),
                            ("--foreground", args.foreground), ("--patches-per-epoch", args.patches_per_epoch))
             if v is not None]
    if args.patch is None:
        if given:
            ap.error(f"{', '.join(given)} set 3D patches: add --3d --patch D H W")
        return
    if not args.three_d:
        ap.error("--patch trains 3D patches: add --3d")
    if min(args.patch) < 1:
        ap.error(f"--patch: sizes are voxels, at least 1 each, got {' '.join(map(str, args.patch))}")
    if args.spacing is not None and min(args.spacing) <= 0:
        ap.error(f"--spacing: mm between voxels, positive, got {' '.join(map(str, args.spacing))}")
    if args.foreground is not None and not 0.0 <= args.foreground <= 1.0:
        ap.error(f"--foreground: a share of the patches, in [0, 1], got {args.foreground}")
    if args.patches_per_epoch is not None and args.patches_per_epoch < 1:
        ap.error(f"--patches-per-epoch: at least 1, got {args.patches_per_epoch}")
    if any(a == "--downsample" or a.startswith("--downsample=") for a in argv):
        ap.error("--downsample pools slices and slabs; with --patch, --spacing sets the resolution: drop --downsample")
    axcodes = "RAS" if args.axcodes is None else args.axcodes
    args.axcodes = None if axcodes.lower() == "native" else axcodes.upper()
    if args.axcodes is not None:
        try:
            axcode_directions(args.axcodes)
        except ConfigError:
            ap.error(f"--axcodes: three letters, one of R/L, A/P and S/I each (RAS, LPS), or native; got {axcodes!r}")
    args.foreground = 0.33 if args.foreground is None else args.foreground
    if args.patches_per_epoch is None:
        args.patches_per_epoch = _QUICK_PATCHES if args.quick else NNUNET_ITERATIONS * args.batch_size


def patch_dataset(args: argparse.Namespace, store, filters: dict, labels: bool | str) -> PatchDataset:
    """The patches of every selected series (the plane filter, which PatchDataset lacks, resolved to keys)."""
    keys = [r.key for r in select_series(store.series(), **filters)]
    if not keys:
        raise ConfigError(f"the series filters select none of the {len(store.series())} series of {args.store}")
    return PatchDataset(store, args.patch, args.spacing, args.axcodes, foreground=args.foreground,
                        samples_per_epoch=args.patches_per_epoch, seed=args.seed, labels=labels, keys=keys)


class _Targets:
    """The training target of a patch batch and of a whole series: the demo threshold, foreground vs
    background, or one channel per class of a class map (each series' stored values through its table)."""

    def __init__(self, demo: str | None, bone_hu: float, dataset: PatchDataset, classes, device: torch.device) -> None:
        self.demo, self.bone_hu, self.device = demo, bone_hu, device
        self.names: dict[int, str] | None = None
        self.luts: dict[str, np.ndarray] | None = None
        if classes is not None:
            self.names, self.luts = class_tables([dataset.store.labels(r.key) for r in dataset.records], classes)
        self.channels = 1 if self.names is None else len(self.names)

    def batch(self, batch: dict) -> torch.Tensor:
        """``(B, channels, D, H, W)`` float targets of a training batch (its HU image, its labels)."""
        if self.demo is not None:
            return (batch["image"] > self.bone_hu).float()
        label = batch["label"].long()
        if self.luts is None:
            return (label > 0).float()
        mapped = torch.stack([torch.as_tensor(self.luts[k], device=label.device).long()[label[b]]
                              for b, k in enumerate(batch["key"])])
        return torch.cat([mapped == v for v in range(1, self.channels + 1)], dim=1).float()

    def series(self, store, key: str) -> np.ndarray:
        """The class ids (0 background, 1..channels) of a whole stored series."""
        if self.demo is not None:
            return (store.read(key) > self.bone_hu).astype(np.uint8)
        label = store.read_label(key)
        return (label > 0).astype(np.uint8) if self.luts is None else self.luts[key][label]


def series_dice(pred: np.ndarray, truth: np.ndarray, channels: int) -> list[float]:
    """Dice per class 1..channels of two class-id maps; a class in neither is skipped (MONAI's ignore_empty)."""
    out = []
    for k in range(1, channels + 1):
        p, t = pred == k, truth == k
        total = int(p.sum()) + int(t.sum())
        if total:
            out.append(2.0 * int((p & t).sum()) / total)
    return out


def _with_background(net: torch.nn.Module, channels: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The net's per-class logits with a zero background logit in front: one channel stays a logit
    (predict_series thresholds it at 0); several become arg-max scores where background wins when every
    class' logit is below 0, the sigmoid training's own decision."""
    if channels == 1:
        return net
    return lambda x: F.pad(net(x), (0, 0, 0, 0, 0, 0, 1, 0))


def train_patches(args: argparse.Namespace, dataset: PatchDataset, classes, device: torch.device,
                  bone_hu: float) -> dict:
    """Train the DynUNet on ``dataset``'s patches; validate by sliding-window inference on whole series."""
    store = dataset.store
    split = split_patients(slice_index(dataset.records), 0.2 if _patients(dataset) > 1 else 0.0, args.seed)
    val_keys = split.val or split.train
    if not split.val:
        log.warning("one patient: validation predicts its own training series, not a held-out one")
    train_ds = PatchDataset(store, args.patch, args.spacing, args.axcodes, foreground=args.foreground,
                            samples_per_epoch=args.patches_per_epoch, seed=args.seed, labels=dataset.labels or False,
                            keys=split.train)
    targets = _Targets(args.demo_target, bone_hu, dataset, classes, device)  # the tables of every series
    if targets.names is not None:
        log.info("classes: %s", ", ".join(f"channel {v - 1} = {n}" for v, n in sorted(targets.names.items())))
    log.info("3D patches %s at %s mm along %s, %.2f centred on labels: %d patches an epoch from %d series; "
             "validation on %d whole series", "x".join(map(str, args.patch)),
             "native" if args.spacing is None else "x".join(f"{s:g}" for s in args.spacing),
             args.axcodes or "native", args.foreground, args.patches_per_epoch, len(split.train), len(val_keys))
    loader = make_loader(train_ds, device=device, config=args.loader)  # each index is a fresh seeded draw
    net = patch_dynunet(args.patch, 1, targets.channels, small=args.quick).to(device)
    if args.init is not None:
        net.load_state_dict(torch.load(args.init, map_location=device, weights_only=True))
    step = TrainStep(net, lr=args.lr)
    augment = BatchAugment(AugmentConfig(), device=device, seed=args.seed, spatial_dims=3)
    lo, hi = windows.get(args.window).bounds

    def normalise(hu: torch.Tensor) -> torch.Tensor:
        return ((hu - lo) / (hi - lo)).clamp_(0, 1)

    args.out.mkdir(parents=True, exist_ok=True)
    history, best = [], -1.0
    for epoch in range(args.epochs):
        started = time.perf_counter()
        loader.set_epoch(epoch)
        augment.set_epoch(epoch)
        net.train()
        loss_sum, steps = 0.0, 0
        for batch in loader:
            if args.max_steps is not None and steps >= args.max_steps:
                break
            image, target = augment(normalise(batch["image"]), targets.batch(batch))
            loss_sum, steps = loss_sum + step(image, target).item(), steps + 1
        net.eval()
        dice = []
        for key in val_keys:
            pred = predict_series(store, key, _with_background(net, targets.channels), args.patch, args.spacing,
                                  args.axcodes, device=str(device), preprocess=normalise)
            dice += series_dice(pred, targets.series(store, key), targets.channels)
        val_dice = float(np.mean(dice)) if dice else 0.0
        history.append({"epoch": epoch, "train_loss": loss_sum / steps if steps else None, "val_dice": val_dice,
                        "val_series_evaluated": len(val_keys), "seconds": time.perf_counter() - started})
        log.info("epoch %d: train loss %s over %d steps, validation Dice %.4f on %d whole series (%.1f s)", epoch,
                 "-" if not steps else f"{loss_sum / steps:.4f}", steps, val_dice, len(val_keys),
                 history[-1]["seconds"])
        if val_dice > best:
            best = val_dice
            torch.save(net.state_dict(), args.out / "best_model.pt")
    summary = {"store": str(args.store), "mode": "3d-patch", "patch": list(args.patch),
               "spacing": None if args.spacing is None else list(args.spacing), "axcodes": args.axcodes,
               "foreground": args.foreground, "patches_per_epoch": args.patches_per_epoch, "history": history,
               "series": len(dataset.records), "unlabelled_left_out": len(dataset.unlabelled),
               "classes": None if targets.names is None else [targets.names[v] for v in sorted(targets.names)],
               "best_val_dice": best, "train_series": list(split.train), "val_series": list(val_keys),
               "val_held_out": bool(split.val), "world_size": 1}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("best validation Dice %.4f; model and summary in %s", best, args.out)
    return summary


def _patients(dataset: PatchDataset) -> int:
    return len({r.patient for r in dataset.records})
