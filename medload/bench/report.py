"""The benchmark's tables (terminal and README markdown) and plot, all drawn from the results dict.

:func:`section_tables` turns results into :class:`TableSpec` s -- title, columns, cells as text, notes --
and both :func:`print_tables` (rich, on the terminal) and :func:`readme_tables` (markdown) print those,
so every figure shown is a figure of the results dict, formatted by the helpers here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TableSpec", "section_tables", "print_tables", "readme_tables", "plot", "display_name", "fmt_rate",
           "fmt_ratio", "fmt_int", "fmt_pct", "fmt_s"]

KIND_LABEL = {"2.5d": "2.5D", "3d": "3D"}


# ---- number formats (the test suite checks printed figures with these) ------------------------------
def fmt_rate(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def fmt_ratio(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def fmt_int(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


@dataclass
class TableSpec:
    """One table: ``rows`` are cells as text (``failed`` marks rows to highlight), ``notes`` go below."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    failed: list[bool] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, cells: list[str], failed: bool = False) -> None:
        self.rows.append(cells)
        self.failed.append(failed)


def _status(row: dict) -> str:
    return f"{row['status']}: {row.get('error') or row.get('reason') or ''}".strip()


def _short(row: dict, width: int = 60) -> str:
    """A failed or skipped row's cell: its status and the start of its message (the notes have it all)."""
    text = _status(row)
    return text if len(text) <= width else text[: width - 3] + "..."


def display_name(name: str) -> str:
    """A contender's name in tables: ``module:function`` and ``file.py:function`` show the function."""
    return name.rsplit(":", 1)[-1] if ":" in name else name


# ---- ingest ------------------------------------------------------------------------------------------
def _ingest_tables(sec: dict) -> list[TableSpec]:
    if sec.get("status") != "ok":
        return [TableSpec("Ingest", ["section"], [[_status(sec)]], [sec.get("status") == "failed"])]
    t = TableSpec(f"Ingest: {sec['files']} files, {sec['megabytes']:.0f} MB ({sec['source']}); {sec['cores']} cores; "
                  f"median of {sec['repeats']} runs (min-max), each a fresh process",
                  ["contender", "cores", "s (min-max)", "files/s", "MB/s", "files/s per core", "x pydicom per core",
                   "x dcm2niix per core", "x SimpleITK per core"])
    for r in sec["rows"]:
        if r["status"] != "ok":
            t.add([r["contender"], str(r["cores"]), _short(r), "", "", "", "", "", ""], failed=True)
            t.notes.append(f"{r['contender']}: {_status(r)}")
            continue
        rt = r["ratios"]
        t.add([r["contender"], str(r["cores"]),
               f"{fmt_s(r['seconds_median'])} ({fmt_s(r['seconds_min'])}-{fmt_s(r['seconds_max'])})",
               fmt_int(r["files_per_s"]), fmt_int(r["mb_per_s"]), fmt_int(r["files_per_s_per_core"]),
               fmt_ratio(rt.get("pydicom")), fmt_ratio(rt.get("dcm2niix")), fmt_ratio(rt.get("simpleitk"))])
        failed_series = (r.get("detail") or {}).get("series_failed")
        if failed_series:
            t.notes.append(f"{r['contender']}: {failed_series} series could not be read: "
                           f"{'; '.join(r['detail'].get('errors', []))}")
    c = TableSpec("Ingest process (the serial part): its own CPU seconds in the timed ingest (user + system, "
                  "not its children's); cores busy: CPU seconds of its whole process tree per second (local rows)",
                  ["contender", "CPU s", "files per CPU-s", "cores busy"])
    for r in sec["rows"]:
        if r.get("ingest_process_cpu_s") is not None:
            busy = r.get("cores_busy")
            c.add([r["contender"], fmt_s(r["ingest_process_cpu_s"]), fmt_int(r["ingest_process_files_per_cpu_s"]),
                   "" if busy is None else f"{busy:.2f}"])
    sz = sec["sizes"]
    s = TableSpec("Size on disk", ["form", "MB", "x DICOM"])
    s.add(["DICOM files", fmt_int(sz["dicom_mb"]), "1.00"])
    s.add([f"medload store ({sz['store_codec']})", fmt_int(sz["store_mb"]), fmt_ratio(sz["store_x_dicom"])])
    s.add(["dcm2niix .nii", fmt_int(sz["nii_mb"]), fmt_ratio(sz["nii_x_dicom"])])
    g = TableSpec("Ingest targets (issue 32), read from the rows above", ["run", "measure", "value", "target", "met"])
    for x in sec.get("targets", []):
        g.add([x["run"], x["measure"], fmt_ratio(x["value"]), f">= {fmt_ratio(x['target'])}",
               "-" if x["met"] is None else "yes" if x["met"] else "NO"], failed=x["met"] is False)
    from medload.bench.ingest_scaling import scaling_table

    curve = [scaling_table(sec)] if len(sec.get("scaling") or []) > 1 else []
    return [t, *([c] if c.rows else []), *curve, s, *([g] if g.rows else [])]


