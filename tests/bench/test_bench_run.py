"""``run_bench`` end to end on tiny data: every printed figure is in the returned dict and the JSON, failed
and skipped contenders are reported with their reason, the plot is a PNG, the README tables are markdown."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from medload.bench import report
from medload.bench.common import tree_read_bytes
from medload.bench.ingest import COLD, INGEST_PROCESS, PINNED, WRITER
from medload.bench.ingest_scaling import medload_row, pydicom_row, worker_counts
from medload.bench.run import BenchConfig, run_bench
from medload.errors import ConfigError

TINY = BenchConfig(series_25d=2, slices_25d=5, size_25d=48, series_3d=1, slices_3d=7, size_3d=32, depth_3d=4,
                   ingest_series=2, ingest_slices=6, ingest_repeats=1, ingest_warmup=0, workers=(2,), workers_3d=(0,),
                   warmup=1, batches=1, repeats=2,
                   batch_size=2, max_pass_s=None, scaling=(1, 2), scale_series=3, scale_slices=6, scale_size=48,
                   scale_warmup=1, scale_batches=1, scale_repeats=2, gpu_steps=2, timeout=120)


def broken_loader(prep, batch_size: int, num_workers: int, device: str):
    """A contender of our own that fails (resolved by the benchmark from this file)."""
    raise RuntimeError("boom: this loader is broken on purpose")


def _io_accounting() -> bool:
    """Whether this kernel counts the bytes a process reads from storage (``/proc/self/io``)."""
    import tempfile

    with tempfile.NamedTemporaryFile(dir=Path(__file__).parent) as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        before = tree_read_bytes()
        os.pread(f.fileno(), 1 << 20, 0)
        return tree_read_bytes() > before


def test_bytes_read_by_ended_children_are_counted_once(tmp_path):
    """tree_read_bytes: a child that read a file from the disk and was reaped counts its bytes once (the
    kernel adds them to this process's own counts; they were counted twice before)."""
    if not _io_accounting():
        pytest.skip(reason="this kernel does not count the bytes a process reads from storage (/proc/self/io)")
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    before = tree_read_bytes()
    pid = os.fork()
    if pid == 0:
        with open(path, "rb") as f:
            f.read()
        os._exit(0)
    os.waitpid(pid, 0)
    assert 0.9 * (8 << 20) <= tree_read_bytes() - before <= 1.5 * (8 << 20)


def printed_rows(text: str) -> list[list[str]]:
    """The body rows of every rich table in ``text``, as stripped cells."""
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines()
            if line.startswith("│")]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One tiny run of every section, with dcm2niix hidden and a broken contender added."""
    out = tmp_path_factory.mktemp("run")
    mp = pytest.MonkeyPatch()
    mp.setenv("PATH", str(out))  # no dcm2niix: its row must say so (the children are started by absolute path)
    cfg = BenchConfig(**{**TINY.__dict__, "extra_contenders": (f"{__file__}:broken_loader",)})
    import contextlib
    import io

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            results = run_bench(config=cfg, json_out=out / "bench.json", plot=out / "bench.png", progress=False)
    finally:
        mp.undo()
    return results, buf.getvalue(), out


def test_printed_tables_are_the_figures_of_the_results(bench):
    results, text, out = bench
    printed = printed_rows(text)
    tables = report.section_tables(results)
    curve = ["Ingest scaling"] if results["ingest"]["cores"] > 1 else []
    assert [t.title.split(":")[0] for t in tables] == [
        "Ingest", "Ingest process (the serial part)", *curve, "Size on disk", "Ingest targets (issue 32), read from the rows above", "2.5D loading", "3D loading", "medload against each peer", "Scaling",
        "Loading at scale", "Scale targets, read from the rows above", "Speed targets", "Memory target", "GPU"]
    for table in tables:
        for cells, failed in zip(table.rows, table.failed):
            if not failed:  # failed rows fold their long message over lines
                assert cells in printed, (table.title, cells)
    ingest_rows = {r["contender"]: r for r in results["ingest"]["rows"]}
    assert results["ingest"]["files"] == 2 * 6  # its own series (ingest_series x ingest_slices), not the 2.5D set's
    assert "2 series x 6 slices" in results["ingest"]["source"]
    assert ingest_rows[WRITER]["status"] == "ok" and ingest_rows[WRITER]["files_per_s"] > 0
    one = ingest_rows["medload ingest (1 worker)"]["files_per_s"]
    capacity = next(t for t in results["ingest"]["targets"] if t["run"] == "one task's writer capacity")
    assert capacity["value"] == pytest.approx(ingest_rows[WRITER]["files_per_s"] / one)
    # the serial part: every medload ingest row (local and Dask) has the CPU seconds of the ingest process
    medload_rows = [r for name, r in ingest_rows.items() if name.startswith("medload ingest")]
    assert len(medload_rows) >= 3 and all(r["status"] == "ok" for r in medload_rows)
    for r in medload_rows:
        assert isinstance(r["ingest_process_cpu_s"], float) and r["ingest_process_cpu_s"] > 0
        assert r["ingest_process_files_per_cpu_s"] == pytest.approx(results["ingest"]["files"] / r["ingest_process_cpu_s"])
        busy = r.get("cores_busy")
        assert (busy is None) == ("Dask" in r["contender"])  # a cluster's processes are not the child's children
        assert [r["contender"], report.fmt_s(r["ingest_process_cpu_s"]),
                report.fmt_int(r["ingest_process_files_per_cpu_s"]), "" if busy is None else f"{busy:.2f}"] in printed
    cores = results["ingest"]["cores"]
    if cores > 1:  # one worker pinned to one core: its whole process tree uses at most that core
        pinned = ingest_rows[PINNED]
        assert pinned["cores"] == 1 and 0 < pinned["cores_busy"] <= 1.05
        scaling = next(t for t in results["ingest"]["targets"] if t["measure"].endswith("pinned to 1 core (files/s)"))
        assert scaling["value"] == pytest.approx(ingest_rows[f"medload ingest ({cores} workers)"]["files_per_s"]
                                                 / pinned["files_per_s"])
    if cores > 1:  # the rows whose files are read from the disk: every byte of them, where the kernel counts them
        cold = [ingest_rows[f"{name} ({cores} {unit}, {COLD})"] for name, unit in (("pydicom read+decode", "procs"),
                                                                                 ("medload ingest", "workers"))]
        assert all(r["status"] == "ok" and r["files_per_s"] > 0 for r in cold)
        if _io_accounting():
            assert all(r["read_mb"] >= 0.9 * results["ingest"]["megabytes"] for r in cold), cold
            assert ingest_rows[f"medload ingest ({cores} workers)"]["read_mb"] < 0.5 * results["ingest"]["megabytes"]
    # the scaling curve: 1, 2, 4, ... workers up to every core, each point the figures of its rows
    assert [p["workers"] for p in results["ingest"]["scaling"]] == worker_counts(cores)
    for p in results["ingest"]["scaling"]:
        own, peer = ingest_rows[medload_row(p["workers"])], ingest_rows[pydicom_row(p["workers"])]
        assert p["medload_files_per_s"] == own["files_per_s"] and p["pydicom_files_per_s"] == peer["files_per_s"]
        assert p["medload_x_1"] == pytest.approx(own["files_per_s"] / one)
        assert p["medload_x_pydicom"] == pytest.approx(own["files_per_s"] / peer["files_per_s"])
        assert p["cores_busy"] == own["cores_busy"]
    widest = ingest_rows[f"medload ingest ({cores} workers)" if cores > 1 else "medload ingest (1 worker)"]
    absorbed = next(t for t in results["ingest"]["targets"] if t["run"].startswith(INGEST_PROCESS))
    assert absorbed["run"] == f"{INGEST_PROCESS} ({cores} worker{'s' if cores > 1 else ''})"
    assert absorbed["value"] == pytest.approx(widest["ingest_process_files_per_cpu_s"] / one)
    assert absorbed["target"] == 16.0 and absorbed["met"] == (absorbed["value"] >= 16.0)
    # ... and the cells are the dict's numbers
    for sec in results["loading"].values():
        for r in sec["rows"]:
            if r["status"] != "ok":
                continue
            name = r["contender"] + (" (int16)" if r["dtype"] == "int16" and "int16" not in r["contender"] else "")
            cells = next(c for c in printed if c[:2] == [name,
                                                        report._workers_label(r)] and len(c) == 10
                         and c[2].startswith(report.fmt_rate(r["samples_per_s"])))
            assert cells[2] == (f"{report.fmt_rate(r['samples_per_s'])} ({report.fmt_rate(r['samples_per_s_min'])}-"
                                f"{report.fmt_rate(r['samples_per_s_max'])})")
            assert cells[3] == report.fmt_ratio(r["x_npy_memmap"]) and cells[5] == report.fmt_int(r["peak_pss_mb"])
            if r["contender"] in ("medload", "medload_uint8"):
                assert cells[6] == report.fmt_pct(r["cache"]["l1_hit_rate"]) and r["cache"]["l1_misses"] > 0
                assert cells[8] == report.fmt_s(r["cache"]["next_cpu_ms"]) and r["cache"]["next_cpu_ms"] > 0
                assert r["ratios"]["monai_cache_dataset"] == pytest.approx(
                    r["samples_per_s"] / next(p["samples_per_s"] for p in sec["rows"]
                                              if p["contender"] == "monai_cache_dataset"
                                              and p["num_workers"] == r["num_workers"]))
    ingest = {r["contender"]: r for r in results["ingest"]["rows"]}
    medload1 = ingest["medload ingest (1 worker)"]
    assert [report.fmt_int(medload1["files_per_s"]), report.fmt_ratio(medload1["ratios"]["pydicom"])] == \
        next(c for c in printed if c[0] == "medload ingest (1 worker)")[3:7:3]
    assert results["ingest"]["sizes"]["store_mb"] > 0 and results["ingest"]["sizes"]["nii_mb"] is None
    assert f"wall time {results['wall_s']:.0f} s" in text
    # the JSON holds every figure: it is the returned dict
    assert json.loads((out / "bench.json").read_text()) == json.loads(json.dumps(results, default=str))


def test_failed_and_skipped_are_reported_never_dropped(bench):
    results, text, _ = bench
    dcm2niix = next(r for r in results["ingest"]["rows"] if r["contender"].startswith("dcm2niix"))
    assert dcm2niix["status"] == "failed" and "dcm2niix is not on PATH" in dcm2niix["error"]
    assert dcm2niix["ratios"] == {"pydicom": None, "dcm2niix": None, "simpleitk": None}
    for kind, sec in results["loading"].items():
        broken = [r for r in sec["rows"] if r["contender"].endswith(":broken_loader")]
        workers = (2,) if kind == "2.5d" else (0,)
        assert [r["num_workers"] for r in broken] == list(workers)
        assert all(r["status"] == "failed" and "boom: this loader is broken on purpose" in r["error"] for r in broken)
        assert all(r["status"] == "ok" for r in sec["rows"] if r not in broken), kind
    assert "failed: RuntimeError: boom: this loader is broken on purpose" in text  # the row and, in full, its note
    assert results["gpu"] == {"status": "skipped", "reason": "no CUDA device (torch.cuda.is_available() is False)"}
    assert "skipped: no CUDA device" in text


def test_scaling_and_targets(bench):
    results, _, _ = bench
    sc = results["scaling"]
    assert [r["series"] for r in sc["rows"]] == [1, 2] and all(r["status"] == "ok" for r in sc["rows"])
    assert sc["rows"][0]["x_first"] == 1.0 and sc["rows"][1]["slices"] == 10
    assert all(r["cache"]["l1_hits"] + r["cache"]["l1_misses"] > 0 for r in sc["rows"])
    runs = [t["run"] for t in results["targets"]]
    assert "2.5d medload, 2 workers (fits in L1)" in runs and "scaling, 2 series, 2 workers" in runs
    assert {"at scale, page cache warm, 2 workers", "at scale, page cache cold, 2 workers"} <= set(runs)
    assert all(t["met"] == (t["peak_pss_mb"] <= 1000) for t in results["targets"])
    rows = {(r["contender"], r["num_workers"]): r for r in results["loading"]["2.5d"]["rows"]}
    speed = {(t["run"], t["measure"]): t for t in results["speed_targets"]}
    assert len(speed) == 6
    memmap = speed[("2.5d medload, 2 workers, on cpu", "x npy memmap loader")]
    assert memmap["value"] == rows[("medload", 2)]["x_npy_memmap"] and memmap["met"] == (memmap["value"] >= 3.0)
    passthrough = speed[("2.5d medload_int16, 2 workers, on cpu", "% of ceiling_int16 (2 threads): int16 passthrough")]
    ceiling = next(r for r in results["loading"]["2.5d"]["rows"] if r["contender"] == "ceiling_int16" and r["threads"] == 2)
    assert passthrough["value"] == pytest.approx(100 * rows[("medload_int16", 2)]["samples_per_s"] / ceiling["samples_per_s"])
    assert speed[("2.5d medload, 0 workers, on cpu", "x npy memmap loader")]["met"] is None  # not run: no 0-worker row


def test_scale_section_rows_and_targets(bench):
    """Every contender at every mode and workers count, each ok or skipped with the reason (nnU-Net where
    nnunetv2 is not installed); medload's ratio to the fastest peer and its targets come from those rows."""
    results, text, _ = bench
    sec = results["scale"]
    assert sec["status"] == "ok" and sec["series"] == 3 and sec["slices"] == 18 and sec["sample_mb"] > 0
    rows = {(r["contender"], r["mode"]): r for r in sec["rows"]}
    assert set(rows) == {(c, m) for c in ("medload", "npy_memmap", "zarr_blosc", "hdf5_chunked",
                                           "monai_cache_thread", "nnunet") for m in ("warm", "cold")}
    for (name, _), r in rows.items():
        if name == "nnunet" and r["status"] == "skipped":
            assert "nnunetv2 is not installed" in r["reason"]
            continue
        assert r["status"] == "ok", r
        assert r["samples"] == [2, 2] and r["mb_per_sample"] >= 0 and r["peak_pss_mb"] > 0
    for mode in ("warm", "cold"):
        m = rows[("medload", mode)]
        peers = [r for (n, md), r in rows.items() if md == mode and n != "medload" and r.get("samples_per_s")]
        best = max(peers, key=lambda r: r["samples_per_s"])
        assert m["best_peer"] == best["contender"]
        assert m["x_best_peer"] == pytest.approx(m["samples_per_s"] / best["samples_per_s"])
        assert m["cache"]["l1_hits"] + m["cache"]["l1_misses"] > 0
        target = next(t for t in results["scale_targets"] if t["run"] == f"at scale, page cache {mode}, 2 workers"
                      and t["field"] == "x_best_peer")
        assert target["value"] == m["x_best_peer"] and target["met"] == (m["x_best_peer"] >= {"cold": 1.5, "warm": 1.5}[mode])
    disk = next(t for t in results["scale_targets"] if t["field"] == "x_compressed")
    assert disk["value"] == pytest.approx(rows[("medload", "cold")]["mb_per_sample"] / sec["sample_mb"])
    table = next(t for t in report.section_tables(results) if t.title.startswith("Loading at scale"))
    medload_warm = next(c for c in table.rows if c[:3] == ["warm", "2", "medload"])
    r = rows[("medload", "warm")]
    assert medload_warm[3] == (f"{report.fmt_rate(r['samples_per_s'])} ({report.fmt_rate(r['samples_per_s_min'])}-"
                               f"{report.fmt_rate(r['samples_per_s_max'])})")
    assert medload_warm[5] == f"{r['mb_per_sample']:.2f}" and medload_warm[7] == report.fmt_int(r["peak_pss_mb"])


