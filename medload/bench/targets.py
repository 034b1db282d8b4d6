"""The targets a ``medload bench`` run is held to, each read from the run's own rows: memory, loading speed
(data that fit in the L1), and loading at scale (a store far larger than the L1, page cache warm and
cold). A target whose row is missing has ``met`` None; a run on a busy machine says so
(:func:`~medload.bench.common.load_note`), since a NO may then be the load's doing.
"""

from __future__ import annotations

from medload.bench.ingest_scaling import medload_row, pydicom_row

__all__ = ["INGEST_TARGETS", "ingest_targets", "PSS_TARGET_MB", "SPEED_TARGETS", "SCALE_TARGETS", "DISK_TARGET",
           "GPU_TARGETS", "PATCH_TARGETS", "PATCH_PSS_MB", "memory_targets", "speed_targets", "scale_targets",
           "gpu_targets", "patch_targets"]

PSS_TARGET_MB = 1000.0
"""The memory target of the medload loader: peak PSS <= 1 GB with 2 workers and a 256 MB L1."""

#: The loader's speed targets on 2.5D batches (8 x 3 x 512 x 512 in the full run), each read from one row
#: of the run: (contender, num_workers, field of the row, at least, what the field measures).
SPEED_TARGETS = (
    ("medload", 0, "x_npy_memmap", 2.5, "x npy memmap loader"),
    ("medload", 2, "x_npy_memmap", 3.0, "x npy memmap loader"),
    ("medload", 0, "pct_of_ceiling", 70.0, "% of ceiling_float32 (1 thread)"),
    ("medload", 2, "pct_of_ceiling", 70.0, "% of ceiling_float32 (2 threads)"),
    ("medload_int16", 0, "pct_of_ceiling", 70.0, "% of ceiling_int16 (1 thread): int16 passthrough"),
    ("medload_int16", 2, "pct_of_ceiling", 70.0, "% of ceiling_int16 (2 threads): int16 passthrough"),
)

#: At scale: (page cache mode, num_workers, at least this many times the fastest peer's samples/s)
SCALE_TARGETS = (("cold", 0, 1.5), ("cold", 2, 1.5), ("warm", 0, 1.0), ("warm", 2, 1.5))
DISK_TARGET = 1.2
"""Bytes read from disk per cold sample, at most this many times the compressed bytes of its slices."""

#: The GPU section's targets (medload.bench.gpu), each read from one row: (contender, num_workers, page cache,
#: field, bound, what it measures, at most (else at least)). The goal is a GPU kept busy: a share of the
#: resident-batch ceiling, a lead over the best peer, and under 1 ms of the training thread per batch.
GPU_TARGETS = (
    ("medload", 4, "warm", "pct_of_ceiling", 97.0, "% of the resident-batch ceiling", False),
    ("medload", 4, "cold", "pct_of_ceiling", 92.0, "% of the resident-batch ceiling", False),
    ("medload_augment", 4, "warm", "pct_of_ceiling", 92.0, "% of the resident-batch ceiling, with BatchAugment",
     False),
    ("medload", 4, "warm", "x_best_peer", 1.2, "x the best peer's samples/s", False),
    ("medload", 4, "warm", "next_ms", 1.0, "ms of the training thread in next() per batch", True),
)


def _pss(run: str, r: dict) -> dict:
    return {"run": run, "peak_pss_mb": r["peak_pss_mb"], "target_mb": PSS_TARGET_MB,
            "met": r["peak_pss_mb"] <= PSS_TARGET_MB}


