"""Train a MONAI UNet on a medload store: 2.5D (2D UNet, neighbour slices as channels), 3D slabs or 3D patches.

    python pipelines/train_segmentation.py --store stores/sample --quick
    python pipelines/train_segmentation.py --store STORE --epochs 50 --batch-size 16 --num-workers 8 --device cuda
    python pipelines/train_segmentation.py --store STORE --3d --depth 32
    python pipelines/train_segmentation.py --store STORE --3d --patch 96 96 96 --spacing 1.5 1.5 1.5 --foreground 0.33

3D patches (``--3d --patch D H W``, with ``--spacing``, ``--axcodes``, ``--foreground``,
``--patches-per-epoch``) train a DynUNet on PatchDataset patches at a target spacing and orientation and
validate by sliding-window inference on whole series: pipelines/patch_training.py says how.
    torchrun --nproc_per_node 4 pipelines/train_segmentation.py --store STORE --seed 0

Everything here is the package's public API: SliceDataset/SlabDataset, make_loader (int16 batches,
windowed on the device), BatchAugment (on the device), DistributedPatientSampler (patients to ranks,
preferring local shards), locality_order (a patient-level validation split), MONAI's UNet and DiceLoss
(medload.models: the model and training step `medload profile` times too).
Per epoch it logs the training loss and the validation Dice; it saves the best model and a JSON summary
(with the patients each rank trained on) in --out.

Under torchrun (LOCAL_RANK and WORLD_SIZE set) it joins the process group (nccl on GPUs, gloo on CPU),
wraps the model in DDP and gives each rank its own patients: the shards that
``medload cache warm STORE --rank R --world W --seed S`` copies (same --seed). Training ranks run equal
numbers of steps (a rank with fewer samples repeats its own); validation is not padded, and Dice is
all-reduced from per-sample sums and counts, so each validation sample counts once and the result
equals the single-process Dice of the same weights. Rank 0 logs and writes the outputs.

Labels come from the store (``medload ingest --labels``). The run trains on the labelled series of the
selection (``--labels only``, the default; it logs how many it left out; ``--labels all`` refuses
unlabelled ones). One stored class: foreground vs background. Several: it stops unless ``--classes``
says what to train -- ``--classes liver,spleen`` (one output channel each) or ``--classes
organs=Liver+Spleen`` (merged, because asked) -- since one foreground would merge them. ``--query``,
``--keys``, ``--modality``, ``--thickness`` and ``--orientation`` select the series as the datasets do.
A store without labels (such as the sample study) can still be trained end to end with ``--demo-target
bone``: the target is then "voxels above 300 HU" of the centre slice (2.5D) or of the slab (3D), computed
from the HU on the device.

    python pipelines/train_segmentation.py --store stores/ct --quick --classes liver,spleen --query "kernel == 'B30f'"

Loader settings (medload.config.LoaderConfig) come from the flags, else the [loader] table of --config FILE,
else the defaults: --batch-size 8, --num-workers 2, --window soft_tissue (--quick: batch 4, no workers). The
table's other settings (dtype, prefetch_factor, pin_memory...) go to make_loader as they are; its window is
applied here, after the demo target is read from the HU. --workers is the old spelling of --num-workers (it
warns, and goes in the next release).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from monai.metrics import compute_dice
from torch.nn.parallel import DistributedDataParallel

from medload import open_store, windows
from medload.config import LoaderConfig, load_config
from medload.data import (
    AugmentConfig,
    BatchAugment,
    DistributedPatientSampler,
    PatchDataset,
    SlabDataset,
    SliceDataset,
    locality_order,
    make_loader,
    sample_layout,
)
from medload.data.labelling import parse_classes, stored_class_names
from medload.devices import checked_device
from medload.errors import ConfigError, MedloadError
from medload.export.nnunet import select_keys
from medload.models import TrainStep, segmentation_unet
from medload.storage.orientation import ORIENTATIONS
from medload.storage.selection import select_series

sys.path.insert(0, str(Path(__file__).resolve().parent))
from patch_training import add_patch_flags, check_patch_flags, patch_dataset, train_patches  # noqa: E402

log = logging.getLogger("train_segmentation")

_BONE_HU = 300.0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("runs/segmentation"))
    ap.add_argument("--3d", dest="three_d", action="store_true", help="3D UNet on slabs instead of 2.5D")
    ap.add_argument("--context", type=int, default=1, help="2.5D: neighbour slices on each side")
    ap.add_argument("--depth", type=int, default=16, help="3D: slab depth")
    ap.add_argument("--window", default=None, help="window applied to the HU (default: [loader] window, else soft_tissue)")
    ap.add_argument("--demo-target", choices=["bone"], help="train on a threshold target when the store has no labels")
    ap.add_argument("--labels", choices=["only", "all"], default="only",
                    help="only: train on the selected series that have labels, leaving the others out (logged); "
                         "all: every selected series must have labels")
    ap.add_argument("--classes", default=None,
                    help="stored label classes to train, one output channel each (liver,spleen); NAME=A+B makes one "
                         "channel of several stored classes (a merge). Needed where the labels hold several classes")
    ap.add_argument("--query", default=None, help="series filter: a pandas query on the store's catalog "
                    "(\"kernel == 'B30f' and slice_thickness <= 1.5\")")
    ap.add_argument("--keys", nargs="+", default=None, help="series filter: series keys or key prefixes")
    ap.add_argument("--modality", default=None, help="series filter: modality (any case)")
    ap.add_argument("--thickness", nargs=2, type=float, default=None, metavar=("LO", "HI"),
                    help="series filter: slice thickness range in mm")
    ap.add_argument("--orientation", default=None, choices=ORIENTATIONS, help="series filter: the plane of the slices")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=None, help="default: [loader] batch_size, else 8 (--quick: 4)")
    ap.add_argument("--num-workers", type=int, default=None,
                    help="loader processes (DataLoader workers); default: [loader] num_workers, else 2 (--quick: 0)")
    ap.add_argument("--workers", dest="old_workers", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", type=Path, default=None, help="TOML settings: its [loader] table (see docs/cli.md)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--downsample", type=int, default=1, help="average-pool inputs by this factor (speed)")
    ap.add_argument("--seed", type=int, default=0, help="split, rank assignment and order (as cache warm --seed)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop each epoch's training after this many steps")
    ap.add_argument("--init", type=Path, default=None, help="start from these weights (a saved best_model.pt)")
    ap.add_argument("--quick", action="store_true",
                    help="a short CPU-sized run: by default 4 epochs, batch 4, 2x downsampled, no workers, small net")
    add_patch_flags(ap)
    args = ap.parse_args(argv)
    if args.quick:  # defaults only: flags given explicitly win
        ap.set_defaults(epochs=4, downsample=2)
        args = ap.parse_args(argv)
    if args.old_workers is not None:
        if args.num_workers is not None:
            ap.error("--workers and --num-workers are one option: give --num-workers only")
        warnings.warn("--workers is now --num-workers; the old spelling stops working in the next release",
                      FutureWarning, stacklevel=2)
        args.num_workers = args.old_workers
    config = LoaderConfig() if args.config is None else load_config(args.config).loader
    args.batch_size = _first(args.batch_size, config.batch_size, 2 if args.patch else 4 if args.quick else 8)
    args.num_workers = _first(args.num_workers, config.num_workers, 0 if args.quick else 2)
    args.window = _first(args.window, config.window, "soft_tissue")
    check_patch_flags(ap, args, sys.argv[1:] if argv is None else list(argv))
    # the rest of [loader] goes to make_loader; the window is applied in the training step (after the demo target)
    args.loader = dataclasses.replace(config, batch_size=args.batch_size, num_workers=args.num_workers, window=None)
    return args


def _first(flag, configured, default):
    """A loader setting: the flag given, else the [loader] table's, else the pipeline's default."""
    return next(v for v in (flag, configured, default) if v is not None)


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Under torchrun: join the process group (nccl on CUDA, else gloo) and
    use GPU LOCAL_RANK; otherwise a single process on ``device``."""
    dev = checked_device(device)
    if "LOCAL_RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, dev
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), dev


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """``values`` summed over ranks (unchanged in a single process)."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def split_by_patient(dataset, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Validation = every fifth patient along the shard-locality order (so it spans every shard, and every
    rank keeps about four fifths of its load for training); with a single patient, the last fifth of
    each series."""
    index = dataset.index
    patients, shards, slices = sample_layout(dataset)
    if len(np.unique(patients)) >= 2:
        order = locality_order(patients, seed=seed, shards=shards, weights=slices)
        val = np.isin(patients, order[seed % min(5, order.size)::5])
        return np.flatnonzero(~val), np.flatnonzero(val)
    last = np.zeros(len(index), dtype=bool)
    for s in np.unique(index.series):
        rows = np.flatnonzero(index.series == s)
        last[rows[int(len(rows) * 0.8):]] = True
    return np.flatnonzero(~last), np.flatnonzero(last)


