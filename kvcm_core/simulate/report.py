"""The report of ``kvcm simulate``: one JSON document, a rich table and PNG plots.

matplotlib is imported only to draw, and only if installed (``pip install kvcm[plot]``);
without it the plots are skipped with a note.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvcm_core.console import atomic_output
from kvcm_core.simulate.runner import RunResult, kind_rates, percentiles

__all__ = ["build_report", "print_report", "write_json", "write_plots"]


def _run_dict(res: RunResult) -> dict[str, Any]:
    reused = res.reused_blocks_by_level
    total_reused = sum(reused)
    if total_reused:
        by_level: list[float | None] = [res.hit_rate * n / total_reused for n in reused]
    elif len(res.levels) == 1:
        by_level = [res.hit_rate]
    else:  # the manager did not say where reused blocks came from
        by_level = [None] * len(res.levels)
    calls = {k: {"calls": v[0], "total_s": v[1] / 1e9,
                 "mean_us": v[1] / v[0] / 1e3 if v[0] else 0.0}
             for k, v in sorted(res.manager_ns.items())}
    manager_ns = sum(v[1] for v in res.manager_ns.values())
    return {
        "label": res.label,
        "levels": res.levels,
        "steps": res.steps,
        "wall_s": res.wall_s,
        "requests_finished": res.finished,
        "hit_rate": {
            "overall": res.hit_rate,
            "by_level": by_level,
            "by_kind": kind_rates(res),
            "lookup_tokens": res.lookup_tokens,
            "hit_tokens": res.hit_tokens,
        },
        # Lookups again of a request, apart from the hit rate (first lookups only).
        "relookups": {
            "after_preemption": {
                "description": "the request ran, was preempted by recompute (or lost cold "
                               "pages) and looked up its prompt again",
                "lookups": res.relookups, "lookup_tokens": res.relookup_tokens,
                "hit_tokens": res.relookup_hit_tokens},
            "admission_retries": {
                "description": "the request's admission was refused before it ran (no "
                               "room) and retried with a new lookup",
                "lookups": res.retry_lookups, "lookup_tokens": res.retry_lookup_tokens,
                "hit_tokens": res.retry_hit_tokens},
        },
        "reused_blocks_by_level": reused,
        "bytes_moved": {
            "onboard_bytes": res.onboard_bytes, "onboard_blocks": res.onboard_blocks,
            "offload_bytes": res.offload_bytes, "offload_blocks": res.offload_blocks,
            "intra_device_copies": res.intra_device_copies,
        },
        "evictions": {"dropped_blocks": res.dropped_blocks,
                      "dropped_before_reuse": res.dropped_before_reuse},
        "preemptions": res.preemptions,
        "storage_io": res.storage_io,
        "timing": {
            "manager_s": manager_ns / 1e9,
            "manager_us_per_step": percentiles(res.manager_ns_per_step, 1e-3),
            "manager_us_per_request": percentiles(
                list(res.manager_ns_per_request.values()), 1e-3),
            "manager_calls": calls,
            "fingerprint_s": res.fingerprint_ns / 1e9,
        },
        "verification": {
            "steps_checked": res.steps_checked,
            "steps_fully_checked": res.steps_fully_checked,
            "fresh_request_checks": res.fresh_checks,
            "pages_checked": res.pages_checked,
            "pages_written": res.pages_written,
            "invariant_checks": res.invariant_checks,
            **({"sparse": res.sparse} if res.sparse else {}),
        },
        # What the run exercised (SSM snapshots, lossy codecs, multimodal requests, the
        # engine's Batch.resize / Batch.move, speculative rewinds); {} when none applies.
        "features": res.features,
        "series": res.series,
    }


def build_report(*, meta: dict[str, Any], workload: dict[str, Any],
                 main: RunResult | None, gpu_only: RunResult | None,
                 bound: dict[str, Any] | None, error: str | None,
                 speculative: RunResult | None = None) -> dict[str, Any]:
    """The whole report as plain data (what is written as JSON)."""
    mode = meta.get("verification", {"mode": "full", "verify_every": 1,
                                      "description": "every page checked at every step"})
    out: dict[str, Any] = {"meta": meta, "workload": workload,
                           "verification": {"ok": error is None, "error": error},
                           "verification_mode": mode}
    run = _run_dict(main) if main is not None else None
    out["run"] = run
    out["gpu_only"] = _run_dict(gpu_only) if gpu_only is not None else None
    out["infinite_bound"] = bound
    # The companion run of a model with SSM layers that asked for rewinds (none else).
    out["speculative"] = _run_dict(speculative) if speculative is not None else None
    summary: dict[str, Any] = {}
    if main is not None:
        summary["hit_rate"] = main.hit_rate
    if bound is not None:
        summary["infinite_bound"] = bound["hit_rate"]
        if main is not None and bound["hit_rate"]:
            summary["fraction_of_bound"] = main.hit_rate / bound["hit_rate"]
    if bound is not None and "trace" in bound:
        summary["trace_infinite_hit_rate"] = bound["trace"]["hit_rate"]
    if gpu_only is not None:
        summary["gpu_only_hit_rate"] = gpu_only.hit_rate
        if bound is not None and bound["hit_rate"]:
            summary["gpu_only_fraction_of_bound"] = gpu_only.hit_rate / bound["hit_rate"]
    out["summary"] = summary
    return out


def write_json(report: dict[str, Any], path: Path) -> None:
    """Write ``report`` to ``path`` in one step: a failed write leaves the previous file.

    Raises:
        OutputError: the file cannot be written (named, with the reason).
    """
    text = json.dumps(report, indent=1, default=str) + "\n"
    with atomic_output(path) as tmp:
        tmp.write_text(text)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


#: Printed under the table (wrapped to the terminal): what its less obvious rows mean.
TABLE_LEGEND = (
    "legend: hit rate = prompt tokens reused / prompt tokens looked up, at each request's "
    "first lookup (a lookup again after a preemption or a refused admission is not "
    "counted: report.json's run.relookups), so it is the prompt share a request found "
    "cached on arrival, not the prefill the run saved; / bound = that over the "
    "infinite-cache hit rate "
    "(column 'infinite': one unbounded cache replaying the run's requests in order); "
    "trace infinite = the trace file's own bound in file order; from Ln = the part reused "
    "from pages found on level n; evicted = blocks evicted from every level, never reused "
    "= those of them no request reused; mgr µs/step = the manager's time in one engine "
    "step, all running requests together (its calls, the batch's publish included); "
    "µs/request = over a request's whole life; mean / p99 = the average and the 99th "
    "percentile over the steps (requests) of the run; steps = engine steps that ran (idle "
    "stretches waiting for an arrival not counted)")

#: The widest the table may be: it fits an 80-column terminal.
TABLE_WIDTH = 80


def print_report(report: dict[str, Any], console: Console) -> None:
    """The report as a table of at most :data:`TABLE_WIDTH` columns: one column for the
    run, one for the GPU-only comparison, one for the infinite-cache bound; one figure a
    cell, never cut."""
    run, gpu, bound = report["run"], report["gpu_only"], report["infinite_bound"]
    wl = report["workload"]
    source = f" of {Path(wl['trace_file']).name}" if wl.get("trace_file") else ""
    title = (f"kvcm simulate: {wl['requests']} requests{source} "
             f"({', '.join(f'{n} {k}' for k, n in wl['by_kind'].items())}); "
             f"working set {_bytes(wl['working_set_bytes'])}")
    # The title is a line of its own: as a table title it would wrap to the table's width.
    console.print(escape(title), highlight=False)
    table = Table(show_lines=False)
    table.add_column("", no_wrap=True)
    cols = [r for r in (run, gpu) if r is not None]
    for r in cols:
        table.add_column(r["label"], justify="right", no_wrap=True)
    if bound is not None:
        table.add_column("infinite", justify="right", no_wrap=True)

    def row(name: str, values: list[str], bound_value: str = "") -> None:
        table.add_row(name, *values, *([bound_value] if bound is not None else []))

    nlev = max(len(r["levels"]) for r in cols) if cols else 0
    for lv in range(nlev):
        row(f"L{lv} quota", [
            f"{r['levels'][lv]['tier']} {_bytes(r['levels'][lv]['quota'])}"
            if lv < len(r["levels"]) else "" for r in cols])
    row("hit rate", [_pct(r["hit_rate"]["overall"]) for r in cols],
        _pct(bound["hit_rate"]) if bound else "")
    if bound and bound["hit_rate"]:
        row("  / bound",
            [_pct(r["hit_rate"]["overall"] / bound["hit_rate"]) for r in cols], "100%")
    if bound and "trace" in bound:
        row("  trace infinite", ["" for _ in cols], _pct(bound["trace"]["hit_rate"]))
    for lv in range(nlev):
        row(f"  from L{lv}", [
            _pct(r["hit_rate"]["by_level"][lv]) if lv < len(r["levels"]) else "" for r in cols])
    for kind in wl["by_kind"]:
        row(f"  {kind}", [_pct(r["hit_rate"]["by_kind"][kind]) for r in cols],
            _pct(bound["by_kind"][kind]) if bound else "")
    row("onboard", [_bytes(r["bytes_moved"]["onboard_bytes"]) for r in cols])
    row("offload", [_bytes(r["bytes_moved"]["offload_bytes"]) for r in cols])
    row("evicted blocks", [str(r["evictions"]["dropped_blocks"]) for r in cols])
    row("  never reused", [str(r["evictions"]["dropped_before_reuse"]) for r in cols])
    row("preemptions", [str(r["preemptions"]) for r in cols])
    row("steps", [str(r["steps"]) for r in cols])
    for what, key in (("step", "manager_us_per_step"), ("request", "manager_us_per_request")):
        for stat in ("mean", "p99"):
            row(f"mgr µs/{what} {stat}", [f"{r['timing'][key][stat]:.0f}" for r in cols])
    row("manager s", [f"{r['timing']['manager_s']:.2f}" for r in cols])
    row("fingerprint s", [f"{r['timing']['fingerprint_s']:.2f}" for r in cols])
    row("pages checked", [f"{r['verification']['pages_checked']:,}" for r in cols])
    row("wall time", [f"{r['wall_s']:.1f} s" for r in cols],
        f"{bound['wall_s']:.1f} s" if bound else "")
    console.print(table)
    console.print(TABLE_LEGEND, highlight=False)
    for r in (run, gpu, report.get("speculative")):
        if r is not None and r.get("features"):
            counts = ", ".join(f"{k} {v:,}" for k, v in r["features"].items())
            console.print(f"exercised ({escape(r['label'])}): {escape(counts)}",
                          highlight=False)
    for note in report["meta"].get("notes", []):
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    ver = {**report.get("verification_mode", {}), **report["verification"]}
    if report.get("speculative") is not None:
        cols = [*cols, report["speculative"]]
    if ver["ok"] and ver.get("mode", "full") == "full":
        steps = sum(r["verification"]["steps_checked"] for r in cols)
        console.print(f"[green]verified (full):[/] every page checked at every step "
                      f"({steps} steps)")
    elif ver["ok"]:
        steps = sum(r["verification"]["steps_fully_checked"] for r in cols)
        fresh = sum(r["verification"]["fresh_request_checks"] for r in cols)
        console.print(f"[green]verified ({escape(ver['description'])}):[/] {steps} steps fully "
                      f"checked, {fresh} request checks after admission or resume")
    else:
        console.print(f"[red]VERIFICATION FAILED:[/] {escape(str(ver['error']))}")


#: One colour and marker per level (colour-blind safe Okabe-Ito colours), so that lines
#: stay apart in colour, in shape and in print.
LEVEL_STYLES = (("#0072B2", "o"), ("#D55E00", "s"), ("#009E73", "^"), ("#CC79A7", "D"),
                ("#E69F00", "v"), ("#56B4E9", "P"))
#: One line style per run: the measured run solid, the GPU-only comparison dashed.
RUN_STYLES = ("-", "--", "-.", ":")


def hit_rate_figure(report: dict[str, Any]) -> Any:
    """The hit rate over time: per run, thin per interval and thick cumulative; the
    legend beside the plot, never over the data."""
    import matplotlib.pyplot as plt

    runs = [r for r in (report["run"], report["gpu_only"]) if r is not None]
    bound = report["infinite_bound"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, r in enumerate(runs):
        s = r["series"]
        color, marker = LEVEL_STYLES[i % len(LEVEL_STYLES)]
        pts = [(x, y) for x, y in zip(s["step"], s["hit_rate"], strict=True) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, alpha=0.35, lw=1,
                ls=RUN_STYLES[i % len(RUN_STYLES)], label=f"{r['label']} (per interval)")
        ax.plot(s["step"], s["cumulative_hit_rate"], color=color, lw=2,
                ls=RUN_STYLES[i % len(RUN_STYLES)], marker=marker,
                markevery=max(1, len(s["step"]) // 12), markersize=5,
                label=f"{r['label']} (cumulative {r['hit_rate']['overall']:.3f})")
    if bound is not None:
        ax.axhline(bound["hit_rate"], color="k", ls=(0, (1, 1)), lw=1.5,
                   label=f"infinite-cache bound {bound['hit_rate']:.3f}")
    ax.set_xlabel("engine step")
    ax.set_ylabel("prefix hit rate (reused / looked-up tokens)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Prefix hit rate over time")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0, fontsize=8)
    fig.tight_layout()
    return fig


def occupancy_figure(report: dict[str, Any]) -> Any:
    """Level occupancy over time, one panel per run: per level one colour and marker,
    solid for the used slots and dotted for the evictable part; one legend beside the
    panels, never over the data."""
    import matplotlib.pyplot as plt

    runs = [r for r in (report["run"], report["gpu_only"]) if r is not None]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 + 2.2 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, r in zip(axes[:, 0], runs, strict=True):
        s = r["series"]
        every = max(1, len(s["step"]) // 12)
        for lv, occ in enumerate(s["occupancy"]):
            color, marker = LEVEL_STYLES[lv % len(LEVEL_STYLES)]
            tier = r["levels"][lv]["tier"]
            ax.plot(s["step"], occ, color=color, lw=1.8, marker=marker, markevery=every,
                    markersize=5, label=f"L{lv} {tier}: used")
            ax.plot(s["step"], s["evictable"][lv], color=color, lw=1.2, ls=":",
                    marker=marker, markevery=every, markersize=5, fillstyle="none",
                    label=f"L{lv} {tier}: evictable")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("fraction of slots")
        ax.set_title(f"{r['label']}", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("engine step")
    # Every level appears in the first run (the GPU-only one has level 0 only).
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle("Level occupancy over time (solid: used slots; dotted, hollow markers: "
                 "the evictable part)", fontsize=10)
    fig.tight_layout()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return fig


def write_plots(report: dict[str, Any], out: Path) -> list[Path] | str:
    """``hit_rate.png`` and ``occupancy.png``; returns their paths, or a note why not.

    Raises:
        OutputError: a plot cannot be written (the previous file, if any, is kept).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvcm[plot]'): plots skipped"
    paths = []
    for name, make in (("hit_rate.png", hit_rate_figure), ("occupancy.png", occupancy_figure)):
        fig = make(report)
        paths.append(out / name)
        try:
            with atomic_output(paths[-1]) as tmp:
                # "tight": the legends beside the axes are part of the picture.
                fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
        finally:
            plt.close(fig)
    return paths
