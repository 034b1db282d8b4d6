"""How ingest throughput grows with the cores: medload at 1, 2, 4, ... workers up to every core of the
machine, next to pydicom read+decode in as many processes (issue 32's own table), from the rows of one
ingest section (:mod:`medload.bench.ingest`).

For each worker count the curve gives files/s, the speed-up over the count of 1 (medload's also over one
worker pinned to one core: one worker decodes on one core while its task process writes on another, so
"x 1 worker" understates what each added core brings), medload against pydicom at the same count, the
cores its process tree kept busy and the ingest process's files per CPU-second (the serial part, which
bounds how many workers it can feed).
"""

from __future__ import annotations

from typing import Any

from medload.bench.report import TableSpec, fmt_int, fmt_ratio

__all__ = ["PINNED", "worker_counts", "medload_row", "pydicom_row", "scaling_curve", "scaling_table", "plot_ingest_scaling"]

PINNED = "medload ingest (1 worker, pinned to 1 core)"
"""One worker with its whole process tree on one CPU: one core's throughput, the baseline of the scaling target."""


def worker_counts(cores: int) -> list[int]:
    """1, the powers of two below ``cores``, and ``cores``: 1, 2, 4, 8, 16 on 16 cores; 1, 2, 4, 6 on 6."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return [*counts, max(1, cores)]


def medload_row(n: int) -> str:
    """The name of the (warm, local) medload row at ``n`` workers."""
    return f"medload ingest ({n} worker{'s' if n > 1 else ''})"


def pydicom_row(n: int) -> str:
    """The name of the (warm) pydicom read+decode row in ``n`` processes."""
    return f"pydicom read+decode ({n} proc{'s' if n > 1 else ''})"


def scaling_curve(rows: list[dict], counts: list[int]) -> list[dict[str, Any]]:
    """One point per worker count in ``counts`` from the section's ``rows`` (a failed row gives None)."""
    ok = {r["contender"]: r for r in rows if r.get("status") == "ok"}

    def rate(name: str) -> float | None:
        return (ok.get(name) or {}).get("files_per_s")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    one, peer_one, pinned = rate(medload_row(1)), rate(pydicom_row(1)), rate(PINNED)
    curve = []
    for n in counts:
        own, peer, row = rate(medload_row(n)), rate(pydicom_row(n)), ok.get(medload_row(n)) or {}
        curve.append({"workers": n, "medload_files_per_s": own, "pydicom_files_per_s": peer,
                      "medload_x_1": ratio(own, one), "medload_x_pinned": ratio(own, pinned),
                      "pydicom_x_1": ratio(peer, peer_one), "medload_x_pydicom": ratio(own, peer),
                      "cores_busy": row.get("cores_busy"),
                      "ingest_process_files_per_cpu_s": row.get("ingest_process_files_per_cpu_s")})
    return curve


def scaling_table(sec: dict) -> TableSpec:
    """The curve of one ingest section as a table."""
    t = TableSpec(f"Ingest scaling: files/s by workers (medload) and processes (pydicom read+decode), "
                  f"{sec['files']} files, {sec['cores']} cores",
                  ["workers", "medload files/s", "x 1 worker", "x 1 worker pinned", "pydicom files/s", "x 1 proc",
                   "medload x pydicom", "cores busy", "ingest process files per CPU-s"])
    for p in sec["scaling"]:
        busy = p.get("cores_busy")
        t.add([str(p["workers"]), fmt_int(p["medload_files_per_s"]), fmt_ratio(p["medload_x_1"]),
               fmt_ratio(p["medload_x_pinned"]), fmt_int(p["pydicom_files_per_s"]), fmt_ratio(p["pydicom_x_1"]),
               fmt_ratio(p["medload_x_pydicom"]), "-" if busy is None else f"{busy:.2f}",
               fmt_int(p["ingest_process_files_per_cpu_s"])])
    t.notes.append("The pinned row runs one worker's whole process tree on one CPU: the throughput of one core, "
                   "so 'x 1 worker pinned' is how many cores' worth the N workers deliver.")
    return t


def plot_ingest_scaling(sec: dict, ax) -> None:
    """files/s against workers (log-log): medload, pydicom, and the line of one pinned core per worker."""
    curve = sec["scaling"]
    counts = [p["workers"] for p in curve]
    for key, label, style in (("medload_files_per_s", "medload ingest", "o-"),
                              ("pydicom_files_per_s", "pydicom read+decode", "s--")):
        points = [(p["workers"], p[key]) for p in curve if p[key]]
        if points:
            ax.plot(*zip(*points), style, label=label)
    pinned = next(((p["medload_files_per_s"] / p["medload_x_pinned"]) for p in curve
                   if p["medload_x_pinned"] and p["medload_files_per_s"]), None)
    if pinned:
        ax.plot(counts, [pinned * n for n in counts], ":", color="grey", label="one pinned core per worker")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel("workers (medload) / processes (pydicom)")
    ax.set_ylabel("files/s (median)")
    ax.set_title(f"Ingest scaling: {sec['files']} files on {sec['cores']} cores", fontsize=10)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