def target_of(batch: dict, hu_center: torch.Tensor | None, demo: str | None, classes: int | None) -> torch.Tensor:
    """The training target: the demo threshold, foreground vs background (the labels hold one class), or
    one channel per class of the class map (label value k: channel k - 1)."""
    if demo == "bone":
        return (hu_center > _BONE_HU).to(torch.float32)
    label = batch["label"]
    if classes is None:
        return (label > 0).to(torch.float32)
    return torch.cat([label == k for k in range(1, classes + 1)], dim=1).to(torch.float32)


def series_filters(args: argparse.Namespace, store) -> dict:
    """The datasets' series filters from --query, --keys, --modality, --thickness and --orientation."""
    keys = args.keys
    if args.query is not None:
        chosen = select_keys(store, args.query)
        if not chosen:
            raise ConfigError(f"--query {args.query!r} matched 0 of {len(store.series())} series of {args.store}: "
                              "check it against store.catalog()")
        keys = chosen if keys is None else [k for k in chosen if k.startswith(tuple(p.lower() for p in keys))]
        if not keys:
            raise ConfigError(f"--query {args.query!r} and --keys {' '.join(args.keys)} have no series in common")
    return {"keys": keys, "modality": args.modality, "orientation": args.orientation,
            "thickness": None if args.thickness is None else tuple(args.thickness)}


