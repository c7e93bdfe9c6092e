"""The figures of one system's run (`summarize` → `SystemSummary`): hit rates, new tokens, time
to first token, the requests after a restart."""

from __future__ import annotations

import dataclasses

from benchmarks.agent_traffic import (
    RequestRecord,
    TrafficConfig,
    plan_traffic,
)
from benchmarks.traffic_runner import DiskFigures, StartFailure, SystemRun


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _hit_rate(records: list[RequestRecord]) -> float | None:
    hit = sum(r.reused_tokens for r in records)
    total = sum(r.reused_tokens + missed(r) for r in records)
    return hit / total if total else None


def missed(r: RequestRecord) -> int:
    """Prompt tokens computed for the request (the server's miss count, or prompt less reused)."""
    return r.miss_tokens if r.miss_tokens is not None else r.prompt_tokens - r.reused_tokens


def warm_up_indices(config: TrafficConfig) -> set[int]:
    """The first round: each main conversation's first request (only the system prompt is known)."""
    return {r.index for r in plan_traffic(config) if r.kind == "main" and r.turn == 1}


def new_tokens(records: list[RequestRecord], warm: set[int]) -> int:
    """Prompt tokens after warm-up that no cache could have held: text the server never saw.

    A turn's new tokens are those beyond its conversation's previous prompt and reply (the new
    tool results and user text, plus the few tokens where the reply is re-rendered); a one-off
    prompt is new as a whole; a later conversation's first request shares the warm-up requests'
    system prompt and tools, so only its part beyond the shortest warm-up prompt is new (which
    undercounts its task's few tokens). A lower bound on any cache's misses, within a few tokens
    per request.
    """
    shared = min((r.prompt_tokens for r in records if r.index in warm), default=0)
    previous: dict[str, RequestRecord] = {}
    total = 0
    for r in sorted(records, key=lambda r: r.index):
        before = previous.get(r.conversation)
        previous[r.conversation] = r
        if r.index in warm:
            continue
        if r.kind == "one-off":
            total += r.prompt_tokens
        elif before is None:
            total += max(0, r.prompt_tokens - shared)
        else:
            total += max(0, r.prompt_tokens - before.prompt_tokens - before.completion_tokens)
    return total


def first_after_restart(records: list[RequestRecord]) -> list[RequestRecord]:
    """Each conversation's first request on the restarted server (its reuse can only come from disk)."""
    seen_before = {r.conversation for r in records if r.phase == 0}
    firsts: dict[str, RequestRecord] = {}
    for r in records:
        if r.phase == 1 and r.conversation in seen_before and r.conversation not in firsts:
            firsts[r.conversation] = r
    return list(firsts.values())


def hit_rate_ceiling(records: list[RequestRecord], warm: set[int]) -> float | None:
    """The hit rate after warm-up of a cache that missed only `new_tokens`: the plan's ceiling."""
    total = sum(r.prompt_tokens for r in records if r.index not in warm)
    return 1 - new_tokens(records, warm) / total if total else None


@dataclasses.dataclass(frozen=True)
class Ttft:
    """Time to first token over a set of requests (None where the set is empty)."""

    median_s: float | None
    p90_s: float | None
    total_s: float

    @classmethod
    def of(cls, records: list[RequestRecord]) -> Ttft:
        values = [r.ttft_s for r in records]
        return cls(_quantile(values, 0.5), _quantile(values, 0.9), sum(values))


@dataclasses.dataclass(frozen=True)
class UsageFieldsPresent:
    """Whether every response carried each usage field, and hit + miss added up to the prompt."""

    cached_tokens: bool
    prompt_cache_hit_tokens: bool
    prompt_cache_miss_tokens: bool
    hit_plus_miss_is_prompt: bool


@dataclasses.dataclass(frozen=True)
class SystemSummary:
    """One system's figures. `error` is set when a server failed to start part-way: the figures
    are then those of the requests before it."""

    requests: int
    ttft: Ttft
    ttft_after_warm_up: Ttft
    ttft_before_restart: Ttft
    ttft_after_restart: Ttft
    ttft_first_after_restart: Ttft
    prompt_tokens: int
    computed_tokens: int
    reused_tokens: int
    disk_tokens: int
    hit_rate: float | None
    hit_rate_after_warm_up: float | None
    hit_rate_ceiling_after_warm_up: float | None
    hit_rate_before_restart: float | None
    hit_rate_after_restart: float | None
    hit_rate_first_after_restart: float | None
    disk_bytes_written: float
    disk_bytes_read: float
    bytes_written_per_reused_token: float | None
    bytes_read_per_reused_token: float | None
    files_evicted_budget: float
    disk: DiskFigures
    decode_tokens_per_s_median: float | None
    usage_fields_present: UsageFieldsPresent
    server_start_s: list[float]
    counters: dict[str, float]
    error: StartFailure | None = None


@dataclasses.dataclass(frozen=True)
class NotRun:
    """A system whose first server did not start: no figures, only why."""

    error: StartFailure


def summarize(run: SystemRun, config: TrafficConfig) -> SystemSummary | NotRun:
    """Per-system figures from its raw records, counters and disk samples."""
    records = run.records
    if not records:
        return NotRun(run.error or StartFailure("no request ran", "", []))
    warm = warm_up_indices(config)
    after_warm = [r for r in records if r.index not in warm]
    before, after = ([r for r in records if r.phase == ph] for ph in (0, 1))
    restart_firsts = first_after_restart(records)
    reused = sum(r.reused_tokens for r in records)
    counters = run.counters
    decode = [r.decode_tokens_per_s for r in records if r.decode_tokens_per_s]
    bytes_written = counters.get("bytes_written_total", 0.0)
    bytes_read = counters.get("bytes_read_total", 0.0)
    return SystemSummary(
        requests=len(records),
        ttft=Ttft.of(records),
        ttft_after_warm_up=Ttft.of(after_warm),
        ttft_before_restart=Ttft.of(before),
        ttft_after_restart=Ttft.of(after),
        ttft_first_after_restart=Ttft.of(restart_firsts),
        prompt_tokens=sum(r.prompt_tokens for r in records),
        computed_tokens=sum(missed(r) for r in records),
        reused_tokens=reused,
        disk_tokens=sum(r.disk_tokens or 0 for r in records),
        hit_rate=_hit_rate(records),
        hit_rate_after_warm_up=_hit_rate(after_warm),
        hit_rate_ceiling_after_warm_up=hit_rate_ceiling(records, warm),
        hit_rate_before_restart=_hit_rate(before),
        hit_rate_after_restart=_hit_rate(after),
        hit_rate_first_after_restart=_hit_rate(restart_firsts),
        disk_bytes_written=bytes_written,
        disk_bytes_read=bytes_read,
        bytes_written_per_reused_token=bytes_written / reused if reused else None,
        bytes_read_per_reused_token=bytes_read / reused if reused else None,
        files_evicted_budget=counters.get("files_evicted_total", 0.0),
        disk=run.disk,
        decode_tokens_per_s_median=_quantile(decode, 0.5),
        usage_fields_present=UsageFieldsPresent(
            cached_tokens=all(r.cached_tokens is not None for r in records),
            prompt_cache_hit_tokens=all(r.hit_tokens is not None for r in records),
            prompt_cache_miss_tokens=all(r.miss_tokens is not None for r in records),
            hit_plus_miss_is_prompt=all(
                r.hit_tokens is not None and r.hit_tokens + missed(r) == r.prompt_tokens for r in records
            ),
        ),
        server_start_s=run.server_start_s,
        counters=counters,
        error=run.error,
    )
