"""Cache usage fields for the four generation routes, as the DeepSeek API and the ds4 engine report them.

Pure dict rewriting (no vLLM), applied by `ds4_vllm.serving.middleware` to the usage object
vLLM produced. With `P` prompt tokens, `R` of them reused from a cache (vLLM's prefix cache in
memory or a ds4disk checkpoint) and `W = P - R` computed (the ds4 engine's "written" tokens,
kvc-format.md §7.2):

- every route gets the DeepSeek API's `prompt_cache_hit_tokens` (R) and
  `prompt_cache_miss_tokens` (W), so hit + miss = P exactly, and our own
  `prompt_cache_disk_tokens`: how many of the R tokens were loaded from a disk checkpoint
  rather than found in vLLM's memory (0 without ds4disk; absent from a stream's usage sent
  before the request finished, Anthropic's `message_start`, since the connector reports it
  when the request ends);
- OpenAI chat/completions: `prompt_tokens_details.cached_tokens` = R and
  `prompt_tokens_details.cache_write_tokens` = W (as the ds4 engine writes them);
- Responses: `input_tokens_details.cached_tokens` = R and `.cache_write_tokens` = W;
- Anthropic: `cache_read_input_tokens` = R, `cache_creation_input_tokens` = W and
  `input_tokens` = P - R - W = 0, the ds4 engine's meaning (every prompt token not read from a
  cache is written to one).

R comes from what the engine reported for the HTTP request's engine requests (`EngineCounts`,
summed over them: vLLM itself reports only the last prompt's for a multi-prompt completion),
else from the cached count already in the usage object.
"""

from __future__ import annotations

import dataclasses
from typing import Any

HIT_FIELD = "prompt_cache_hit_tokens"
MISS_FIELD = "prompt_cache_miss_tokens"
DISK_FIELD = "prompt_cache_disk_tokens"
WRITE_FIELD = "cache_write_tokens"


@dataclasses.dataclass(frozen=True, slots=True)
class EngineCounts:
    """What the engine reported for one HTTP request, summed over its engine requests."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: None until every engine request finished: the connector reports it on the final output.
    disk_tokens: int | None = 0


@dataclasses.dataclass(frozen=True, slots=True)
class CacheUsage:
    """One response's prompt tokens split into reused (`hit`) and computed (`miss`) tokens."""

    prompt_tokens: int
    hit_tokens: int
    disk_tokens: int | None  # None: not known yet (a stream's early usage, e.g. Anthropic message_start)

    @classmethod
    def of(cls, prompt_tokens: int, cached_tokens: int, disk_tokens: int | None = 0) -> CacheUsage:
        """Clamped so that 0 <= disk <= hit <= prompt."""
        prompt = max(0, int(prompt_tokens))
        hit = min(max(0, int(cached_tokens)), prompt)
        return cls(prompt, hit, None if disk_tokens is None else min(max(0, int(disk_tokens)), hit))

    @property
    def miss_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    def fields(self) -> dict[str, int]:
        """The fields every route's usage object gets (the disk count once it is known)."""
        out = {HIT_FIELD: self.hit_tokens, MISS_FIELD: self.miss_tokens}
        if self.disk_tokens is not None:
            out[DISK_FIELD] = self.disk_tokens
        return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _cached(details: Any) -> int:
    return _int(details.get("cached_tokens")) if isinstance(details, dict) else 0


def _details(usage: dict[str, Any], key: str, cache: CacheUsage) -> dict[str, Any]:
    details = usage.get(key)
    details = dict(details) if isinstance(details, dict) else {}
    details["cached_tokens"] = cache.hit_tokens
    details[WRITE_FIELD] = cache.miss_tokens
    return details


def _with_cache_fields(
    usage: dict[str, Any], engine: EngineCounts | None, prompt_key: str, details_key: str
) -> tuple[dict[str, Any], CacheUsage]:
    """OpenAI-style usage (prompt count under `prompt_key`, cached count in `details_key`)."""
    prompt = _int(usage.get(prompt_key))
    cached = engine.cached_tokens if engine is not None else _cached(usage.get(details_key))
    cache = CacheUsage.of(prompt, cached, engine.disk_tokens if engine is not None else 0)
    out = dict(usage)
    out[details_key] = _details(usage, details_key, cache)
    out.update(cache.fields())
    return out, cache


def openai_usage(usage: dict[str, Any], engine: EngineCounts | None) -> tuple[dict[str, Any], CacheUsage]:
    """`/v1/chat/completions` and `/v1/completions` usage with the cache fields."""
    return _with_cache_fields(usage, engine, "prompt_tokens", "prompt_tokens_details")


def responses_usage(usage: dict[str, Any], engine: EngineCounts | None) -> tuple[dict[str, Any], CacheUsage]:
    """`/v1/responses` usage (`input_tokens`) with the cache fields."""
    return _with_cache_fields(usage, engine, "input_tokens", "input_tokens_details")


def anthropic_usage(usage: dict[str, Any], engine: EngineCounts | None) -> tuple[dict[str, Any], CacheUsage]:
    """`/v1/messages` usage: read = R, creation = W, input = P - R - W = 0 (the ds4 engine's meaning).

    vLLM reports `input_tokens = P - read - creation` with its own creation count, so the
    prompt size is the sum of the three as vLLM wrote them.
    """
    read = _int(usage.get("cache_read_input_tokens"))
    prompt = _int(usage.get("input_tokens")) + read + _int(usage.get("cache_creation_input_tokens"))
    cache = CacheUsage.of(
        prompt,
        engine.cached_tokens if engine is not None else read,
        engine.disk_tokens if engine is not None else 0,
    )
    out = dict(usage)
    out["input_tokens"] = cache.prompt_tokens - cache.hit_tokens - cache.miss_tokens
    out["cache_read_input_tokens"] = cache.hit_tokens
    out["cache_creation_input_tokens"] = cache.miss_tokens
    out.update(cache.fields())
    return out, cache


#: Route path -> the usage rewrite for its responses.
USAGE_REWRITES = {
    "/v1/chat/completions": openai_usage,
    "/v1/completions": openai_usage,
    "/v1/responses": responses_usage,
    "/v1/messages": anthropic_usage,
}