def label_choice(args: argparse.Namespace, store, filters: dict) -> tuple[bool | str, dict | None]:
    """The datasets' ``labels=`` (none for a --demo-target) and the class map of --classes; stops where
    the selection has no labels to train on."""
    classes = None if args.classes is None else parse_classes(args.classes)
    if args.demo_target is not None:
        if classes is not None:
            raise ConfigError("--classes picks stored label classes and --demo-target trains on a threshold target "
                              "instead: give one of them")
        return False, None
    selected = select_series(store.series(), **filters)
    if selected and not any(store.labels(r.key) is not None for r in selected):
        raise SystemExit(f"{args.store} has no labels on the {len(selected)} selected series: ingest them "
                         "(medload ingest --labels) or pass --demo-target bone")
    return ("only" if args.labels == "only" else True), classes


def build_dataset(args: argparse.Namespace, store) -> SliceDataset | SlabDataset | PatchDataset:
    """The dataset the run trains on: the filtered series, their labels as --labels and --classes say (no
    labels for a --demo-target); a ConfigError where labels hold several classes and no --classes says
    what to train (one foreground would merge them)."""
    filters = series_filters(args, store)
    labels, classes = label_choice(args, store, filters)
    dataset: SliceDataset | SlabDataset | PatchDataset
    if args.patch is not None:
        dataset = patch_dataset(args, store, filters, labels)
    elif args.three_d:
        dataset = SlabDataset(store, depth=args.depth, stride=args.depth // 2, labels=labels, classes=classes,
                              **filters)
    else:
        dataset = SliceDataset(store, context=args.context, labels=labels, classes=classes, **filters)
    if dataset.labels and classes is None:
        stored = stored_class_names([store.labels(r.key) for r in dataset.records])
        if len(stored) > 1:
            raise ConfigError(
                f"the labelled series hold {len(stored)} classes ({', '.join(stored)}): training one foreground "
                f"would merge them. Say what to train: --classes {','.join(stored)} (one channel each), --classes "
                f"{stored[0]} (one of them), or --classes 'foreground={'+'.join(stored)}' (merged, on purpose)")
    return dataset


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device)
    try:
        return train(args, rank, world, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank {rank}] %(message)s" if world > 1 else "%(message)s")
    torch.manual_seed(args.seed)
    store = open_store(args.store, cache="1GB")
    dataset = build_dataset(args, store)
    if isinstance(dataset, PatchDataset):
        if world > 1:
            raise ConfigError("--patch trains in one process for now: run it without torchrun")
        return train_patches(args, dataset, None if args.classes is None else parse_classes(args.classes), device,
                             _BONE_HU)
    classes = None if args.classes is None else cast(dict, dataset.class_names)  # set with a class map
    if classes is not None:
        log.info("classes: %s", ", ".join(f"channel {v - 1} = {name}" for v, name in sorted(classes.items())))
    train_idx, val_idx = split_by_patient(dataset, args.seed)
    log.info("%d training and %d validation samples over %d rank(s)", len(train_idx), len(val_idx), world)
    window = windows.get(args.window)

    # training ranks pad to equal steps with their own samples; validation visits each sample once
    def sampler(indices, training: bool) -> DistributedPatientSampler:
        return DistributedPatientSampler.from_dataset(dataset, indices, rank=rank, world_size=world, seed=args.seed,
                                                      shuffle=training, even="pad" if training else "none")

    train_sampler, val_sampler = sampler(train_idx, True), sampler(val_idx, False)
    # HU batches: the window is applied here, after the demo target (if any) is read from the HU
    train_batches, val_batches = (make_loader(dataset, device=device, sampler=s, config=args.loader)
                                  for s in (train_sampler, val_sampler))
    dims = 3 if args.three_d else 2
    channels = 1 if args.three_d else 2 * args.context + 1
    out_channels = 1 if classes is None else len(classes)
    net = segmentation_unet(dims, channels, small=args.quick, out_channels=out_channels).to(device)
    if args.init is not None:
        net.load_state_dict(torch.load(args.init, map_location=device, weights_only=True))
    model = net if world == 1 else DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    step = TrainStep(model, lr=args.lr)
    augment = BatchAugment(AugmentConfig(), device=device, seed=args.seed + rank, spatial_dims=dims)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    history, best, seen = [], -1.0, set()

    def prepare(batch: dict, train_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        hu = batch["image"]  # float HU (no window in make_loader)
        centre = hu[:, args.context : args.context + 1] if dims == 2 else hu
        target = target_of(batch, centre, args.demo_target, None if classes is None else len(classes))
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
        train_batches.set_epoch(epoch)
        augment.set_epoch(epoch)
        model.train()
        loss_sum, steps = 0.0, 0
        for batch in train_batches:
            if args.max_steps is not None and steps >= args.max_steps:
                break  # every rank has the same number of batches, so every rank stops here
            seen.update(batch["index"].tolist())
            image, target = prepare(batch, True)
            loss_sum, steps = loss_sum + step(image, target).item(), steps + 1
        # Validation runs no collective until the one all_sum below: ranks validate different numbers of
        # batches (a rank may have none), so the bare module, and MONAI's functional Dice -- DiceMetric's
        # buffer all-gathers across ranks when read, which deadlocked a rank that had nothing to read.
        net.eval()
        evaluated, parts = 0, []
        with torch.no_grad():
            for batch in val_batches:
                image, target = prepare(batch, False)
                parts.append(compute_dice((torch.sigmoid(net(image)) > 0.5).float(), target).reshape(-1))
                evaluated += len(image)
        per_sample = torch.cat(parts) if parts else torch.zeros(0)
        valid = ~torch.isnan(per_sample)  # as DiceMetric's mean, skip samples with an empty target
        loss_sum, steps, dice_sum, dice_n, evaluated = all_sum(
            [loss_sum, steps, float(per_sample[valid].sum()), int(valid.sum()), evaluated], device)
        val_dice = dice_sum / dice_n if dice_n else 0.0
        history.append({"epoch": epoch, "train_loss": loss_sum / steps if steps else None, "val_dice": val_dice,
                        "val_samples_evaluated": int(evaluated), "seconds": time.perf_counter() - started})
        log.info("epoch %d: train loss %s, validation Dice %.4f on %d samples (%.1f s)", epoch,
                 "-" if not steps else f"{loss_sum / steps:.4f}", val_dice, evaluated, history[-1]["seconds"])
        if val_dice > best:
            best = val_dice
            if rank == 0:
                torch.save(net.state_dict(), args.out / "best_model.pt")
    summary = {"store": str(args.store), "mode": "3d" if args.three_d else "2.5d", "history": history,
               "series": len(dataset.records), "unlabelled_left_out": len(dataset.unlabelled),
               "classes": None if classes is None else [classes[v] for v in sorted(classes)],
               "best_val_dice": best, "train_samples": int(len(train_idx)), "val_samples": int(len(val_idx)),
               "world_size": world, "ranks": gather(rank_report(dataset, rank, train_sampler, val_sampler, seen))}
    if rank == 0:
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("best validation Dice %.4f; model and summary in %s", best, args.out)
        log.info("%s", recap(args, dataset, best))
    return summary


def recap(args: argparse.Namespace, dataset, best: float) -> str:
    """What the run was, what its Dice says, and what to try next (printed at the end of ``make demo``)."""
    series, samples = len(dataset.records), len(dataset)
    names = None if args.demo_target or args.classes is None else dataset.class_names
    target = (f"the demo target '{args.demo_target}' (voxels above {_BONE_HU} HU, computed from the HU)"
              if args.demo_target else "the stored labels (foreground vs background)" if not names
              else f"the stored classes {', '.join(names[v] for v in sorted(names))} (one channel each)")
    run = (f"{args.epochs} epochs of a {'3D' if args.three_d else '2.5D'} UNet on {series} series "
           f"({samples} samples) of {args.store}, on {target}")
    if args.quick:
        verdict = (f"--quick is a smoke test (a small UNet, inputs downsampled {args.downsample}x, a few CPU epochs): "
                   f"a Dice of {best:.2f} shows the path from DICOM to a trained step runs, not a model worth using")
    else:
        verdict = f"best validation Dice {best:.2f} on patients the model did not train on"
    return (f"recap: {run}. {verdict}. Next: `medload info {args.store}` and notebooks/ to look at the data; "
            "ingest your own series with labels (docs/ingest.md); train longer on a GPU (--device cuda --epochs 50); "
            "see where time goes with `medload profile` (docs/training.md)")


def rank_report(dataset, rank: int, train_sampler, val_sampler, seen: set[int]) -> dict:
    """What this rank owns and what it trained on: samples and patient pseudonyms."""
    records = dataset.records

    def patients(indices) -> list[str]:
        series = np.unique(dataset.index.series[np.asarray(list(indices), dtype=np.int64)])
        return sorted({records[s].patient for s in series.tolist()})

    own = np.asarray(list(train_sampler))[~train_sampler.padding]
    return {"rank": rank, "train_samples": int(own.size), "padded": train_sampler.padded,
            "train_patients": patients(own), "seen_patients": patients(seen),
            "val_samples": len(val_sampler), "val_patients": patients(list(val_sampler))}


def gather(report: dict) -> list[dict]:
    """Every rank's ``report``, in rank order (just this one in a single process)."""
    if not dist.is_initialized():
        return [report]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, report)
    return out


if __name__ == "__main__":
    try:
        main()
    except MedloadError as exc:  # a bad flag or store: one line saying what to do, not a traceback
        raise SystemExit(f"error: {exc}") from None
