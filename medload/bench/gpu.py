"""The GPU section of ``medload bench``: does the input pipeline keep a fast GPU busy on what users train?

The model is a standard one: MONAI's 2D ``UNet`` (channels 32-512, strides of 2, 2 residual units), 3
input channels (2.5D stacks), Dice loss with a sigmoid, Adam, under bf16 autocast; batches of 16 x 3 x
512 x 512 windowed to soft tissue; the target is "HU above the window" of the centre slice.

- **Ceiling**: the same model and step on a batch already resident on the GPU: samples/s with no
  input pipeline at all, the faster of a measurement before and one after the runs. Every row is
  given as a share of it, measured in the same process.
- **Runs**: each contender (:mod:`medload.bench.gpu_peers`) at its ``num_workers`` (medload at 4 and
  ``"auto"``) with the page cache warm (every data file read first) or cold (their pages dropped, as
  in the scale section: :func:`~medload.bench.common.evict_page_cache`): ``warmup`` steps, then
  ``steps`` timed ones (60 by default).
- **Per run**: samples/s and % of the ceiling; GPU busy = the CUDA-event time of the training steps
  over the CUDA-event span from the first step's start to the last one's end (the rest is the GPU
  idling for input); NVML's utilisation where ``pynvml`` is importable; the training thread's wall and
  CPU time inside ``next()`` per batch; medload's ratio to the best peer in the same page-cache mode.

:func:`measure` also runs on the CPU at any size (host clocks instead of CUDA events, CPU autocast), so
its code path is tested on machines without a GPU. The section runs in a fresh process
(:func:`main`); its data are written by :func:`gpu_data`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from medload.bench.loading_data import Prepared

__all__ = ["GpuSettings", "measure", "plan", "gpu_data", "main"]


@dataclass(frozen=True)
class GpuSettings:
    """Sizes of the GPU section (the defaults are the section's; a test shrinks them)."""

    batch_size: int = 16
    steps: int = 60
    warmup: int = 8
    workers: tuple[int | str, ...] = (4, "auto")
    peer_workers: int = 4
    modes: tuple[str, ...] = ("warm", "cold")
    channels: tuple[int, ...] = (32, 64, 128, 256, 512)
    res_units: int = 2
    contenders: tuple[str, ...] = ("medload", "medload_augment", "monai_cache_dataset", "monai_gpu_cache",
                                   "pydicom_files")

    @property
    def samples(self) -> int:
        return (self.warmup + self.steps) * self.batch_size


def plan(s: GpuSettings) -> list[tuple[str, int | str, str]]:
    """The runs ``(contender, num_workers, page cache mode)``: medload at every ``workers`` and mode; with
    BatchAugment at the first, warm; MONAI's caches warm (they read everything before timing); MONAI's
    GPU cache without workers, as its recipe has it; pydicom at ``peer_workers`` in every mode."""
    runs: list[tuple[str, int | str, str]] = []
    for name in s.contenders:
        if name == "medload":
            runs += [(name, w, m) for m in s.modes for w in s.workers]
        elif name == "medload_augment":
            runs.append((name, s.workers[0], "warm"))
        elif name == "monai_cache_dataset":
            runs.append((name, s.peer_workers, "warm"))
        elif name == "monai_gpu_cache":
            runs.append((name, 0, "warm"))
        else:
            runs += [(name, s.peer_workers, m) for m in s.modes]
    return runs


def gpu_data(root: Path, *, series: int, slices: int, size: int, samples: int, key_file: Path) -> Prepared:
    """``series`` synthetic CT series of ``slices`` slices of ``size`` x ``size`` as DICOM folders and a
    medload store under ``root``, and ``samples`` random 2.5D samples."""
    from medload.bench.loading_data import make_synthetic, prepare_from

    generated = make_synthetic(root / "dicom", series=series, slices=slices, rows=size, cols=size)
    return prepare_from(root / "data", [root / "dicom"], samples=samples, kind="2.5d", generated=generated,
                        u8=False, npy=False, key_file=key_file)


class _Clock:
    """CUDA events on a GPU, the host clock elsewhere; ``ms(a, b)`` after :meth:`sync`."""

    def __init__(self, device) -> None:
        import torch

        self.torch, self.cuda, self.device = torch, device.type == "cuda", device

    def mark(self):
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class _Nvml:
    """Mean GPU utilisation NVML reports while the block runs, sampled every 50 ms (None without pynvml)."""

    def __init__(self, device) -> None:
        self.samples: list[int] = []
        self.handle, self._stop = None, threading.Event()
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception:  # pynvml missing, or no NVML: the CUDA events still measure busy time
            self.handle = None

    def __enter__(self) -> _Nvml:
        if self.handle is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.handle is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) / 100 if self.samples else None


