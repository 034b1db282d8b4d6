"""One rank of a torchrun job over a store, for tests/data/test_resume.py's elastic resume: ``first`` runs
``--steps`` batches of epoch 1 and rank 0 saves the loader state; ``rest`` restores that state on however
many ranks this job has and runs the rest of epoch 1 and all of epoch 2. Each rank writes, per epoch, the
samples it trained on and the padding repeats of its order (``rank<R>.json`` in the output folder)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from medload.data import DistributedPatientSampler, SliceDataset, make_loader
from medload.storage.store import open_store

SEED, BATCH = 5, 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["first", "rest"])
    parser.add_argument("store")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = SliceDataset(open_store(args.store))
    sampler = DistributedPatientSampler.from_dataset(ds, seed=SEED)  # rank and world size: the process group's
    loader = make_loader(ds, BATCH, 0, sampler=sampler)
    state_path = args.out / "state.json"
    report: dict[str, dict] = {}
    if args.phase == "first":
        loader.set_epoch(1)
        batches = iter(loader)
        report["1"] = {"samples": [i for _ in range(args.steps) for i in next(batches)["index"].tolist()]}
        dist.barrier()  # every rank stepped alike; rank 0's state names them all
        if rank == 0:
            state_path.write_text(json.dumps(loader.state_dict()))
    else:
        loader.load_state_dict(json.loads(state_path.read_text()))
        for epoch in (1, 2):
            loader.set_epoch(epoch)
            samples = [i for batch in loader for i in batch["index"].tolist()]
            report[str(epoch)] = {"samples": samples,
                                  "padding": [i for i, pad in zip(sampler, sampler.padding.tolist()) if pad]}
    (args.out / f"{args.phase}-rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
