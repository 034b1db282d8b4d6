"""Tables of the GPU section (:mod:`medload.bench.gpu`) and its targets, from the run's results dict."""

from __future__ import annotations

from medload.bench.report import TableSpec, _short, _status, display_name, fmt_int, fmt_pct, fmt_rate, fmt_ratio

__all__ = ["gpu_tables"]


def _workers(r: dict) -> str:
    return f"{r['num_workers']} ({r['chose']})" if r.get("chose") is not None and r["num_workers"] == "auto" else str(
        r["num_workers"])


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _table(sec: dict) -> TableSpec:
    s, c = sec["settings"], sec["ceiling"]
    shape = "x".join(map(str, [s["batch_size"], *sec["sample_shape"]]))
    t = TableSpec(f"GPU ({sec['device_name']}): {sec['model']}, batches {shape} windowed soft tissue, "
                  f"{s['steps']} timed steps after {s['warmup']}; resident-batch ceiling "
                  f"{fmt_rate(c['samples_per_s'])} samples/s ({c['step_ms']:.1f} ms/step)",
                  ["contender", "workers", "page cache", "samples/s", "% of ceiling", "GPU busy (events)",
                   "GPU util (NVML)", "x best peer", "ms in next()", "CPU ms in next()"])
    for r in sec["rows"]:
        head = [display_name(r["contender"]), _workers(r), r["mode"]]
        if r["status"] != "ok":
            t.add(head + [_short(r)] + [""] * 6, failed=r["status"] == "failed")
            t.notes.append(f"{r['contender']}, {r['num_workers']} workers, {r['mode']}: {_status(r)}")
            continue
        best = f"{fmt_ratio(r['x_best_peer'])} ({r['best_peer']})" if r.get("x_best_peer") else ""
        t.add(head + [fmt_rate(r["samples_per_s"]), f"{r['pct_of_ceiling']:.1f}", fmt_pct(r["gpu_busy"]),
                      fmt_pct(r.get("nvml_util")), best, _ms(r["next_ms"]), _ms(r["next_cpu_ms"])])
    t.notes.append("GPU busy: CUDA-event time of the training steps over the span from the first step's start to "
                   "the last one's end; ms in next(): the training thread's wall and CPU time per batch getting it.")
    return t


def _targets(targets: list[dict]) -> TableSpec:
    t = TableSpec("GPU targets, read from the rows above", ["run", "measure", "value", "target", "met"])
    for x in targets:
        fmt = fmt_ratio if x["field"] in ("x_best_peer", "next_ms") else fmt_int
        bound = "<=" if x.get("at_most") else ">="
        t.add([x["run"], x["measure"], "-" if x["value"] is None else fmt(x["value"]), f"{bound} {fmt(x['target'])}",
               "-" if x["met"] is None else "yes" if x["met"] else "NO"], failed=x["met"] is False)
    return t


def gpu_tables(results: dict) -> list[TableSpec]:
    """The GPU section's tables (its runs, then its targets), or one line saying why it did not run."""
    sec = results.get("gpu")
    if sec is None:
        return []
    if sec.get("status") != "ok":
        return [TableSpec("GPU", ["section"], [[_status(sec)]], [sec.get("status") == "failed"])]
    out = [_table(sec)]
    if results.get("gpu_targets"):
        out.append(_targets(results["gpu_targets"]))
    return out