# ---- loading ---------------------------------------------------------------------------------------
def _workers_label(r: dict) -> str:
    if r["threads"]:
        return f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}"
    return str(r["num_workers"])


def _order(rows: list[dict]) -> list[dict]:
    def key(item):
        i, r = item
        w = max(1, r["num_workers"] or 0) if r["threads"] is None else r["threads"]
        return (w, r["threads"] is not None, i)

    return [r for _, r in sorted(enumerate(rows), key=key)]


def _loading_table(sec: dict) -> TableSpec:
    key: Any = sec.get("kind")  # "2.5d"/"3d", or None in a section that failed early
    kind = KIND_LABEL.get(key, key)
    if sec.get("status") != "ok":
        return TableSpec(f"{kind} loading", ["section"], [[_status(sec)]], [sec.get("status") == "failed"])
    shape = " x ".join(str(n) for n in sec["sample_shape"])
    t = TableSpec(f"{kind} loading: batches of {sec['batch_size']} x ({shape}) float32, soft-tissue window, on "
                  f"{sec['device']}; {sec['series']} series; median of {sec['repeats']} passes (min-max) of "
                  f"{sec['batches']} timed batches after {sec['warmup']} warm-up",
                  ["contender", "workers", "samples/s (min-max)", "x npy_memmap", "% of ceiling (same dtype)",
                   "peak PSS MB", "L1 hit rate", "L3 slices read", "CPU ms in next()", "setup s"])
    capped = False
    for r in _order(sec["rows"]):
        name = display_name(r["contender"]) + (" (int16)" if r["dtype"] == "int16" and "int16" not in r["contender"] else "")
        if r["status"] != "ok":
            t.add([name, _workers_label(r), _short(r), "", "", fmt_int(r.get("peak_pss_mb")), "", "", "", ""],
                  failed=True)
            t.notes.append(f"{r['contender']} ({_workers_label(r)} workers): {_status(r)}")
            continue
        cache = r.get("cache") or {}
        mark = "*" if r.get("capped") else ""
        capped |= bool(mark)
        t.add([name, _workers_label(r),
               f"{fmt_rate(r['samples_per_s'])} ({fmt_rate(r['samples_per_s_min'])}-{fmt_rate(r['samples_per_s_max'])}){mark}",
               fmt_ratio(r["x_npy_memmap"]), fmt_int(r["pct_of_ceiling"]), fmt_int(r["peak_pss_mb"]),
               fmt_pct(cache.get("l1_hit_rate")) if cache else "", fmt_int(cache.get("l3_reads")) if cache else "",
               fmt_s(cache.get("next_cpu_ms")) if cache else "", f"{r['setup_s']:.1f}"])
    if capped:
        t.notes.append(f"* some passes stopped after {sec['max_pass_s']:g} s of timed batches (fewer samples)")
    t.notes.append("L1 hit rate and L3 slices read: medload's 256 MB L1 per process, summed over the trainer and "
                   "its DataLoader workers, over the whole run (warm-up and timed passes); CPU ms in next(): the "
                   "training thread's CPU time per medload batch inside next(loader), over the whole run")
    for note in (sec.get("note"), sec.get("monai_note")):
        if note:
            t.notes.append(note)
    return t


def _ratio_table(loading: dict) -> TableSpec | None:
    secs = [s for s in loading.values() if s.get("status") == "ok"]
    if not secs:
        return None
    peers = [p for p in dict.fromkeys(r["contender"] for s in secs for r in s["rows"])
             if p not in ("medload", "medload_uint8", "medload_int16", "ceiling_float32", "ceiling_int16")]
    t = TableSpec("medload against each peer: samples/s ratio, same data, same run, same num_workers "
                  "(ceilings: 1 thread for 0 workers)",
                  ["kind", "contender", "workers", *[f"x {display_name(p)}" for p in peers], "% of ceiling_float32"])
    for s in secs:
        for r in s["rows"]:
            if r["contender"] not in s.get("medload", ()) or r["threads"]:
                continue
            if r["status"] != "ok":
                t.add([KIND_LABEL[s["kind"]], r["contender"], _workers_label(r), _short(r),
                       *[""] * len(peers)], failed=True)
                continue
            t.add([KIND_LABEL[s["kind"]], r["contender"], _workers_label(r),
                   *[fmt_ratio(r["ratios"].get(p)) for p in peers], fmt_int(r["pct_of_ceiling"])])
    return t


