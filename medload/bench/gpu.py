"""The GPU section of ``medload bench`` (runs only where ``torch.cuda.is_available()``).

Three measures, in a fresh process, on the 2.5D benchmark data with the medload loader
(``num_workers`` workers, 256 MB L1, soft-tissue window applied on the GPU):

- **H2D bandwidth**, pageable vs pinned host memory: ``tensor.to(device)`` of a 64 MB buffer, timed
  with CUDA events (the loader stages every batch through pinned buffers).
- **GPU utilisation during training**: a MONAI 2D UNet (3 input channels) trained with Dice loss on
  "HU above the window" as the target; CUDA events time each step on the GPU, the host clock the time
  spent waiting for the next batch; utilisation = GPU busy time / wall time of the timed steps.
- **samples/s with** :class:`medload.data.BatchAugment` on the device (flips, one affine, intensity,
  noise) against the same loader without augmentation, in the same run.

:func:`measure` also runs on the CPU (host clocks instead of CUDA events, no H2D) so its code path is
tested on machines without a GPU.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from medload.bench.loading_data import Prepared
from medload.bench.peers import L1_BUDGET, WINDOW

__all__ = ["measure", "main"]


def _loader(prep: Prepared, batch_size: int, num_workers: int, device, augment=None):
    from medload.data import SliceDataset, make_loader
    from medload.storage.store import open_store

    ds = SliceDataset(open_store(prep.store, cache=L1_BUDGET), context=prep.depth // 2, labels=False,
                      keys=[s.key for s in prep.series])
    position = {(ds.index.keys[s], int(z)): i for i, (s, z) in enumerate(zip(ds.index.series, ds.index.z))}
    order = [position[(prep.series[s].key, int(z) + prep.depth // 2)] for s, z in zip(prep.series_index, prep.z0)]
    return make_loader(ds, batch_size=batch_size, num_workers=num_workers, device=device, shuffle=False,
                       sampler=order, window=WINDOW.name, augment=augment, drop_last=True)


def _batches(loader):
    """Batches for ever: a new epoch whenever one ends."""
    if len(loader) == 0:
        raise ValueError("the loader has no full batch: prepare more samples")
    while True:
        yield from loader


class _Clock:
    """CUDA events on a GPU, the host clock elsewhere; ``ms(a, b)`` after :meth:`sync`."""

    def __init__(self, device) -> None:
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"
        self.device = device

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


def _h2d(device, clock: _Clock, nbytes: int = 64 << 20, copies: int = 20) -> list[dict]:
    import torch

    out = []
    for pinned in (False, True):
        host = torch.empty(nbytes, dtype=torch.uint8)
        if pinned:
            host = host.pin_memory()
        host.to(device)  # warm-up
        clock.sync()
        a = clock.mark()
        for _ in range(copies):
            host.to(device, non_blocking=pinned)
        b = clock.mark()
        clock.sync()
        gbps = nbytes * copies / (clock.ms(a, b) / 1e3) / 1e9
        out.append({"name": f"H2D bandwidth, {'pinned' if pinned else 'pageable'} host memory", "value": gbps,
                    "unit": "GB/s", "text": f"{gbps:.1f} GB/s"})
    return out


def _train(prep: Prepared, device, clock: _Clock, *, batch_size: int, num_workers: int, warmup: int,
           steps: int) -> list[dict]:
    import torch
    from monai.losses import DiceLoss
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    model = UNet(spatial_dims=2, in_channels=prep.depth, out_channels=1, channels=(16, 32, 64, 128),
                 strides=(2, 2, 2), num_res_units=1).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = DiceLoss(sigmoid=True)
    batches = _batches(_loader(prep, batch_size, num_workers, device))
    waits, marks = [], []
    for n in range(warmup + steps):
        if n == warmup:
            clock.sync()
            wall0 = time.perf_counter()
        t0 = time.perf_counter()
        image = next(batches)["image"]
        wait = time.perf_counter() - t0
        a = clock.mark()
        target = (image[:, prep.depth // 2 : prep.depth // 2 + 1] >= 1.0).float()
        loss = loss_fn(model(image), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        b = clock.mark()
        if n >= warmup:
            waits.append(wait)
            marks.append((a, b))
    clock.sync()
    wall = time.perf_counter() - wall0
    batches.close()
    busy = sum(clock.ms(a, b) for a, b in marks) / 1e3
    per_step = busy / steps * 1e3
    wait_ms = sum(waits) / steps * 1e3
    return [
        {"name": "training step on the GPU (UNet 2D, Dice), mean", "value": per_step, "unit": "ms",
         "text": f"{per_step:.1f} ms"},
        {"name": "host waiting for the next batch, mean per step", "value": wait_ms, "unit": "ms",
         "text": f"{wait_ms:.1f} ms"},
        {"name": "GPU utilisation (busy / wall, timed steps)", "value": busy / wall, "unit": "fraction",
         "text": f"{100 * busy / wall:.0f}% over {steps} steps ({steps * batch_size / wall:.0f} samples/s)"},
    ]


def _augment_rate(prep: Prepared, device, clock: _Clock, *, batch_size: int, num_workers: int, warmup: int,
                  steps: int) -> list[dict]:
    from medload.data import BatchAugment

    out, rates = [], {}
    for name, augment in (("without augmentation", None), ("with BatchAugment", BatchAugment(device=device, seed=0))):
        batches = _batches(_loader(prep, batch_size, num_workers, device, augment=augment))
        for n in range(warmup + steps):
            if n == warmup:
                clock.sync()
                t0 = time.perf_counter()
            next(batches)["image"]
        clock.sync()
        rates[name] = steps * batch_size / (time.perf_counter() - t0)
        batches.close()
        out.append({"name": f"samples/s on the device, {name}", "value": rates[name], "unit": "samples/s",
                    "text": f"{rates[name]:.0f}"})
    ratio = rates["with BatchAugment"] / rates["without augmentation"]
    out.append({"name": "BatchAugment throughput / plain loader", "value": ratio, "unit": "x", "text": f"{ratio:.2f}x"})
    return out


def measure(prep: Prepared, device: str = "cuda", *, batch_size: int = 8, num_workers: int = 2, warmup: int = 3,
            steps: int = 20) -> dict:
    """Every GPU measure on ``prep`` (2.5D) as ``{"measures": [{"name", "value", "unit", "text", ...}]}``;
    a measure that fails is kept with ``status="failed"`` and its error."""
    import torch

    dev = torch.device(device)
    clock = _Clock(dev)
    measures: list[dict] = []
    parts = [("H2D bandwidth", lambda: _h2d(dev, clock) if dev.type == "cuda" else [
        {"name": "H2D bandwidth", "status": "skipped", "text": "skipped: needs a CUDA device"}])]
    parts.append(("training step", lambda: _train(prep, dev, clock, batch_size=batch_size, num_workers=num_workers,
                                                  warmup=warmup, steps=steps)))
    parts.append(("BatchAugment", lambda: _augment_rate(prep, dev, clock, batch_size=batch_size,
                                                        num_workers=num_workers, warmup=warmup, steps=steps)))
    for name, run in parts:
        try:
            measures += run()
        except Exception as exc:  # kept, with its message
            measures.append({"name": name, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                             "text": f"failed: {type(exc).__name__}: {exc}"})
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    return {"status": "ok", "device": str(dev), "device_name": name, "batch_size": batch_size,
            "num_workers": num_workers, "warmup": warmup, "steps": steps, "measures": measures}


def main(argv: list[str] | None = None) -> None:
    """``python -m medload.bench.gpu --child SPEC``: :func:`measure` in this process, JSON to ``out``."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[1])
    out = Path(spec.pop("out"))
    prep = Prepared.load(Path(spec.pop("prep")))
    try:
        result = measure(prep, **spec)
    except Exception as exc:  # reported, never a crash of the suite
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