def memory_targets(results: dict) -> list[dict]:
    """Peak PSS of every medload run with 2 workers (loading, scaling and scale sections)."""
    out = []
    for sec in (results.get("loading") or {}).values():
        for r in sec.get("rows", []):
            if r["contender"] in sec.get("medload", ()) and r.get("num_workers") == 2 and r["status"] == "ok":
                out.append(_pss(f"{sec['kind']} {r['contender']}, 2 workers (fits in L1)", r))
    sc = results.get("scaling") or {}
    if sc.get("num_workers") == 2:
        out += [_pss(f"scaling, {r['series']} series, 2 workers", r) for r in sc.get("rows", [])
                if r.get("status") == "ok"]
    for r in (results.get("scale") or {}).get("rows", []):
        if r["contender"] == "medload" and r["num_workers"] == 2 and r["status"] == "ok":
            out.append(_pss(f"at scale, page cache {r['mode']}, 2 workers", r))
    return out


def speed_targets(results: dict) -> list[dict]:
    """:data:`SPEED_TARGETS` against the 2.5D rows of this run."""
    sec = (results.get("loading") or {}).get("2.5d") or {}
    rows = {(r["contender"], r["num_workers"]): r for r in sec.get("rows", []) if r.get("threads") is None}
    out = []
    for name, workers, field, least, measure in SPEED_TARGETS:
        value = (rows.get((name, workers)) or {}).get(field)
        out.append({"run": f"2.5d {name}, {workers} workers, on {sec.get('device', '?')}", "field": field,
                    "measure": measure, "value": value, "target": least,
                    "met": None if value is None else value >= least})
    return out


def scale_targets(sec: dict) -> list[dict]:
    """:data:`SCALE_TARGETS` and :data:`DISK_TARGET` against the medload rows of the scale section."""
    rows = {(r["contender"], r["num_workers"], r["mode"]): r for r in sec.get("rows", [])}
    out = []
    for mode, workers, least in SCALE_TARGETS:
        r = rows.get(("medload", workers, mode)) or {}
        value = r.get("x_best_peer")
        out.append({"run": f"at scale, page cache {mode}, {workers} workers", "field": "x_best_peer",
                    "measure": "x the fastest peer" + (f" ({r['best_peer']})" if r.get("best_peer") else ""),
                    "value": value, "target": least, "met": None if value is None else value >= least})
    for workers in sorted({w for _, w, m in rows if m == "cold"}):
        r = rows.get(("medload", workers, "cold")) or {}
        ratio = r["mb_per_sample"] / sec["sample_mb"] if r.get("mb_per_sample") is not None else None
        out.append({"run": f"at scale, page cache cold, {workers} workers", "field": "x_compressed",
                    "measure": "bytes read from disk per sample / stored bytes of its slices", "value": ratio,
                    "target": DISK_TARGET, "met": None if ratio is None else ratio <= DISK_TARGET, "at_most": True})
    return out


#: Ingest (issue 32): the N-worker row at least ``0.9 * N`` times the 1-worker row (1.8x at 2 workers); the
#: 1-worker row at least 1.2x bare pydicom read+decode in one process; the ingest process (the serial part:
#: files per CPU-second of it, in the N-worker row) and one task's writer each absorbing at least 16x the
#: files/s of one decode worker.
INGEST_TARGETS = {"scaling_per_worker": 0.9, "x_pydicom": 1.2, "process_x_worker": 16.0, "writer_x_worker": 16.0}