# ---- scaling, targets, GPU --------------------------------------------------------------------------
def _scaling_table(sec: dict) -> TableSpec:
    if sec.get("status") != "ok":
        return TableSpec("Scaling", ["section"], [[_status(sec)]], [sec.get("status") == "failed"])
    t = TableSpec(f"Scaling: medload 2.5D, {sec['num_workers']} workers, {sec['l1']} L1, as the store grows "
                  f"(flat is the goal); {sec['samples_per_pass']} random samples per pass, median of "
                  f"{sec['repeats']} passes (min-max)",
                  ["series", "slices", "store MB", "samples/s (min-max)", "x 1st row", "peak PSS MB", "L1 hit rate",
                   "L1 evictions", "L3 slices read"])
    for r in sec["rows"]:
        if r["status"] != "ok":
            t.add([str(r["series"]), fmt_int(r.get("slices")), fmt_int(r.get("store_mb")), _short(r), "",
                   fmt_int(r.get("peak_pss_mb")), "", "", ""], failed=True)
            t.notes.append(f"{r['series']} series: {_status(r)}")
            continue
        c = r.get("cache") or {}
        t.add([str(r["series"]), str(r["slices"]), fmt_int(r["store_mb"]),
               f"{fmt_rate(r['samples_per_s'])} ({fmt_rate(r['samples_per_s_min'])}-{fmt_rate(r['samples_per_s_max'])})",
               fmt_ratio(r.get("x_first")), fmt_int(r["peak_pss_mb"]), fmt_pct(c.get("l1_hit_rate")),
               fmt_int(c.get("l1_evictions")), fmt_int(c.get("l3_reads"))])
    for note in sec.get("notes", []):
        t.notes.append(note)
    return t


def _targets_table(targets: list[dict]) -> TableSpec:
    t = TableSpec("Memory target: peak PSS <= 1 GB at 2 workers with a 256 MB L1",
                  ["run", "peak PSS MB", "target MB", "met"])
    for x in targets:
        t.add([x["run"], fmt_int(x["peak_pss_mb"]), fmt_int(x["target_mb"]),
               "-" if x["met"] is None else "yes" if x["met"] else "NO"], failed=x["met"] is False)
    return t


def _speed_table(targets: list[dict]) -> TableSpec:
    t = TableSpec("Speed targets: 2.5D loading, read from the rows above", ["run", "measure", "value", "target", "met"])
    for x in targets:
        fmt = fmt_ratio if x["field"] == "x_npy_memmap" else fmt_int  # a ratio, or a percentage
        t.add([x["run"], x["measure"], "-" if x["value"] is None else fmt(x["value"]), f">= {fmt(x['target'])}",
               "-" if x["met"] is None else "yes" if x["met"] else "NO"], failed=x["met"] is False)
    return t


def section_tables(results: dict) -> list[TableSpec]:
    """Every table of ``results`` (the dict :func:`medload.bench.run.run_bench` returns), in print order."""
    out: list[TableSpec] = []
    if "ingest" in results:
        out += _ingest_tables(results["ingest"])
    loading = results.get("loading") or {}
    for sec in loading.values():
        out.append(_loading_table(sec))
    ratio = _ratio_table(loading) if loading else None
    if ratio is not None and ratio.rows:
        out.append(ratio)
    if "scaling" in results:
        out.append(_scaling_table(results["scaling"]))
    from medload.bench.scale_report import scale_tables

    out += scale_tables(results)
    from medload.bench.patches_report import patch_tables

    out += patch_tables(results)
    if results.get("speed_targets"):
        out.append(_speed_table(results["speed_targets"]))
    if results.get("targets"):
        out.append(_targets_table(results["targets"]))
    from medload.bench.gpu_report import gpu_tables

    out += gpu_tables(results)
    busy = results.get("busy") or []
    for t in out:
        if busy and any(row[-1] == "NO" for row in t.rows) and t.columns[-1] == "met":
            t.rows = [row[:-1] + ["NO (busy machine)"] if row[-1] == "NO" else row for row in t.rows]
            t.notes += busy
    return out


