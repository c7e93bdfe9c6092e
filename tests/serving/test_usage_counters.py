"""Cumulative counters: in memory, or in the checkpoint directory shared by several processes."""

from __future__ import annotations

import json
import logging
import multiprocessing

from ds4_vllm.serving.usage import CacheUsage
from ds4_vllm.serving.usage_counters import COUNTERS_FILE, UsageCounters, UsageTotals

ADDS_PER_PROCESS = 200


def test_in_memory_counters() -> None:
    counters = UsageCounters(None)
    assert counters.totals().hit_rate is None
    counters.add(CacheUsage.of(100, 75, 50))
    counters.add(CacheUsage.of(20, 0, 0))
    assert counters.totals() == UsageTotals(
        requests=2, prompt_tokens=120, hit_tokens=75, miss_tokens=45, disk_tokens=50
    )
    assert counters.totals().hit_rate == 75 / 120
    assert not counters.persistent


def test_counters_survive_a_new_process_object(tmp_path) -> None:
    UsageCounters(tmp_path).add(CacheUsage.of(100, 60, 10))
    again = UsageCounters(tmp_path)
    again.add(CacheUsage.of(50, 50, 0))
    assert again.totals() == UsageTotals(2, 150, 110, 40, 10)
    assert json.loads((tmp_path / COUNTERS_FILE).read_text())["hit_tokens"] == 110
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".kv")] == []  # never a .kv name


def _add_many(directory: str, prompt: int) -> None:
    counters = UsageCounters(directory)
    for _ in range(ADDS_PER_PROCESS):
        counters.add(CacheUsage.of(prompt, prompt - 1, 1))


def test_processes_sharing_a_directory_lose_no_update(tmp_path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_add_many, args=(str(tmp_path), p)) for p in (10, 30)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    n = ADDS_PER_PROCESS
    assert UsageCounters(tmp_path).totals() == UsageTotals(2 * n, 40 * n, 38 * n, 2 * n, 2 * n)


def test_a_damaged_file_restarts_the_counts_with_a_warning(tmp_path, caplog) -> None:
    (tmp_path / COUNTERS_FILE).write_text('{"hit_tokens": -3}')
    with caplog.at_level(logging.WARNING):
        assert UsageCounters(tmp_path).totals() == UsageTotals()
    assert f"{COUNTERS_FILE}: field 'hit_tokens' must be a non-negative integer, got -3" in caplog.text