def ingest_targets(rows: list[dict], cores: int, writer: str, process: str, pinned: str) -> list[dict]:
    """:data:`INGEST_TARGETS` against the rows of one ingest section (files/s from the medians); ``writer``
    names the writer row, ``process`` labels the ingest process's capacity (read from the N-worker row),
    ``pinned`` names the row of one worker on one core. Scaling is read twice: against one worker as it runs
    (on a machine with more cores than one, it writes on a second core while it decodes on the first), and
    against one worker pinned to one core (throughput per core added)."""
    ok = {r["contender"]: r for r in rows if r.get("status") == "ok"}
    rate = {name: r.get("files_per_s") for name, r in ok.items()}
    widest = medload_row(cores)
    one, many, peer, core = (rate.get(medload_row(1)), rate.get(medload_row(cores)),
                             rate.get(pydicom_row(1)), rate.get(pinned))
    absorbed = (ok.get(widest) or {}).get("ingest_process_files_per_cpu_s")
    wanted = [(f"medload ingest, {cores} workers", "x 1 worker (files/s)", many / one if many and one else None,
               INGEST_TARGETS["scaling_per_worker"] * cores),
              (f"medload ingest, {cores} workers", "x 1 worker pinned to 1 core (files/s)",
               many / core if many and core else None, INGEST_TARGETS["scaling_per_worker"] * cores),
              ("medload ingest, 1 worker", "x pydicom read+decode, 1 process", one / peer if one and peer else None,
               INGEST_TARGETS["x_pydicom"]),
              (f"{process} ({cores} worker{'s' if cores > 1 else ''})", "files per CPU-s of it x 1 worker (files/s)",
               absorbed / one if absorbed and one else None, INGEST_TARGETS["process_x_worker"]),
              ("one task's writer capacity", "x 1 worker (files/s)",
               rate[writer] / one if rate.get(writer) and one else None, INGEST_TARGETS["writer_x_worker"])]
    if cores < 2:
        wanted = wanted[2:]
    return [{"run": run, "measure": measure, "value": value, "target": least,
             "met": None if value is None else value >= least} for run, measure, value, least in wanted]


def gpu_targets(sec: dict) -> list[dict]:
    """:data:`GPU_TARGETS` against the rows of the GPU section (device-independent: on a CPU they are just
    figures, and are not expected to be met)."""
    rows = {(r["contender"], r["num_workers"], r["mode"]): r for r in sec.get("rows", []) if r.get("status") == "ok"}
    out = []
    for name, workers, mode, field, bound, measure, at_most in GPU_TARGETS:
        r = rows.get((name, workers, mode)) or {}
        value = r.get(field)
        if field == "x_best_peer" and r.get("best_peer"):
            measure += f" ({r['best_peer']})"
        met = None if value is None else value <= bound if at_most else value >= bound
        out.append({"run": f"gpu, {name}, {workers} workers, page cache {mode}", "field": field, "measure": measure,
                    "value": value, "target": bound, "met": met, "at_most": at_most})
    return out


#: 3D patches with augmentation (issue 31): (page cache mode, num_workers, at least this many times the
#: fastest peer's patches/s)
PATCH_TARGETS = (("warm", 2, 1.5), ("cold", 2, 1.5), ("warm", 0, 1.0), ("cold", 0, 1.0))
PATCH_PSS_MB = 1500.0
"""Peak PSS of the medload patch loader with 2 workers, at most (MB)."""


def patch_targets(sec: dict) -> list[dict]:
    """:data:`PATCH_TARGETS` and :data:`PATCH_PSS_MB` against the medload rows of the patch section."""
    rows = {(r["contender"], r["num_workers"], r["mode"]): r for r in sec.get("rows", []) if not r.get("train")}
    out = []
    for mode, workers, least in PATCH_TARGETS:
        r = rows.get(("medload", workers, mode)) or {}
        value = r.get("x_best_peer")
        out.append({"run": f"3D patches, page cache {mode}, {workers} workers", "field": "x_best_peer",
                    "measure": "x the fastest peer" + (f" ({r['best_peer']})" if r.get("best_peer") else ""),
                    "value": value, "target": least, "met": None if value is None else value >= least})
    for mode in sorted({m for _, w, m in rows if w == 2}, reverse=True):
        r = rows.get(("medload", 2, mode)) or {}
        value = r.get("peak_pss_mb") if r.get("status") == "ok" else None
        out.append({"run": f"3D patches, page cache {mode}, 2 workers", "field": "peak_pss_mb",
                    "measure": "peak PSS MB, process tree", "value": value, "target": PATCH_PSS_MB,
                    "met": None if value is None else value <= PATCH_PSS_MB, "at_most": True})
    return out