# ---- output ----------------------------------------------------------------------------------------
def print_tables(tables: list[TableSpec], console=None) -> None:
    """Print tables with rich (a wide console when stdout is not a terminal, so rows never wrap)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 250, highlight=False)
    for spec in tables:
        table = Table(title=escape(spec.title), title_justify="left")
        for i, col in enumerate(spec.columns):
            table.add_column(escape(col), justify="left" if i == 0 or spec.columns == ["section"] else "right",
                             overflow="fold")
        for cells, failed in zip(spec.rows, spec.failed):
            table.add_row(*[f"[red]{escape(c)}[/red]" if failed and c else escape(c) for c in cells])
        console.print(table)
        for note in spec.notes:
            console.print(f"  {escape(note)}", soft_wrap=True)


def _md(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def readme_tables(results: dict) -> str:
    """The results as markdown for the README's results section: command, date, machine, tables."""
    cfg = results.get("config", {})
    m = cfg.get("machine", {})
    versions = ", ".join(f"{k} {m[k]}" for k in ("python", "torch", "monai", "numpy", "pydicom", "simpleitk")
                         if m.get(k))
    lines = [f"`{cfg.get('command', 'medload bench')}` on {cfg.get('date', '?')}, "
             f"{m.get('cpu', '?')} ({m.get('cores', '?')} cores"
             + (f", {m['memory_gb']:.0f} GB RAM" if m.get("memory_gb") else "") + ")"
             + (f", GPU {m['cuda']}" if m.get("cuda") else "") + f"; {versions}"
             + (f"; dcm2niix {m['dcm2niix']}" if m.get("dcm2niix") else "")
             + (f"; wall time {results['wall_s']:.0f} s" if results.get("wall_s") is not None else "") + ".", ""]
    for spec in section_tables(results):
        lines += [f"**{_md(spec.title)}**", ""]
        lines.append("| " + " | ".join(_md(c) for c in spec.columns) + " |")
        lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(spec.columns))) + "|")
        lines += ["| " + " | ".join(_md(c) for c in cells) + " |" for cells in spec.rows]
        lines.append("")
        lines += [f"{_md(n)}  " for n in spec.notes]
        if spec.notes:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def plot(results: dict, path: str | Path) -> Path:
    """A PNG of samples/s per contender, one panel per sample kind, bars grouped by num_workers (a
    ceiling's bar stands with the workers it is compared with); failed or skipped contenders are named
    at the foot of their group. Then a panel of the scale section, and one of ingest files/s against
    workers where the ingest section measured more than one worker count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    secs = [s for s in (results.get("loading") or {}).values() if s.get("status") == "ok"]
    scale = results.get("scale") if (results.get("scale") or {}).get("status") == "ok" else None
    ingest = results.get("ingest") or {}
    curve = ingest if ingest.get("status") == "ok" and len(ingest.get("scaling") or []) > 1 else None
    panels = len(secs) + (scale is not None) + (curve is not None)
    fig, axes = plt.subplots(1, max(1, panels), figsize=(7 * max(1, panels), 5), squeeze=False)
    if scale is not None:
        from medload.bench.scale_report import plot_scale

        plot_scale(scale, axes[0][len(secs)])
    if curve is not None:
        from medload.bench.ingest_scaling import plot_ingest_scaling

        plot_ingest_scaling(curve, axes[0][panels - 1])
    names = list(dict.fromkeys(r["contender"] for s in secs for r in s["rows"]))
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    for ax, sec in zip(axes[0], secs):
        def group(r: dict) -> int:
            return r["num_workers"] if r["threads"] is None else (0 if r["threads"] == 1 else r["threads"])

        groups = sorted({group(r) for r in sec["rows"]})
        width = 0.8 / max(1, len(names))
        for gi, g in enumerate(groups):
            missing = []
            for ni, n in enumerate(names):
                r = next((r for r in sec["rows"] if r["contender"] == n and group(r) == g), None)
                if r is None:
                    continue
                x = gi + (ni - (len(names) - 1) / 2) * width
                if r["status"] == "ok":
                    ax.bar(x, r["samples_per_s"], width, color=colors[n],
                           yerr=[[r["samples_per_s"] - r["samples_per_s_min"]],
                                 [r["samples_per_s_max"] - r["samples_per_s"]]], capsize=2)
                else:
                    missing.append(f"{display_name(n)}: {r['status']}")
            if missing:
                ax.annotate("\n".join(missing), (gi, 0), xycoords=("data", "axes fraction"), xytext=(0, 4),
                            textcoords="offset points", ha="center", va="bottom", fontsize=7, color="red")
        ax.set_xticks(range(len(groups)), [f"{g} workers\n(ceilings: {max(1, g)} thread{'s' if g > 1 else ''})"
                                           for g in groups])
        ax.set_yscale("log")
        ax.set_ylabel("samples/s (median, min-max)")
        shape = "x".join(str(n) for n in sec["sample_shape"])
        ax.set_title(f"{KIND_LABEL.get(sec['kind'], sec['kind'])} samples ({shape}), batch {sec['batch_size']}, "
                     f"on {sec['device']}")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    if handles:
        fig.legend(handles, [display_name(n) for n in names], loc="lower center", ncol=min(5, len(names)), fontsize=8)
    m = results.get("config", {}).get("machine", {})
    fig.suptitle(f"{results.get('config', {}).get('command', 'medload bench')} -- {m.get('cpu', '')}, "
                 f"{m.get('cores', '?')} cores, {results.get('config', {}).get('date', '')}", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    path = Path(path)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return path
