"""Shared fixtures: real data locations, a pseudonymisation key per test session, ingest helpers."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from medload.config import IngestConfig
from medload.ingest.discover import SourceRef
from medload.ingest.headers import SliceHeader
from medload.ingest.run import ingest
from medload.storage.store import Store, open_store

REPO = Path(__file__).resolve().parents[1]
AXIAL = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
PIXEL_SPACING = (0.7, 0.8)  # (row spacing, column spacing), as in PixelSpacing (0028,0030)
DATA = REPO / "tests" / "scans"
PHILIPS = REPO / "sample_data" / "philips_ct_head"
#: Devices for tests of code that runs on the training device: always the CPU, and CUDA where a GPU is.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device: runs on machines with a GPU"))]


@pytest.fixture(autouse=True, scope="session")
def _key_file(tmp_path_factory) -> Path:
    """Every test uses one throw-away pseudonymisation key, never the user's real one."""
    path = write_key(tmp_path_factory.mktemp("key") / "pseudonym.key",
                     "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff")
    os.environ["MEDLOAD_KEY_FILE"] = str(path)
    return path


def write_key(path: Path, digits: str) -> Path:
    """A pseudonymisation key file as medload accepts one: hex digits, readable by its owner alone (0600)."""
    path.write_text(digits + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def run_ingest(tmp_path):
    """``run_ingest(sources, **config) -> (report, store)`` into a fresh store under tmp_path."""
    counter = iter(range(1000))

    def _run(sources, store_path: Path | None = None, **config) -> tuple:
        store_path = store_path or tmp_path / f"store{next(counter)}"
        config.setdefault("workers", 1)
        report = ingest(sources, store_path, config=IngestConfig(**config))
        return report, open_store(store_path)

    return _run


def store_dump(store: Store) -> list[tuple[bytes, bytes, bytes]]:
    """Sorted (sub-database, key, value) of every record of every shard: the logical content of a store,
    independent of shard names and grouping."""
    from medload.storage.manifest import shard_path
    from medload.storage.shard import reader_env

    out = []
    for entry in store.manifest.shards:
        env = reader_env(shard_path(store.path, entry.name))
        with env.begin() as txn:
            names = [bytes(k) for k in txn.cursor().iternext(values=False)]
            for name in names:
                db = env.open_db(name, txn=txn, create=False)
                out.extend((name, bytes(k), bytes(v)) for k, v in txn.cursor(db=db))
    return sorted(out)


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under a store (relative path -> hex), except the writer's lock file."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "writer.lock"}


def slice_header(position, orientation=AXIAL, *, name: str = "slice.dcm", instance: str = "1.2.3", frame=None,
           pixel_spacing=PIXEL_SPACING, slice_thickness: float | None = None,
           spacing_between_slices: float | None = None) -> SliceHeader:
    """A plausible CT slice header at ``position`` (LPS mm); only geometry fields matter here."""
    return SliceHeader(
        ref=SourceRef(path=f"/data/{name}", member=None, size=1000),
        frame=frame, sop_class="1.2.840.10008.5.1.4.1.1.2", instance=instance, series="series", frame_of_reference="for",
        study="study",
        patient="patient", modality="CT", image_type=("ORIGINAL", "PRIMARY", "AXIAL"), rows=4, cols=5,
        samples_per_pixel=1, photometric="MONOCHROME2", bits_allocated=16, bits_stored=12, high_bit=11,
        pixel_representation=0, slope=1.0, intercept=-1024.0, has_rescale=True, padding_value=None,
        padding_limit=None, orientation=tuple(float(v) for v in orientation),
        position=tuple(float(v) for v in position), pixel_spacing=tuple(float(v) for v in pixel_spacing),
        slice_thickness=slice_thickness, spacing_between_slices=spacing_between_slices,
        transfer_syntax="1.2.840.10008.1.2.1", pixel_offset=0, number_of_frames=1, echo="", stack="",
        file_size=1000,
    )


def flip_stored_value(shard: Path, key: bytes, db: bytes = b"slices") -> int:
    """Flip one bit in the middle of the value of ``key`` in sub-database ``db`` of a shard directory,
    in every copy of it in ``data.mdb`` (LMDB may keep stale copies of a page); returns the copies."""
    from medload.storage.shard import reader_env

    env = reader_env(shard)  # this process's handle: a Store or verify may have opened the shard already
    with env.begin() as txn:
        value = bytes(txn.get(key, db=env.open_db(db, txn=txn, create=False)))
    data = bytearray((shard / "data.mdb").read_bytes())
    hits, at = 0, data.find(value)
    while at >= 0:
        data[at + len(value) // 2] ^= 0x40
        hits, at = hits + 1, data.find(value, at + 1)
    (shard / "data.mdb").write_bytes(bytes(data))
    return hits


#: Modules whose tests take more than ~3.5 s together on 2 cores (pytest --durations, 2026-12-03): ``make
#: test-fast`` leaves them out with the other tiers (pyproject.toml markers); ``make test`` runs them all.
SLOW_MODULES = frozenset({
    "test_value_reads.py", "test_ingest_synthetic.py", "test_explore.py", "test_bad_input.py", "test_tiers.py",
    "test_autotune.py", "test_repair.py", "test_packaging.py", "test_cli.py", "test_enospc.py",
    "test_cli_errors.py", "test_crash.py", "test_compact.py", "test_nnunet_export.py", "test_corruption.py",
    "test_bench_run.py", "test_config_names.py", "test_profile.py", "test_distributed.py", "test_verify.py",
    "test_datasets.py", "test_read_path.py", "test_privacy.py", "test_pipeline.py", "test_docs_examples.py",
    "test_resume.py", "test_lightning_resume.py", "test_bench_patches.py", "test_lineage.py", "test_pipeline_patches.py",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
