"""Issue 2: vLLM's scheduler features give the same greedy output as a request run alone.

Alone, in a batch of 8 mixed-length requests, with chunked prefill forced to
64-token chunks (chunk boundaries fall inside compressor windows), and after an
automatic prefix-cache hit.
"""

from __future__ import annotations

import pytest

from tests.model.engine_helpers import greedy, make_engine, random_prompts, shutdown_engine

pytestmark = pytest.mark.slow

LENGTHS = [3, 50, 129, 260, 513, 700, 1030, 2100]
MAX_TOKENS = 8


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=23)


@pytest.fixture(scope="module")
def default_engine_runs(prompts):
    """Alone, batched, and repeated (prefix-cache hit) runs on one engine with default scheduling."""
    llm = make_engine(enable_prefix_caching=True)
    try:
        params = greedy(MAX_TOKENS)
        alone = [_tokens(llm.generate([{"prompt_token_ids": p}], params))[0] for p in prompts]
        batched = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
        again = llm.generate([{"prompt_token_ids": prompts[-1]}], params)[0]
        yield {"alone": alone, "batched": batched, "again": again}
    finally:
        shutdown_engine(llm)


def test_batch_of_eight_matches_alone(default_engine_runs):
    assert default_engine_runs["batched"] == default_engine_runs["alone"]


def test_prefix_cache_hit_matches_alone(default_engine_runs):
    again = default_engine_runs["again"]
    assert again.num_cached_tokens >= 2048, "the repeated 2,100-token prompt should hit vLLM's prefix cache"
    assert list(again.outputs[0].token_ids) == default_engine_runs["alone"][-1]


def test_small_chunked_prefill_matches_alone(default_engine_runs, prompts):
    llm = make_engine(max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=False)
    try:
        chunked = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(MAX_TOKENS)))
    finally:
        shutdown_engine(llm)
    assert chunked == default_engine_runs["alone"]
