"""The issue's goals as verdicts over the systems' summaries, each with its measured figures."""

from __future__ import annotations

import dataclasses

from benchmarks.traffic_stats import NotRun, SystemSummary

#: The issue's figures to show.
MIN_HIT_RATE = 0.95
MIN_DECODE_RATIO = 0.98


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One goal: what it asks, the figures measured for it (None where a figure is missing), met."""

    goal: str
    measured: dict[str, float | None]
    met: bool


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _complete(summary: SystemSummary | NotRun | None) -> SystemSummary | None:
    """The summary of a system that ran the whole plan, else None."""
    return summary if isinstance(summary, SystemSummary) and summary.error is None else None


def checks(summaries: dict[str, SystemSummary | NotRun]) -> dict[str, Verdict]:
    """The issue's 'must show' items for agent traffic, each with its measured figures."""
    disk = summaries.get("ds4disk")
    out: dict[str, Verdict] = {}
    if isinstance(disk, SystemSummary) and disk.hit_rate_after_warm_up is not None:
        out["ds4disk_hit_rate_after_warm_up"] = Verdict(
            f"ds4disk's hit rate after warm-up >= {MIN_HIT_RATE}",
            {
                "value": disk.hit_rate_after_warm_up,
                "ceiling_of_the_plan": disk.hit_rate_ceiling_after_warm_up,
            },
            disk.hit_rate_after_warm_up >= MIN_HIT_RATE,
        )
    disk = _complete(disk)
    mem = _complete(summaries.get("memory"))
    single = _complete(summaries.get("single-session"))
    if disk is not None and mem is not None:
        after = _ratio(mem.ttft_after_restart.median_s, disk.ttft_after_restart.median_s)
        first = _ratio(mem.ttft_first_after_restart.median_s, disk.ttft_first_after_restart.median_s)
        out["beats_memory_across_restart"] = Verdict(
            "ds4disk's median TTFT after the restart, and on each conversation's first turn after "
            "it, below vLLM's memory-only prefix cache",
            {
                "ttft_median_after_restart_ratio_memory_over_ds4disk": after,
                "first_turn_after_restart_ratio_memory_over_ds4disk": first,
            },
            after is not None and first is not None and after > 1 and first > 1,
        )
        dec = _ratio(disk.decode_tokens_per_s_median, mem.decode_tokens_per_s_median)
        out["decode_ds4disk_over_memory"] = Verdict(
            f"decode tokens/s with ds4disk >= {MIN_DECODE_RATIO} of without",
            {"value": dec},
            dec is not None and dec >= MIN_DECODE_RATIO,
        )
    if disk is not None and single is not None:
        # Both the typical turn (median) and the whole phase (the sum, where the slow turns
        # count too) must be faster, before and after the restart.
        ratios = {
            f"ttft_{stat}_ratio_single_over_ds4disk_{phase}": _ratio(
                getattr(getattr(single, f"ttft_{phase}"), f"{stat}_s"),
                getattr(getattr(disk, f"ttft_{phase}"), f"{stat}_s"),
            )
            for stat in ("median", "total")
            for phase in ("before_restart", "after_restart")
        }
        out["beats_single_session_throughout"] = Verdict(
            "ds4disk's median and total TTFT below the single-session policy's, before and after the restart",
            ratios,
            all(v is not None and v > 1 for v in ratios.values()),
        )
        a, b = disk.bytes_written_per_reused_token, single.bytes_written_per_reused_token
        out["fewer_bytes_written_per_reused_token_than_single_session"] = Verdict(
            "fewer bytes written per reused token than the single-session policy",
            {"ds4disk": a, "single_session": b},
            a is not None and b is not None and a < b,
        )
    return out
