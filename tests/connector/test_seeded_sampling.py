"""Issue 20, item 1: a request with `seed` and a prompt longer than one prefill chunk.

vLLM 0.32 samples every scheduled row, also a prompt whose prefill is only partly done, and then
rewinds that request's generator with CUDA-only `set_offset`: on the CPU the engine died
("CPU Generator does not use offset"). Now (`ds4_vllm.vllm_compat.v0_32`, item 8) the generator
advances only for tokens the request keeps, so for one seed the tokens are the same whether the
prompt ran in one chunk or three, and whether most of it was computed or restored from disk.

On the tiny default and on `ds4-tiny-q2` (a GGUF with 2-bit routed experts): engine A (ds4disk,
512-token chunks, vLLM's memory prefix cache off) answers the 1,300-token prompt cold, then again
restored from its own cold checkpoint, then with another seed; engine R (no connector) answers
it in one chunk. The GGUF variant is `heavy` (CI runs the tiny default).
"""

from __future__ import annotations

import pytest

from tests.model.engine_helpers import ds4disk_config, make_engine, random_prompts, shutdown_engine

pytestmark = pytest.mark.slow

CHUNK_TOKENS = 512
PROMPT = random_prompts([1300], seed=20)[0]
#: The cold checkpoint's length: 1,300 - 32 trimmed, not aligned.
COLD_TOKENS = 1268
SAVE_POLICY = {"kv_cache_boundary_align_tokens": 0, "kv_cache_continued_interval_tokens": 0}


def seeded(seed: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, seed=seed, max_tokens=24, ignore_eos=True, detokenize=False)


def answer(llm, seed: int):
    return llm.generate([{"prompt_token_ids": PROMPT}], seeded(seed), use_tqdm=False)[0]


@pytest.fixture(scope="module", params=["ds4", pytest.param("ds4-tiny-q2", marks=pytest.mark.heavy)])
def runs(request, tmp_path_factory) -> dict:
    model = request.param
    disk_dir = tmp_path_factory.mktemp(f"kv-{model}")
    common = {"model": model, "max_model_len": 4096, "kv_cache_memory_bytes": 1 << 30}
    chunked = make_engine(
        **common,
        max_num_batched_tokens=CHUNK_TOKENS,
        enable_prefix_caching=False,
        kv_transfer_config=ds4disk_config(disk_dir, **SAVE_POLICY),
    )
    try:
        out = {"cold": answer(chunked, 3), "restored": answer(chunked, 3), "other seed": answer(chunked, 4)}
    finally:
        shutdown_engine(chunked)
    whole = make_engine(**common, max_num_batched_tokens=2048, enable_prefix_caching=False)
    try:
        out["one chunk"] = answer(whole, 3)
    finally:
        shutdown_engine(whole)
    out["files"] = sorted(disk_dir.glob("*.kv"))
    return out


def tokens(output) -> list[int]:
    return list(output.outputs[0].token_ids)


def test_the_engine_survives_and_answers_in_full(runs):
    assert [len(tokens(runs[k])) for k in ("cold", "restored", "other seed", "one chunk")] == [24] * 4


def test_restored_from_disk_samples_what_the_cold_run_sampled(runs):
    assert runs["cold"].num_cached_tokens == 0
    assert runs["restored"].num_cached_tokens == COLD_TOKENS  # prefix caching is off: from disk
    assert tokens(runs["restored"]) == tokens(runs["cold"])


def test_the_chunk_size_does_not_change_the_sample(runs):
    assert tokens(runs["one chunk"]) == tokens(runs["cold"])


def test_the_seed_decides_the_sample(runs):
    assert tokens(runs["other seed"]) != tokens(runs["cold"])
