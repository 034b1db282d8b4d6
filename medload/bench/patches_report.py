"""Tables of the 3D patch section (:mod:`medload.bench.patches`), from its results dict."""

from __future__ import annotations

from medload.bench.report import TableSpec, _short, _status, display_name, fmt_int, fmt_pct, fmt_rate, fmt_ratio
from medload.bench.scale_report import targets_table

__all__ = ["patch_tables"]


def _title(sec: dict, train: bool) -> str:
    patch = "x".join(str(n) for n in sec["patch"])
    head = (f"3D patches: batches of {sec['batch_size']} x {patch} at {sec['spacing']:g} mm isotropic (RAS), "
            f"{sec['foreground']:.0%} on a label, augmented; {sec['series']} anisotropic oblique/feet-first series of "
            f"{sec['slices']} x {sec['size']}x{sec['size']}, store {sec['store_gb']:.2f} GB ({sec['x_l1']:.1f}x the "
            f"{sec['l1']} L1)")
    if train:
        return head + f"; training a DynUNet on {sec['device']} (bf16 autocast), % of the resident-batch ceiling"
    return head + (f"; page cache warm or cold (dropped before each pass); median of {sec['repeats']} passes of up "
                   f"to {sec['batches']} batches (min-max)")


def _table(sec: dict, train: bool) -> TableSpec:
    rows = [r for r in sec["rows"] if bool(r.get("train")) == train]
    t = TableSpec(_title(sec, train), ["page cache", "workers", "contender", "patches/s (min-max)", "x best peer",
                                       "% of ceiling" if train else "MB from disk / patch", "MB decoded / patch",
                                       "peak PSS MB"])
    for r in rows:
        head = [r["mode"], str(r["num_workers"]), display_name(r["contender"])]
        if r["status"] != "ok":
            t.add(head + [_short(r), "", "", "", fmt_int(r.get("peak_pss_mb"))], failed=r["status"] == "failed")
            t.notes.append(f"{r['contender']}, {r['num_workers']} workers, {r['mode']}: {_status(r)}")
            continue
        rate = f"{fmt_rate(r['patches_per_s'])} ({fmt_rate(r['patches_per_s_min'])}-{fmt_rate(r['patches_per_s_max'])})"
        best = f"{fmt_ratio(r['x_best_peer'])} ({display_name(r['best_peer'])})" if r.get("x_best_peer") else ""
        third = fmt_pct(r.get("pct_of_ceiling") / 100 if r.get("pct_of_ceiling") else None) if train else \
            f"{r['mb_read_per_patch']:.2f}"
        decoded = "" if r.get("decoded_mb") is None else f"{r['decoded_mb']:.1f}"
        t.add(head + [rate, best, third, decoded, fmt_int(r.get("peak_pss_mb"))])
    if not train:
        sizes = ", ".join(f"{name} {gb:.2f} GB" for name, gb in sec.get("data_gb", {}).items())
        t.notes.append("MB decoded / patch: by format (medload: whole stored slices the patch reaches; nnU-Net: "
                       f"blosc2 chunks its initial patch overlaps; PersistentDataset: one cached volume; "
                       f"CacheDataset: none, volumes in RAM). Data: {sizes}.")
    return t


def patch_tables(results: dict) -> list[TableSpec]:
    """The section's tables (loading, training where run, targets), or one line saying why it did not run."""
    sec = results.get("patches")
    if sec is None:
        return []
    if sec.get("status") != "ok":
        return [TableSpec("3D patches", ["section"], [[_status(sec)]], [sec.get("status") == "failed"])]
    out = [_table(sec, False)]
    if any(r.get("train") for r in sec["rows"]):
        out.append(_table(sec, True))
    if results.get("patch_targets"):
        out.append(targets_table(results["patch_targets"], "3D patch targets, read from the rows above"))
    return out
