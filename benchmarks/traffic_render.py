"""The report's plots and Markdown tables."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.agent_traffic import TrafficConfig, plan_traffic
from benchmarks.report_data import Report
from benchmarks.traffic_runner import SystemRun
from benchmarks.traffic_stats import SystemSummary, missed
from benchmarks.traffic_verdicts import MIN_HIT_RATE, Verdict


def plot(runs: dict[str, SystemRun], config: TrafficConfig, out: Path) -> list[str]:
    """TTFT by request and cumulative hit rate for every system that ran; the restart marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {name: run.records for name, run in runs.items() if run.records}
    if not ran:
        return []
    restart_at = next((r.index for r in plan_traffic(config) if r.phase == 1), None)
    files = []
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, records in ran.items():
        ax.plot([r.index for r in records], [r.ttft_s for r in records], marker="o", ms=3, label=name)
    if restart_at is not None:
        ax.axvline(restart_at - 0.5, color="grey", ls="--", label="restart")
    ax.set_yscale("log")
    ax.set_xlabel("request (plan order)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Agent traffic: time to first token per request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_by_request.png", dpi=110)
    plt.close(fig)
    files.append("ttft_by_request.png")

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, records in ran.items():
        hit = total = 0
        xs, ys = [], []
        for r in records:
            hit += r.reused_tokens
            total += r.reused_tokens + missed(r)
            xs.append(r.index)
            ys.append(hit / total if total else 0.0)
        ax.plot(xs, ys, marker=".", label=f"{name} (cumulative)")
    if restart_at is not None:
        ax.axvline(restart_at - 0.5, color="grey", ls="--", label="restart")
    ax.axhline(MIN_HIT_RATE, color="black", lw=0.7, ls=":", label=f"{MIN_HIT_RATE}")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("request (plan order)")
    ax.set_ylabel("hit / (hit + miss)")
    ax.set_title("Agent traffic: prompt-cache hit rate over the run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    files.append("hit_rate.png")
    return files


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        if abs(v) >= 1e6:
            return f"{v / 2**20:.1f} MiB"
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def _figures(verdict: Verdict) -> str:
    return ", ".join(f"{name}={_cell(value)}" for name, value in verdict.measured.items())


def markdown(report: Report) -> str:
    traffic = report.agent_traffic
    ran = {k: s for k, s in traffic.systems.items() if isinstance(s, SystemSummary)}
    rows: list[tuple[str, Callable[[SystemSummary], str]]] = [
        ("TTFT median / p90 (s)", lambda s: f"{_cell(s.ttft.median_s)} / {_cell(s.ttft.p90_s)}"),
        ("TTFT median after restart (s)", lambda s: _cell(s.ttft_after_restart.median_s)),
        ("TTFT, first turn after restart (s)", lambda s: _cell(s.ttft_first_after_restart.median_s)),
        ("prompt tokens computed / reused", lambda s: f"{s.computed_tokens} / {s.reused_tokens}"),
        ("  of them from disk", lambda s: str(s.disk_tokens)),
        (
            "hit rate (all / after warm-up)",
            lambda s: f"{_cell(s.hit_rate)} / {_cell(s.hit_rate_after_warm_up)}",
        ),
        ("  the plan's ceiling after warm-up", lambda s: _cell(s.hit_rate_ceiling_after_warm_up)),
        ("hit rate, first turn after restart", lambda s: _cell(s.hit_rate_first_after_restart)),
        (
            "disk bytes written / read",
            lambda s: f"{_cell(s.disk_bytes_written)} / {_cell(s.disk_bytes_read)}",
        ),
        (
            "bytes written / read per reused token",
            lambda s: f"{_cell(s.bytes_written_per_reused_token)} / {_cell(s.bytes_read_per_reused_token)}",
        ),
        (
            "files written / removed (budget evictions)",
            lambda s: f"{s.disk.files_seen} / {s.disk.files_removed} ({_cell(s.files_evicted_budget)})",
        ),
        ("peak disk use", lambda s: _cell(float(s.disk.peak_disk_bytes))),
        ("decode tokens/s (median)", lambda s: _cell(s.decode_tokens_per_s_median)),
    ]
    versions = report.machine.get("versions", {})
    lines = [
        f"# Benchmark report {report.date} ({report.mode})",
        "",
        f"Machine: {report.machine.get('cpu_count')} CPUs, load average "
        f"{report.load_average_start} at start, {report.load_average_end} at end; "
        f"vllm {versions.get('vllm')}, torch {versions.get('torch')}.",
        "",
        "## Agent traffic",
        "",
        f"Plan (seed {traffic.config.seed}): {json.dumps(traffic.plan)}.",
        "Warm-up = each main conversation's first request. Ratios are within this one run.",
        "",
        "| figure | " + " | ".join(ran) + " |",
        "|---|" + "---|" * len(ran),
    ]
    lines += [f"| {label} | " + " | ".join(fn(s) for s in ran.values()) + " |" for label, fn in rows]
    lines.append("")
    for name, summary in traffic.systems.items():
        if summary.error is not None:
            what = "stopped early (partial figures above)" if name in ran else "did not run"
            lines.append(f"**{name}** {what}: {summary.error.message}")
            lines += [f"    {ln}" for ln in summary.error.error_lines]
            lines.append("")
    lines += ["### Goals", "", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {v.goal} | {_figures(v)} | {_cell(v.met)} |" for v in traffic.checks.values()]
    lines += ["", *[f"![{p}]({p})" for p in traffic.plots], ""]
    for name, part in report.parts.items():
        lines += part_markdown(name, part)
    return "\n".join(lines)


def part_markdown(name: str, part: dict[str, Any]) -> list[str]:
    """An optional part's section: its own tables (``table_markdown``) and ``plots``, or why it was skipped."""
    lines = [f"## {name}", ""]
    if "skipped" in part:
        return [*lines, f"Skipped: {part['skipped']}", ""]
    if part.get("table_markdown"):
        lines += [part["table_markdown"], ""]
    lines += [f"![{p}]({p})" for p in part.get("plots", [])]
    return [*lines, ""]
