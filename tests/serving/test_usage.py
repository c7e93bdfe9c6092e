"""The usage fields of each route, from vLLM's usage object and the engine's counts (pure dicts)."""

from __future__ import annotations

import pytest

from ds4_vllm.serving.usage import CacheUsage, EngineCounts, anthropic_usage, openai_usage, responses_usage


def test_openai_usage_takes_the_engine_counts() -> None:
    vllm_usage = {
        "prompt_tokens": 604,
        "completion_tokens": 4,
        "total_tokens": 608,
        "prompt_tokens_details": None,
    }
    usage, cache = openai_usage(
        vllm_usage, EngineCounts(prompt_tokens=604, cached_tokens=603, disk_tokens=91)
    )
    assert usage == {
        "prompt_tokens": 604,
        "completion_tokens": 4,
        "total_tokens": 608,
        "prompt_tokens_details": {"cached_tokens": 603, "cache_write_tokens": 1},
        "prompt_cache_hit_tokens": 603,
        "prompt_cache_miss_tokens": 1,
        "prompt_cache_disk_tokens": 91,
    }
    assert cache == CacheUsage(604, 603, 91)


def test_openai_usage_without_engine_counts_keeps_vllms_cached_tokens() -> None:
    vllm_usage = {
        "prompt_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4, "created_cache_tokens": 6},
    }
    usage, _ = openai_usage(vllm_usage, None)
    assert usage["prompt_tokens_details"] == {
        "cached_tokens": 4,
        "created_cache_tokens": 6,
        "cache_write_tokens": 6,
    }
    assert (usage["prompt_cache_hit_tokens"], usage["prompt_cache_miss_tokens"]) == (4, 6)
    assert usage["prompt_cache_disk_tokens"] == 0


def test_responses_usage() -> None:
    vllm_usage = {"input_tokens": 604, "input_tokens_details": {"cached_tokens": 512}, "output_tokens": 4}
    usage, _ = responses_usage(vllm_usage, EngineCounts(604, 603, 91))
    assert usage["input_tokens_details"] == {"cached_tokens": 603, "cache_write_tokens": 1}
    assert (usage["prompt_cache_hit_tokens"], usage["prompt_cache_miss_tokens"]) == (603, 1)


def test_anthropic_usage_follows_the_ds4_engine() -> None:
    """input = P - R - W = 0, read = R, creation = W = P - R (kvc-format.md §7.2)."""
    vllm_usage = {
        "input_tokens": 1,
        "output_tokens": 4,
        "cache_read_input_tokens": 603,
        "cache_creation_input_tokens": 0,
    }
    usage, cache = anthropic_usage(vllm_usage, EngineCounts(604, 603, None))
    assert usage == {
        "input_tokens": 0,
        "output_tokens": 4,
        "cache_read_input_tokens": 603,
        "cache_creation_input_tokens": 1,
        "prompt_cache_hit_tokens": 603,
        "prompt_cache_miss_tokens": 1,
    }  # no disk count before the request finished (message_start)
    assert cache.prompt_tokens == 604


def test_anthropic_usage_without_details_reads_input_tokens_as_the_prompt() -> None:
    usage, cache = anthropic_usage({"input_tokens": 20, "output_tokens": 2}, None)
    assert (
        usage["input_tokens"],
        usage["cache_read_input_tokens"],
        usage["cache_creation_input_tokens"],
    ) == (0, 0, 20)
    assert cache == CacheUsage(20, 0, 0)


@pytest.mark.parametrize(
    ("prompt", "cached", "disk", "expected"),
    [(10, 12, 3, CacheUsage(10, 10, 3)), (10, 4, 9, CacheUsage(10, 4, 4)), (5, -1, -1, CacheUsage(5, 0, 0))],
)
def test_counts_are_clamped_so_hit_plus_miss_is_the_prompt(prompt, cached, disk, expected) -> None:
    cache = CacheUsage.of(prompt, cached, disk)
    assert cache == expected
    assert cache.hit_tokens + cache.miss_tokens == prompt
