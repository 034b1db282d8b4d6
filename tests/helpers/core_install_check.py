"""Run by tests/project/test_packaging.py inside a core-only virtual environment: ``python core_install_check.py
STORE MODULE...``. Ingests the sample into STORE, reads a training batch, checks that no MODULE (each
brought by an extra) is installed, and that the features needing them name their extra."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import medload
from medload.data import SliceDataset, make_loader
from medload.extras import MissingExtraError
from medload.ingest import ingest

SAMPLE = Path(__file__).resolve().parents[2] / "sample_data" / "philips_ct_head" / "dicom"


def main(store_path: str, *optional: str) -> None:
    present = [m for m in optional if importlib.util.find_spec(m) is not None]
    if present:
        raise SystemExit(f"a core install holds modules of the extras: {present}")
    report = ingest(SAMPLE, store_path)
    store = medload.open_store(store_path)
    batch = next(iter(make_loader(SliceDataset(store, context=1), batch_size=2, window="brain")))
    if tuple(batch["image"].shape[:2]) != (2, 3) or not report.series:
        raise SystemExit(f"unexpected batch {tuple(batch['image'].shape)} or report {report}")
    for call, extra in ((store.catalog, "viz"), (lambda: importlib.import_module("medload.pacs.dimse"), "pacs"),
                        (lambda: importlib.import_module("medload.bench"), "bench")):
        try:
            call()
        except MissingExtraError as exc:
            if f"medload[{extra}]" not in str(exc):
                raise SystemExit(f"the error does not name [{extra}]: {exc}") from None
        else:
            raise SystemExit(f"{call} ran without the [{extra}] extra")
    print("core install ok:", medload.__version__)


if __name__ == "__main__":
    main(*sys.argv[1:])
