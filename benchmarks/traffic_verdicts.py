"""The issue's goals as verdicts over the systems' summaries, each with its measured ratio."""

from __future__ import annotations

from typing import Any

#: The issue's figures to show.
MIN_HIT_RATE = 0.95
MIN_DECODE_RATIO = 0.98


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def checks(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's 'must show' items for agent traffic, each with its measured figures."""
    disk, mem, single = (summaries.get(k, {}) for k in ("ds4disk", "memory", "single-session"))
    out: dict[str, Any] = {}

    def ok(*values: Any) -> bool:
        return all(v is not None for v in values)

    if ok(disk.get("hit_rate_after_warm_up")):
        out["ds4disk_hit_rate_after_warm_up"] = {
            "value": disk["hit_rate_after_warm_up"],
            "goal": f">= {MIN_HIT_RATE}",
            "ceiling_of_the_plan": disk.get("hit_rate_ceiling_after_warm_up"),
            "met": disk["hit_rate_after_warm_up"] >= MIN_HIT_RATE,
        }
    if "ttft" in disk and "ttft" in mem and "error" not in mem and "error" not in disk:
        a, b = disk["ttft_phase"]["1"]["median_s"], mem["ttft_phase"]["1"]["median_s"]
        c, d = disk["ttft_first_after_restart"]["median_s"], mem["ttft_first_after_restart"]["median_s"]
        out["beats_memory_across_restart"] = {
            "ttft_median_after_restart_ratio_memory_over_ds4disk": _ratio(b, a),
            "first_turn_after_restart_ratio_memory_over_ds4disk": _ratio(d, c),
            "met": ok(a, b, c, d) and a < b and c < d,
        }
        dec = _ratio(disk["decode_tokens_per_s_median"], mem["decode_tokens_per_s_median"])
        out["decode_ds4disk_over_memory"] = {
            "value": dec,
            "goal": f">= {MIN_DECODE_RATIO}",
            "met": dec is not None and dec >= MIN_DECODE_RATIO,
        }
    if "ttft" in disk and "ttft" in single and "error" not in single and "error" not in disk:
        # Both the typical turn (median) and the whole phase (the sum, where the slow turns
        # count too) must be faster, before and after the restart.
        medians, totals = (
            {ph: _ratio(single["ttft_phase"][ph][key], disk["ttft_phase"][ph][key]) for ph in ("0", "1")}
            for key in ("median_s", "total_s")
        )
        a, b = disk["bytes_written_per_reused_token"], single["bytes_written_per_reused_token"]
        out["beats_single_session_throughout"] = {
            "ttft_median_ratio_single_over_ds4disk_by_phase": medians,
            "ttft_total_ratio_single_over_ds4disk_by_phase": totals,
            "met": all(v is not None and v > 1 for v in [*medians.values(), *totals.values()]),
        }
        out["fewer_bytes_written_per_reused_token_than_single_session"] = {
            "ds4disk": a,
            "single_session": b,
            "met": ok(a, b) and a < b,
        }
    return out