def test_a_busy_machine_is_named_next_to_the_targets(bench):
    results, _, _ = bench
    busy = dict(results, busy=["loading 2.5d: other processes used 80% of the CPUs meanwhile; ..."])
    busy["speed_targets"] = [dict(t, met=False) for t in results["speed_targets"]]
    speed = next(t for t in report.section_tables(busy) if t.title.startswith("Speed targets"))
    assert all(row[-1] == "NO (busy machine)" for row in speed.rows)
    assert any("other processes used 80% of the CPUs" in n for n in speed.notes)
    assert set(results["others_cpu"]) >= {"loading 2.5d", "scale"}  # measured for every section
    quiet = next(t for t in report.section_tables(dict(busy, busy=[])) if t.title.startswith("Speed targets"))
    assert all(row[-1] == "NO" for row in quiet.rows)


def test_plot_is_a_png_and_readme_tables_are_markdown(bench):
    results, _, out = bench
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    import matplotlib.image

    assert matplotlib.image.imread(out / "bench.png").ndim == 3
    md = report.readme_tables(results)
    assert md.startswith("`medload bench --scale 3` on ") and "| contender | workers | samples/s (min-max) |" in md
    assert "boom: this loader is broken on purpose" in md and md.count("|---|") >= 7


def test_user_data_skips_what_cannot_apply(tmp_path):
    """--data: MONAI cannot stack series whose InstanceNumbers are shuffled, and no series is thick enough
    for the 3D slabs: both are reported, the others run."""
    from medload.synthetic import SeriesSpec, make_series

    for i in range(2):
        make_series(tmp_path / "dicom" / f"s{i}", SeriesSpec(n_slices=5, rows=32, cols=32), seed=i,
                    series_number=i + 1, shuffle=True)
    cfg = BenchConfig(**{**TINY.__dict__, "contenders": ("monai_cache_dataset", "npy_memmap", "medload"),
                         "workers": (0,), "depth_3d": 8})
    results = run_bench(config=cfg, data=tmp_path / "dicom", sections=["loading"], progress=False)
    sec = results["loading"]["2.5d"]
    rows = {r["contender"]: r for r in sec["rows"]}
    assert rows["monai_cache_dataset"]["status"] == "skipped"
    assert "InstanceNumbers do not follow the slice order" in rows["monai_cache_dataset"]["reason"]
    assert rows["npy_memmap"]["status"] == rows["medload"]["status"] == "ok" and sec["series"] == 2
    assert results["loading"]["3d"]["status"] == "skipped"
    assert "at least 8 slices" in results["loading"]["3d"]["reason"]
    assert results["config"]["command"] == f"medload bench --data {tmp_path / 'dicom'} --sections loading"


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown benchmark sections"):
        run_bench(sections=["loading", "speed"], config=TINY, progress=False)
    with pytest.raises(ConfigError, match="not a folder"):
        run_bench(data=tmp_path / "missing", config=TINY, progress=False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        run_bench(device="cuda", config=TINY, progress=False)


def test_the_gpu_section_runs_on_the_cpu_at_a_tiny_size(tmp_path):
    """The GPU section's code path, on the CPU (host clocks, CPU autocast): the ceiling, every contender in
    every planned run, the ratios, the targets and the tables."""
    from medload.bench.gpu import GpuSettings, gpu_data, measure, plan
    from medload.bench.gpu_report import gpu_tables
    from medload.bench.targets import GPU_TARGETS, gpu_targets

    settings = GpuSettings(batch_size=2, steps=2, warmup=1, workers=(0, "auto"), peer_workers=0, channels=(4, 8),
                           res_units=1)
    prep = gpu_data(tmp_path, series=2, slices=6, size=32, samples=settings.samples, key_file=tmp_path / "bench.key")
    sec = measure(prep, "cpu", settings)
    rows = sec["rows"]
    assert [(r["contender"], r["num_workers"], r["mode"]) for r in rows] == plan(settings)
    assert {r["contender"] for r in rows} == set(settings.contenders)
    assert not [r for r in rows if r["status"] != "ok"], rows
    assert sec["ceiling"]["samples_per_s"] > 0
    for r in rows:
        assert r["pct_of_ceiling"] == pytest.approx(100 * r["samples_per_s"] / sec["ceiling"]["samples_per_s"])
        assert 0 < r["gpu_busy"] <= 1 and r["next_ms"] > 0 and r["nvml_util"] is None
    medload = [r for r in rows if r["contender"].startswith("medload")]
    assert all(r["x_best_peer"] > 0 and r["best_peer"] for r in medload)
    assert [r.get("chose") is not None for r in medload] == [w == "auto" for _, w, _ in plan(settings)[: len(medload)]]
    targets = gpu_targets({**sec, "rows": [{**r, "num_workers": 4} if r["num_workers"] == 0 else r for r in rows]})
    assert len(targets) == len(GPU_TARGETS) and all(t["value"] is not None for t in targets)
    tables = gpu_tables({"gpu": sec, "gpu_targets": targets})
    assert [t.title.split(" ")[0] for t in tables] == ["GPU", "GPU"] and len(tables[0].rows) == len(rows)


def test_the_command_line_runs_a_section_and_writes_json_and_markdown(tmp_path):
    """``medload bench`` as a user runs it: a real quick section (scaling, the quickest that measures; the
    ``bench`` fixture above runs every section in process), its figures in JSON and markdown."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "medload.cli", "bench", "--quick", "--sections", "scaling", "--no-progress",
           "--json", str(tmp_path / "b.json"), "--readme", str(tmp_path / "b.md")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "b.json").read_text())
    assert results["config"]["command"] == "medload bench --quick --sections scaling"
    rows = results["scaling"]["rows"]
    assert [(r["series"], r["status"]) for r in rows] == [(1, "ok"), (4, "ok")]
    assert all(r["samples_per_s"] > 0 for r in rows)
    markdown = (tmp_path / "b.md").read_text()
    assert markdown.startswith("`medload bench --quick --sections scaling` on ")
    assert f"| 4 | {rows[1]['slices']} |" in markdown and "**Memory target" in markdown
    bad = subprocess.run([*cmd[:3], "bench", "--sections", "speed"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown benchmark sections" in bad.stderr


def test_the_ingest_section_alone_writes_only_its_own_series(tmp_path):
    """``--sections ingest`` writes the series it ingests (ingest_series x ingest_slices), not the 2.5D set
    the loading sections need."""
    results = run_bench(config=TINY, sections=["ingest"], progress=False)
    assert results["ingest"]["files"] == 2 * 6
    assert "synthetic data to ingest" in results["timings_s"] and "synthetic data" not in results["timings_s"]
