"""The 3D patch section of ``medload bench`` (``--sections patches``): augmented training patches from
anisotropic oblique labelled series, as nnU-Net and MONAI users train, against their own loaders.

Data: :mod:`medload.bench.patches_data` (64 series by default: a store about 3x the 256 MB L1; the synthetic phantoms compress to about 13 MB a series). Contenders:
:mod:`medload.bench.patches_peers`. Each run -- contender, ``num_workers``, page cache mode -- is a fresh
process that sets up (until its first batch), then reads ``repeats`` passes of ``warmup`` batches and up
to ``batches`` timed ones (or ``max_pass_s``). ``warm``: the contender's files are read once before the
run; ``cold``: every contender's files are dropped from the page cache before each pass
(:func:`~medload.bench.common.evict_page_cache`, as in the scale section).

Reported per run: patches/s (median of the passes, min-max), MB read from disk per timed patch
(``/proc/<pid>/io`` of the process tree), MB decoded per patch (:func:`decoded_mb`: what the contender's
format makes it decode for one patch), peak PSS of the process tree, and medload's ratio to the fastest
peer at the same workers and mode. With ``settings.train`` (the GPU variant, or a CPU check of it), each
contender also feeds a MONAI ``DynUNet`` (:mod:`medload.bench.patches_train`) and the rows report
samples/s and % of the resident-batch ceiling.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from medload.bench.common import (
    data_files,
    error_text,
    evict_page_cache,
    loader_row,
    peak_pss,
    read_files,
    tree_read_bytes,
)
from medload.bench.patches_data import PatchPrep, PatchSettings, prepare_patches
from medload.bench.peers import PeerUnavailable

__all__ = ["run_patches", "run_child", "decoded_mb"]


def _settings(d: dict) -> PatchSettings:
    d = dict(d)
    return PatchSettings(**{**d, "patch": tuple(d["patch"]), "workers": tuple(d["workers"]),
                            "modes": tuple(d["modes"]), "contenders": tuple(d["contenders"])})


# ---- one run, in its own process ------------------------------------------------------------------------
def run_child(name: str, prep: PatchPrep, settings: PatchSettings, workers: int, device: str, cold: bool,
              train: bool) -> dict:
    """Contender ``name``'s passes (see the module docstring): seconds, patches and disk bytes per pass;
    with ``train``, a training step of the DynUNet on each batch."""
    from medload.bench.patches_peers import patch_batches
    from medload.bench.patches_train import Trainer

    files = data_files(prep.files()) if cold else []
    per_pass = settings.warmup + settings.batches
    samples = (settings.repeats * per_pass + 4) * settings.batch_size * 2
    trainer = Trainer(settings, device) if train else None
    t0 = time.perf_counter()
    batches = (trainer.resident() if trainer is not None and name == "resident" else
               patch_batches(name, prep, settings, workers, device, samples))
    step = trainer.step if trainer is not None else _check
    step(*next(batches))
    setup = time.perf_counter() - t0
    seconds, patches, disk = [], [], []
    for _ in range(settings.repeats):
        if cold:
            evict_page_cache(files)
        for _ in range(settings.warmup):
            step(*next(batches))
        timed, t0, read0 = 0, time.perf_counter(), tree_read_bytes()
        while timed < settings.batches and (timed == 0 or time.perf_counter() - t0 < settings.max_pass_s):
            step(*next(batches))
            timed += 1
        seconds.append(time.perf_counter() - t0)
        patches.append(timed * settings.batch_size)
        disk.append(tree_read_bytes() - read0)
    getattr(batches, "close", lambda: None)()
    return {"setup_s": setup, "seconds": seconds, "patches": patches, "disk_bytes": disk}


def _check(image, label) -> None:
    if image.ndim != 5 or image.shape[0] == 0 or image.shape[2:] != label.shape[2:]:
        raise RuntimeError(f"a batch of image {tuple(image.shape)} and label {tuple(label.shape)}: "
                           "expected (B, 1, D, H, W) each")


def _child(spec_json: str) -> None:
    spec = json.loads(spec_json)
    out = Path(spec.pop("out"))
    try:
        result = run_child(spec["name"], PatchPrep.load(Path(spec["prep"])), _settings(spec["settings"]),
                           spec["workers"], spec["device"], spec["cold"], spec["train"])
    except PeerUnavailable as exc:
        result = {"skipped": str(exc)}
    except Exception as exc:  # reported as a failed row, with its message
        result = {"error": error_text(exc)}
    out.write_text(json.dumps(result))


# ---- what a patch makes each contender decode -------------------------------------------------------------
def decoded_mb(prep: PatchPrep, settings: PatchSettings, draws: int = 64) -> dict[str, float | None]:
    """MB each contender decodes per patch, from its format: medload, the whole stored slices (image int16
    and label uint8) the patch's box reaches, over ``draws`` drawn patches; nnU-Net, the blosc2 chunks
    (data and segmentation) a box of its initial patch overlaps, expected over positions; MONAI's
    PersistentDataset, a whole cached volume (``torch.load`` of it); CacheDataset, nothing (volumes in RAM)."""
    from medload.data import PatchDataset
    from medload.data.patch_geometry import source_box, voxel_to_voxel
    from medload.storage.store import open_store

    store = open_store(prep.store, cache=0)
    ds = PatchDataset(store, settings.patch, (settings.spacing,) * 3, "RAS", foreground=settings.foreground,
                      samples_per_epoch=draws, seed=0, labels=True)
    total = 0
    for i in range(draws):
        rec = ds.records[ds.draw(i).series]
        box = source_box(voxel_to_voxel(ds.item_affine(i), rec.affine), settings.patch, rec.shape)
        if box is not None:
            total += int(box[1][0] - box[0][0]) * rec.shape[1] * rec.shape[2] * 3
    store.close()
    persistent = [p.stat().st_size for p in Path(prep.persistent).glob("*.pt")]
    return {"medload": total / draws / 1e6, "nnunet": _nnunet_chunks_mb(prep, settings), "monai_cache": 0.0,
            "monai_persistent": float(np.mean(persistent)) / 1e6 if persistent else None}


def _nnunet_chunks_mb(prep: PatchPrep, settings: PatchSettings) -> float | None:
    if prep.nnunet is None:
        return None
    import blosc2

    from medload.bench.patches_peers import nnunet_initial_patch

    initial = nnunet_initial_patch(settings)
    sizes = []
    for path in sorted(Path(prep.nnunet).glob("*.b2nd")):
        arr = blosc2.open(str(path), mode="r")
        chunks, shape = arr.chunks[1:], arr.shape[1:]
        # a box of n voxels at a uniform offset overlaps about ceil((n - 1) / c) + 1 chunks of c along an axis
        count = np.prod([min(-(-s // c), (min(n, s) - 1) // c + 1 + ((min(n, s) - 1) % c != 0))
                         for n, c, s in zip(initial, chunks, shape)])
        sizes.append(float(count) * int(np.prod(chunks)) * arr.dtype.itemsize)
    return sum(sizes) / max(1, len(sizes) // 2) / 1e6  # data and seg files of each case


# ---- the section ----------------------------------------------------------------------------------------
def _run_one(prep: PatchPrep, prep_path: Path, name: str, workers: int, mode: str, settings: PatchSettings,
             device: str, log_dir: Path, train: bool) -> dict:
    tag = f"{name}-w{workers}-{mode}{'-train' if train else ''}"
    out, log = log_dir / f"{tag}.json", log_dir / f"{tag}.log"
    spec = {"name": name, "prep": str(prep_path), "out": str(out), "settings": asdict(settings), "workers": workers,
            "device": device, "cold": mode == "cold", "train": train}
    if mode == "warm":
        read_files(data_files(prep.files()))
    with open(log, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from medload.bench.patches import _child; "
                                 "_child(sys.argv[1])", json.dumps(spec)], stdout=logf, stderr=subprocess.STDOUT)
        with peak_pss(proc.pid) as peak:
            try:
                proc.wait(timeout=settings.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if out.exists():
        result = json.loads(out.read_text())
    else:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        result = {"error": f"exit status {proc.returncode}: {' | '.join(tail)}"}
    result["peak_pss_mb"] = peak.mb
    return result


def _ratios(rows: list[dict]) -> None:
    """medload's ratio to the fastest peer at the same workers and mode; each training row's % of the
    resident-batch ceiling."""
    ceiling = next((r["patches_per_s"] for r in rows if r["contender"] == "resident" and r.get("patches_per_s")), None)
    for r in rows:
        if r["train"] and ceiling and r.get("patches_per_s") and r["contender"] != "resident":
            r["pct_of_ceiling"] = 100.0 * r["patches_per_s"] / ceiling
        if r["contender"] != "medload" or r.get("patches_per_s") is None:
            continue
        peers = [p for p in rows if p["contender"] not in ("medload", "resident") and p.get("patches_per_s")
                 and (p["mode"], p["num_workers"], p["train"]) == (r["mode"], r["num_workers"], r["train"])]
        if peers:
            best = max(peers, key=lambda p: p["patches_per_s"])
            r["best_peer"], r["x_best_peer"] = best["contender"], r["patches_per_s"] / best["patches_per_s"]


def run_patches(root: Path, work: Path, settings: PatchSettings = PatchSettings(), *, key_file: Path,
                device: str = "cpu", progress: bool = True) -> dict:
    """The section: prepare the data under ``root`` (or reuse them), run every contender at every workers
    count and page cache mode (and, with ``settings.train``, the training rows), return every figure."""
    from medload.bench.common import tree_bytes
    from medload.bench.peers import L1_BUDGET
    from medload.config import parse_size
    from medload.progress import progress_bar

    prep = prepare_patches(root, settings, key_file=key_file, progress=progress)
    work = Path(work)
    log_dir = work / "logs-patches"
    log_dir.mkdir(parents=True, exist_ok=True)
    prep_path = work / "prepared-patches.json"
    prep.save(prep_path)
    decoded = decoded_mb(prep, settings)
    plan = [(n, w, m, False) for m in settings.modes for w in settings.workers for n in settings.contenders]
    if settings.train:
        train_workers = max(settings.workers)
        plan += [("resident", 0, "warm", True)] + [(n, train_workers, "warm", True) for n in settings.contenders]
    rows = []
    with progress_bar("3D patches", len(plan), enabled=progress) as advance:
        for name, w, mode, train in plan:
            res = _run_one(prep, prep_path, name, w, mode, settings, device, log_dir, train)
            rows.append(loader_row(name, w, mode, res, "patches", "mb_read_per_patch", train=train,
                                  decoded_mb=decoded.get(name)))
            advance(1)
    _ratios(rows)
    store_bytes = tree_bytes(prep.store)
    return {"status": "ok", "root": prep.root, "series": settings.series, "slices": settings.slices, "size": settings.size,
            "patch": list(settings.patch), "spacing": settings.spacing, "foreground": settings.foreground,
            "batch_size": settings.batch_size, "warmup": settings.warmup, "batches": settings.batches,
            "repeats": settings.repeats, "device": device, "l1": L1_BUDGET.replace("MB", " MB"),
            "store_gb": store_bytes / 1e9, "x_l1": store_bytes / parse_size(L1_BUDGET),
            "data_gb": {"store": store_bytes / 1e9, "nifti": tree_bytes(Path(prep.root) / "nifti") / 1e9,
                        "nnunet": tree_bytes(prep.nnunet) / 1e9 if prep.nnunet else 0.0,
                        "monai_persistent": tree_bytes(prep.persistent) / 1e9},
            "rows": rows}

