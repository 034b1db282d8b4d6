"""Tables and a plot panel of the scale section (:mod:`medload.bench.scale`), from its results dict."""

from __future__ import annotations

from medload.bench.report import TableSpec, _short, _status, display_name, fmt_int, fmt_pct, fmt_rate, fmt_ratio

__all__ = ["scale_tables", "plot_scale", "targets_table"]


def _title(sec: dict) -> str:
    return (f"Loading at scale: {sec['series']} series, {sec['slices']} slices of {sec['rows_px']}x{sec['cols_px']}, "
            f"store {sec['store_gb']:.1f} GB ({sec['x_l1']:.0f}x the {sec['l1']} L1; {sec['decoded_gb']:.1f} GB "
            f"decoded); random 2.5D samples, never one twice, batches of {sec['batch_size']} windowed to float32; "
            f"page cache warm, or cold (dropped before each pass); median of {sec['repeats']} passes of up to "
            f"{sec['batches']} batches (min-max)")


def _table(sec: dict) -> TableSpec:
    t = TableSpec(_title(sec), ["page cache", "workers", "contender", "samples/s (min-max)", "x best peer",
                                "MB from disk / sample", "L1 hit rate", "peak PSS MB"])
    for r in sec["rows"]:
        head = [r["mode"], str(r["num_workers"]), display_name(r["contender"])]
        if r["status"] != "ok":
            t.add(head + [_short(r), "", "", "", fmt_int(r.get("peak_pss_mb"))], failed=r["status"] == "failed")
            t.notes.append(f"{r['contender']}, {r['num_workers']} workers, {r['mode']}: {_status(r)}")
            continue
        rate = f"{fmt_rate(r['samples_per_s'])} ({fmt_rate(r['samples_per_s_min'])}-{fmt_rate(r['samples_per_s_max'])})"
        best = f"{fmt_ratio(r['x_best_peer'])} ({display_name(r['best_peer'])})" if r.get("x_best_peer") else ""
        cache = r.get("cache") or {}
        t.add(head + [rate, best, f"{r['mb_per_sample']:.2f}", fmt_pct(cache.get("l1_hit_rate")),
                      fmt_int(r.get("peak_pss_mb"))])
    sizes = ", ".join(f"{name} {gb:.1f} GB" for name, gb in sec.get("data_gb", {}).items())
    t.notes.append(f"A sample's three slices take {sec['sample_mb']:.2f} MB in the store (compressed). Data: {sizes}.")
    return t


def targets_table(targets: list[dict], title: str = "Scale targets, read from the rows above") -> TableSpec:
    """A section's targets, each with its value, bound and whether it is met."""
    t = TableSpec(title, ["run", "measure", "value", "target", "met"])
    for x in targets:
        fmt = fmt_int if x["field"] == "peak_pss_mb" else fmt_ratio
        bound = "<=" if x.get("at_most") else ">="
        t.add([x["run"], x["measure"], "-" if x["value"] is None else fmt(x["value"]), f"{bound} {fmt(x['target'])}",
               "-" if x["met"] is None else "yes" if x["met"] else "NO"], failed=x["met"] is False)
    return t


def scale_tables(results: dict) -> list[TableSpec]:
    """The scale section's tables (the section, then its targets), or one line saying why it did not run."""
    sec = results.get("scale")
    if sec is None:
        return []
    if sec.get("status") != "ok":
        return [TableSpec("Loading at scale", ["section"], [[_status(sec)]], [sec.get("status") == "failed"])]
    out = [_table(sec)]
    if results.get("scale_targets"):
        out.append(targets_table(results["scale_targets"]))
    return out


def plot_scale(sec: dict, ax) -> None:
    """Bars of samples/s per contender, grouped by page cache mode and workers (log scale)."""
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["mode"], r["num_workers"]) for r in sec["rows"]))
    names = list(dict.fromkeys(r["contender"] for r in sec["rows"]))
    width = 0.8 / max(1, len(names))
    for ni, name in enumerate(names):
        color = plt.get_cmap("tab10")(ni % 10)
        for gi, group in enumerate(groups):
            r = next((r for r in sec["rows"] if r["contender"] == name and (r["mode"], r["num_workers"]) == group),
                     None)
            if r is not None and r["status"] == "ok":
                ax.bar(gi + (ni - (len(names) - 1) / 2) * width, r["samples_per_s"], width, color=color,
                       label=display_name(name) if gi == 0 else None,
                       yerr=[[r["samples_per_s"] - r["samples_per_s_min"]],
                             [r["samples_per_s_max"] - r["samples_per_s"]]], capsize=2)
    ax.set_xticks(range(len(groups)), [f"page cache {m}\n{w} workers" for m, w in groups])
    ax.set_yscale("log")
    ax.set_ylabel("samples/s (median, min-max)")
    ax.set_title(f"At scale: {sec['store_gb']:.1f} GB store, {sec['x_l1']:.0f}x the L1", fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
