"""Predict the validation series of a store and send each prediction to the PACS as a DICOM SEG.

    python pipelines/predict_to_seg.py --store STORE --model runs/segmentation/best_model.pt \\
        --to dicomweb://pacs:8042/dicom-web --credentials ~/.config/medload/pacs.cred
    python pipelines/predict_to_seg.py --store stores/sample --model runs/quick/best_model.pt --quick --to ...
    python pipelines/predict_to_seg.py --store STORE --demo-target bone --to dimse://PACS@pacs:104

The validation series are those holding validation samples under train_segmentation.py's split with the
same --seed (every fifth patient; a store of one patient validates on every series). Each is predicted
whole with the 2.5D UNet that train_segmentation.py saved (--context, --window, --downsample and --quick
as it was trained; the prediction is upsampled back by nearest neighbour), or, with ``--demo-target bone``
and no model, set to the voxels above 300 HU. ``medload.writeback`` then finds the series' originals in
the PACS by the pseudonym of their SeriesInstanceUID, refuses one whose instances or grid changed since
ingest, and stores the SEG (STOW-RS or C-STORE) in their study. The summary JSON in --out names series by
store key and pseudonyms only.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_segmentation import _BONE_HU, split_by_patient  # noqa: E402  (the split the model was trained with)

from medload import open_store, windows  # noqa: E402
from medload.data import SliceDataset  # noqa: E402
from medload.models import segmentation_unet  # noqa: E402
from medload.writeback import Segment, WritebackError, connect, to_seg  # noqa: E402

log = logging.getLogger("predict_to_seg")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--to", required=True, help="the PACS the store was ingested from (dicomweb:// or dimse://)")
    ap.add_argument("--model", type=Path, help="best_model.pt of train_segmentation.py (2.5D)")
    ap.add_argument("--demo-target", choices=["bone"], help="no model: predict the voxels above 300 HU")
    ap.add_argument("--quick", action="store_true", help="the model was trained with --quick (small net, 2x downsampled)")
    ap.add_argument("--context", type=int, default=1)
    ap.add_argument("--window", default="soft_tissue")
    ap.add_argument("--downsample", type=int, default=None, help="as in training (default 1, 2 with --quick)")
    ap.add_argument("--seed", type=int, default=0, help="train_segmentation.py's --seed (its validation split)")
    ap.add_argument("--label", default="foreground", help="the segment's label")
    ap.add_argument("--credentials", type=Path, help="dicomweb://: a 0600 file with user:password or a token")
    ap.add_argument("--calling-aet", default="MEDLOAD", help="dimse://: medload's AE title")
    ap.add_argument("--query", default="", help="matching keys narrowing the search for the originals")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("runs/predictions"))
    args = ap.parse_args(argv)
    if (args.model is None) == (args.demo_target is None):
        ap.error("give --model (a trained UNet) or --demo-target bone, not both")
    if args.downsample is None:
        args.downsample = 2 if args.quick else 1
    return args


def validation_keys(dataset: SliceDataset, seed: int) -> list[str]:
    """Keys of the series holding validation samples, in store order."""
    _, val = split_by_patient(dataset, seed)
    return [dataset.records[s].key for s in np.unique(dataset.index.series[val]).tolist()]


@torch.no_grad()
def predict(net: torch.nn.Module, dataset: SliceDataset, key: str, args: argparse.Namespace) -> np.ndarray:
    """``(D, H, W)`` 0/1 prediction of series ``key``, slice by slice (each with its neighbours as channels)."""
    rows = np.flatnonzero(np.asarray(dataset.index.keys)[dataset.index.series] == key)
    lo, hi = windows.get(args.window).bounds
    out = {}
    for start in range(0, len(rows), args.batch_size):
        items = [dataset[int(i)] for i in rows[start:start + args.batch_size]]
        hu = torch.stack([torch.as_tensor(np.asarray(item["image"]), dtype=torch.float32) for item in items])
        image = ((hu.to(args.device) - lo) / (hi - lo)).clamp_(0, 1)
        if args.downsample > 1:
            image = F.avg_pool2d(image, args.downsample)
        logits = net(image)
        if args.downsample > 1:
            logits = F.interpolate(logits, size=hu.shape[-2:], mode="nearest")
        for item, mask in zip(items, (torch.sigmoid(logits[:, 0]) > 0.5).cpu().numpy()):
            out[int(item["z"])] = mask
    return np.stack([out[z] for z in sorted(out)]).astype(np.uint8)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    store = open_store(args.store)
    dataset = SliceDataset(store, context=args.context, labels=False)
    keys = validation_keys(dataset, args.seed)
    net = None
    if args.model is not None:
        net = segmentation_unet(2, 2 * args.context + 1, small=args.quick).to(args.device).eval()
        net.load_state_dict(torch.load(args.model, map_location=args.device, weights_only=True))
    sent, refused = [], {}
    with connect(args.to, credentials=args.credentials, calling_aet=args.calling_aet) as pacs:
        for key in keys:
            mask = (store.read(key) > _BONE_HU).astype(np.uint8) if net is None else predict(net, dataset, key, args)
            try:
                seg = to_seg(store, key, mask, {1: Segment(args.label)}, pacs=pacs, query=args.query,
                             algorithm=("threshold-300HU", "1") if net is None else (args.model.name, "1"))
            except WritebackError as exc:
                log.warning("series %s: not written back: %s", key[:12], exc)
                refused[key] = str(exc)
                continue
            pacs.send([seg])
            sent.append({"key": key, "frames": int(seg.NumberOfFrames), "foreground_voxels": int(mask.sum())})
            log.info("series %s: SEG of %d frame(s) sent to %s", key[:12], sent[-1]["frames"], pacs.base)
    summary = {"store": str(args.store), "validation_series": len(keys), "sent": sent, "refused": refused}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "predictions.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
