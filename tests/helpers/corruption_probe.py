"""Reads a (possibly damaged) store the way a user would, in its own process, so that the corruption matrix
(tests/storage/test_corruption.py) can check that this process exits normally, never killed by a signal.

    python tests/helpers/corruption_probe.py STORE REFERENCE.json

REFERENCE.json maps each series key to the sha256 of each of its slices (HU int16, as read from the intact
store). Prints one JSON object: the keys ``series()`` lists, ``unavailable()``, per series ``"ok"`` (every
slice as in the reference), ``"differs"`` or the error ``"ClassName: message"``, and what a loader over
every series that read ``"ok"`` gave (batches, slices and slices that differ), and over the whole store
(the same, with the error that stopped it), and which shard files this process has mapped (Linux).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from medload.data import SliceDataset, make_loader
from medload.errors import MedloadError
from medload.storage.store import open_store


def _error(exc: Exception) -> str:
    """The error's class and message (a DataLoader worker's error comes with the worker's traceback before it)."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"


def _loader(store, reference: dict[str, list[str]], keys) -> dict:
    """Every slice of the series ``keys`` (None: all) through a real loader with one worker process."""
    out = {"batches": 0, "slices": 0, "differ": 0, "error": None}
    try:
        loader = make_loader(SliceDataset(store, context=0, keys=keys), batch_size=5, num_workers=1,
                             dtype=torch.int16)
        for batch in loader:
            out["batches"] += 1
            for image, key, z in zip(batch["image"].numpy(), batch["key"], batch["z"].tolist()):
                out["slices"] += 1
                out["differ"] += hashlib.sha256(np.ascontiguousarray(image[0]).tobytes()).hexdigest() != reference[key][z]
    except MedloadError as exc:
        out["error"] = _error(exc)
    return out


def _mapped() -> list[str]:
    """The data files of shards this process maps (from /proc/self/maps; empty elsewhere)."""
    maps = Path("/proc/self/maps")
    return sorted({line.split(maxsplit=5)[-1].strip() for line in maps.read_text().splitlines()
                   if line.rstrip().endswith(".mdb")}) if maps.exists() else []


def main(store_path: str, reference_path: str) -> None:
    reference = json.loads(Path(reference_path).read_text())
    try:
        store = open_store(store_path, cache=0)
        listed = [r.key for r in store.series()]
    except MedloadError as exc:
        print(json.dumps({"open": _error(exc)}))
        return
    reads = {}
    for key, digests in reference.items():
        try:
            hu = store.read(key)
            ok = [hashlib.sha256(s.tobytes()).hexdigest() for s in hu] == digests
            reads[key] = "ok" if ok else "differs"
        except MedloadError as exc:
            reads[key] = _error(exc)
    readable = [k for k, v in reads.items() if v == "ok"]
    print(json.dumps({
        "open": None, "series": listed, "unavailable": [asdict(u) for u in store.unavailable()], "reads": reads,
        "loader": _loader(store, reference, readable) if readable else None,
        "full_loader": _loader(store, reference, None), "mapped": _mapped(),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
