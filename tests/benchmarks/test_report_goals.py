"""Issue 11: how the agent-traffic report judges its goals.

Pure logic on records and summaries written by hand: the plan's hit-rate ceiling (text no cache
could have held), and what "beats the single-session policy throughout" asks.
"""

from __future__ import annotations

import dataclasses

from benchmarks.agent_traffic import RequestRecord
from benchmarks.traffic_runner import DiskFigures, StartFailure
from benchmarks.traffic_stats import SystemSummary, Ttft, UsageFieldsPresent, hit_rate_ceiling, new_tokens
from benchmarks.traffic_verdicts import checks


def record(index: int, conversation: str, kind: str, prompt: int, completion: int = 10, hit: int = 0):
    return RequestRecord(
        index=index,
        phase=0,
        conversation=conversation,
        kind=kind,
        turn=1,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=hit,
        hit_tokens=hit,
        miss_tokens=prompt - hit,
        disk_tokens=0,
        ttft_s=0.1,
        total_s=0.2,
        decode_tokens_per_s=None,
        reply="",
    )


RECORDS = [
    record(0, "a", "main", 1000),  # warm-up: system prompt + task
    record(1, "b", "main", 1010),  # warm-up
    record(2, "a", "main", 1200, hit=1005),  # 1200 - (1000 + 10): 190 new
    record(3, "one-off-1", "one-off", 300),  # all 300 new
    record(4, "a/sub", "subagent", 1040, hit=1000),  # beyond the shortest warm-up prompt: 40 new
    record(5, "b", "main", 1015, hit=1015),  # shorter than b's prompt + reply: nothing new
]
WARM = {0, 1}


def test_new_tokens_are_what_the_server_never_saw():
    assert new_tokens(RECORDS, WARM) == 190 + 300 + 40 + 0


def test_the_ceiling_is_the_hit_rate_of_a_cache_missing_only_those():
    after_warm_prompt = 1200 + 300 + 1040 + 1015
    assert hit_rate_ceiling(RECORDS, WARM) == 1 - 530 / after_warm_prompt


def summary(phase_medians: tuple[float, float], phase_totals: tuple[float, float]) -> SystemSummary:
    """A whole-plan summary whose TTFTs before and after the restart are the given ones."""
    (before, after) = (Ttft(m, m, t) for m, t in zip(phase_medians, phase_totals, strict=True))
    usage = UsageFieldsPresent(True, True, True, True)
    return SystemSummary(
        requests=10,
        ttft=before,
        ttft_after_warm_up=before,
        ttft_before_restart=before,
        ttft_after_restart=after,
        ttft_first_after_restart=after,
        prompt_tokens=10_000,
        computed_tokens=1_000,
        reused_tokens=9_000,
        disk_tokens=0,
        hit_rate=0.9,
        hit_rate_after_warm_up=0.9,
        hit_rate_ceiling_after_warm_up=0.95,
        hit_rate_before_restart=0.9,
        hit_rate_after_restart=0.9,
        hit_rate_first_after_restart=0.9,
        disk_bytes_written=5.4e6,
        disk_bytes_read=1e6,
        bytes_written_per_reused_token=600.0,
        bytes_read_per_reused_token=111.0,
        files_evicted_budget=0.0,
        disk=DiskFigures(),
        decode_tokens_per_s_median=20.0,
        usage_fields_present=usage,
        server_start_s=[20.0, 20.0],
        counters={},
    )


def beats_single(disk: SystemSummary, single: SystemSummary) -> bool:
    return checks({"ds4disk": disk, "single-session": single})["beats_single_session_throughout"].met


def test_beating_the_single_session_policy_needs_faster_medians_and_totals_in_both_phases():
    disk = summary((0.30, 0.35), (20.0, 24.0))
    assert beats_single(disk, summary((0.33, 0.36), (23.0, 26.0)))
    # a faster typical turn, but slower overall after the restart (its slow turns)
    assert not beats_single(disk, summary((0.33, 0.36), (23.0, 23.5)))
    # slower overall is not enough without a faster typical turn
    assert not beats_single(disk, summary((0.33, 0.35), (23.0, 26.0)))


def test_a_system_that_stopped_early_is_not_judged_against_another() -> None:
    stopped = dataclasses.replace(
        summary((0.30, 0.35), (20.0, 24.0)), error=StartFailure("B did not start", "b.log", [])
    )
    assert "beats_single_session_throughout" not in checks(
        {"ds4disk": stopped, "single-session": summary((0.33, 0.36), (23.0, 26.0))}
    )
    # its hit rate is still shown (over the requests that ran)
    assert checks({"ds4disk": stopped})["ds4disk_hit_rate_after_warm_up"].measured["value"] == 0.9