class _Trainer:
    """The model, its optimiser and one training step."""

    def __init__(self, s: GpuSettings, depth: int, device) -> None:
        import torch
        from monai.losses import DiceLoss
        from monai.networks.nets import UNet

        torch.manual_seed(0)
        torch.backends.cudnn.benchmark = True
        self.torch, self.device, self.centre = torch, device, depth // 2
        self.model = UNet(spatial_dims=2, in_channels=depth, out_channels=1, channels=s.channels,
                          strides=(2,) * (len(s.channels) - 1), num_res_units=s.res_units).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.loss = DiceLoss(sigmoid=True)

    def step(self, image) -> None:
        torch = self.torch
        target = (image[:, self.centre : self.centre + 1] >= 1.0).float()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(image)
        loss = self.loss(logits.float(), target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def _forever(batches):
    """Batches for ever: a new epoch whenever one ends."""
    while True:
        empty = True
        for b in batches:
            empty = False
            yield b
        if empty:
            raise ValueError("the contender gave no full batch: prepare more samples")


def _timed(batches, trainer: _Trainer, s: GpuSettings, clock: _Clock) -> dict:
    """``warmup`` steps, then ``steps`` timed ones, fed from ``batches``."""
    it = _forever(batches)
    for _ in range(s.warmup):
        trainer.step(next(it))
    clock.sync()
    spans, in_next, in_next_cpu = [], 0.0, 0.0
    with _Nvml(clock.device) as nvml:
        wall0 = time.perf_counter()
        for _ in range(s.steps):
            t, c = time.perf_counter(), time.thread_time()
            image = next(it)
            in_next += time.perf_counter() - t
            in_next_cpu += time.thread_time() - c
            a = clock.mark()
            trainer.step(image)
            spans.append((a, clock.mark()))
            del image
        clock.sync()
        wall = time.perf_counter() - wall0
    it.close()
    busy = sum(clock.ms(a, b) for a, b in spans)
    return {"samples_per_s": s.steps * s.batch_size / wall, "step_ms": busy / s.steps,
            "gpu_busy": busy / clock.ms(spans[0][0], spans[-1][1]), "nvml_util": nvml.mean,
            "next_ms": 1e3 * in_next / s.steps, "next_cpu_ms": 1e3 * in_next_cpu / s.steps}


def _ceiling(trainer: _Trainer, prep: Prepared, s: GpuSettings, clock: _Clock) -> dict:
    """The same steps on one batch resident on the device (values in 0..1, as windowed batches are)."""
    torch = trainer.torch
    batch = torch.rand((s.batch_size, *prep.sample_shape), generator=torch.Generator().manual_seed(0)).to(clock.device)
    out = _timed([batch], trainer, s, clock)
    return {k: out[k] for k in ("samples_per_s", "step_ms", "gpu_busy")}


def _page_cache(prep: Prepared, mode: str) -> None:
    from medload.bench.common import data_files, evict_page_cache
    from medload.bench.loading_data import warm_page_cache

    if mode == "warm":
        warm_page_cache(prep)
    else:
        os.sync()
        evict_page_cache(data_files([prep.store] + [x.dicom_dir for x in prep.series if x.dicom_dir]))


def _run(prep: Prepared, name: str, workers: int | str, mode: str, trainer: _Trainer, s: GpuSettings,
         clock: _Clock) -> dict:
    from medload.bench.gpu_peers import GPU_CONTENDERS
    from medload.bench.peers import PeerUnavailable
    from medload.storage.cache.lru import shared_lru

    row: dict[str, Any] = {"contender": name, "num_workers": workers, "mode": mode}
    try:
        shared_lru(0).clear()  # no slice read by an earlier run (or "auto"'s trial) in this process's L1
        _page_cache(prep, mode)
        batches = GPU_CONTENDERS[name](prep, s.batch_size, workers, str(clock.device))
        tuning = getattr(getattr(batches, "loader", None), "tuning", None)
        if tuning is not None:
            row["chose"] = tuning.num_workers
        row.update(_timed(batches, trainer, s, clock), status="ok")
        del batches
    except PeerUnavailable as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # kept, with its message
        row.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    return row


def _ratios(rows: list[dict], ceiling: float) -> None:
    from medload.bench.gpu_peers import PEERS

    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        r["pct_of_ceiling"] = 100 * r["samples_per_s"] / ceiling
    for r in ok:
        if r["contender"] in PEERS:
            continue
        peers = [p for p in ok if p["contender"] in PEERS and p["mode"] == r["mode"]]
        if peers:
            best = max(peers, key=lambda p: p["samples_per_s"])
            r["best_peer"], r["x_best_peer"] = best["contender"], r["samples_per_s"] / best["samples_per_s"]


def measure(prep: Prepared, device: str = "cuda", settings: GpuSettings | None = None) -> dict:
    """Every run of :func:`plan` and the ceiling on ``prep`` (2.5D), as the section's dict."""
    import torch

    s = settings or GpuSettings()
    dev = torch.device(device)
    clock = _Clock(dev)
    trainer = _Trainer(s, prep.depth, dev)
    first = _ceiling(trainer, prep, s, clock)
    rows = [_run(prep, name, w, mode, trainer, s, clock) for name, w, mode in plan(s)]
    ceiling = max(first, _ceiling(trainer, prep, s, clock), key=lambda c: c["samples_per_s"])
    _ratios(rows, ceiling["samples_per_s"])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    return {"status": "ok", "device": str(dev), "device_name": name, "settings": asdict(s),
            "sample_shape": list(prep.sample_shape), "series": len(prep.series),
            "model": f"MONAI UNet 2D, channels {'-'.join(map(str, s.channels))}, {s.res_units} residual units, "
                     "bf16 autocast", "ceiling": ceiling, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    """``python -m medload.bench.gpu --child SPEC``: :func:`measure` in this process, JSON to ``out``."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[1])
    out = Path(spec.pop("out"))
    prep = Prepared.load(Path(spec.pop("prep")))
    raw = spec.pop("settings", {})
    given: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}  # JSON lists
    settings = GpuSettings(**given)
    try:
        result = measure(prep, spec["device"], settings)
    except Exception as exc:  # reported, never a crash of the suite
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
