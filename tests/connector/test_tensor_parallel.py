"""Issue 10: the model shards under tensor parallelism, and checkpoints move between parallel sizes.

Engine 1 (1 rank) answers conversation Q, so its checkpoints land in the store; a copy of those
files goes to engine 2 (2 ranks, vLLM's `mp` executor), which continues Q from the 1-rank file and
answers conversation P, writing P's checkpoints. Engine 3 (1 rank) continues P from the 2-rank
file. Engine 1 also answers both continuations from its own memory: the reference answers.
Each engine runs with float32 weights, so only summation order differs between them.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from ds4_vllm.cli.cpu_parallel import tensor_parallel_env
from ds4_vllm.kvc import open_checkpoint
from tests.model.engine_helpers import (
    ds4disk_config,
    greedy,
    make_engine,
    max_logprob_gap,
    random_prompts,
    shutdown_engine,
)

# heavy: three engines (one of two ranks), about 80 s; CI keeps the shard
# arithmetic (tests/model/test_tensor_parallel_parts.py).
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

MAX_TOKENS = 8
# |Δ log-prob| between 1 and 2 ranks on the same float32 weights: the ranks' partial sums are
# added in another order. Measured on this model: at most 1.0e-5 over 2 prompts x 24 decode steps
# (logprobs rounded to 1e-5), the spread batching alone gives (1.3e-5, engine_helpers). A
# restored state off by one row moves log-probs by 1e-2 or more.
ROUND_OFF = 1e-3
Q_TOKENS, P_TOKENS, TAIL_TOKENS = 1100, 1300, 40


def engine(tp: int, disk_dir=None, **kwargs):
    extra = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    if disk_dir is not None:
        extra["kv_transfer_config"] = ds4disk_config(disk_dir)
    return make_engine(max_model_len=4096, **extra, **kwargs)


def answer(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(MAX_TOKENS, logprobs=5))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    q, p, q_tail, p_tail = random_prompts([Q_TOKENS, P_TOKENS, TAIL_TOKENS, TAIL_TOKENS], seed=97)
    one_rank_dir = tmp_path_factory.mktemp("store-tp1")
    two_rank_dir = tmp_path_factory.mktemp("store-tp2")

    llm = engine(1, one_rank_dir)
    try:
        q_first = answer(llm, [q])[0]
        q_next = q + list(q_first.outputs[0].token_ids) + q_tail
        p_first_reference = answer(llm, [p])[0]
        p_next = p + list(p_first_reference.outputs[0].token_ids) + p_tail
        reference = dict(zip(("q_next", "p_next"), answer(llm, [q_next, p_next]), strict=True))
    finally:
        shutdown_engine(llm)  # its last writes are on disk once it stops
    for f in one_rank_dir.glob("*.kv"):  # engine 2's store: Q's first turn only
        tokens = _tokens(f)
        if tokens[:Q_TOKENS] == q and len(tokens) < Q_TOKENS + MAX_TOKENS:
            shutil.copy2(f, two_rank_dir / f.name)

    env = tensor_parallel_env(2)
    os.environ.update(env)
    try:
        llm = engine(2, two_rank_dir, enable_prefix_caching=False, disable_log_stats=False)
        try:
            before = {f.name for f in two_rank_dir.glob("*.kv")}
            two = {"q_next": answer(llm, [q_next])[0], "p_first": answer(llm, [p])[0]}
            written = {f.name: f.stat().st_size for f in two_rank_dir.glob("*.kv") if f.name not in before}
            bytes_written = reported_bytes_written(llm, sum(written.values()))
        finally:
            shutdown_engine(llm)
    finally:
        for key in env:
            os.environ.pop(key, None)

    p_files = [f for f in two_rank_dir.glob("*.kv") if _tokens(f)[:P_TOKENS] == p]
    for f in two_rank_dir.glob("*.kv"):  # engine 3 may only load what engine 2 wrote for P
        if f not in p_files:
            f.unlink()
    llm = engine(1, two_rank_dir, enable_prefix_caching=False)
    try:
        p_next_loaded = answer(llm, [p_next])[0]
    finally:
        shutdown_engine(llm)
    return {
        "reference": reference,
        "p_first_reference": p_first_reference,
        "two": two,
        "p_next_loaded": p_next_loaded,
        "p_files": p_files,
        "q_len": len(q),
        "bytes_written": bytes_written,
        "written": written,
    }


def counter(llm, key: str) -> float:
    from ds4_vllm.connector.metrics import metric_name

    names = {metric_name(key), metric_name(key).removesuffix("_total")}
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name in names)


def reported_bytes_written(llm, on_disk: int, timeout_s: float = 120.0) -> float:
    """The store's bytes_written once the writes already on disk have been reported.

    The writer thread finishes a file after the step that copied it; its report reaches the
    scheduler on a later step. Short prompts (below the store's minimum, so never saved) step
    the engine until the counter reaches the bytes on disk; a second writing rank would pass it.
    """
    deadline = time.monotonic() + timeout_s
    while (written := counter(llm, "bytes_written")) < on_disk and time.monotonic() < deadline:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(1))
        time.sleep(0.2)
    return written


def _tokens(path) -> list[int]:
    with open_checkpoint(path) as ck:
        return [int(t) for t in ck.payload.tokens]


def assert_same_answer(got, want, what: str) -> None:
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids), what
    worst = max_logprob_gap(got, want)
    assert worst < ROUND_OFF, f"{what}: max |Δ logprob| = {worst}"


def test_two_ranks_answer_as_one(runs):
    assert_same_answer(runs["two"]["p_first"], runs["p_first_reference"], "P on 2 ranks vs 1")


def test_two_ranks_continue_from_a_one_rank_checkpoint(runs):
    loaded = runs["two"]["q_next"]
    assert loaded.num_cached_tokens >= runs["q_len"] + MAX_TOKENS - 1, (
        "Q's 1-rank evict checkpoint was not loaded"
    )
    assert_same_answer(loaded, runs["reference"]["q_next"], "Q continued on 2 ranks from a 1-rank file")


def test_one_rank_continues_from_a_two_rank_checkpoint(runs):
    assert runs["p_files"], "2 ranks wrote no checkpoint of P"
    loaded = runs["p_next_loaded"]
    assert loaded.num_cached_tokens >= P_TOKENS + MAX_TOKENS - 1, "P's 2-rank evict checkpoint was not loaded"
    assert_same_answer(loaded, runs["reference"]["p_next"], "P continued on 1 rank from a 2-rank file")


def test_two_ranks_write_each_checkpoint_once(runs):
    """Only the first rank writes: the bytes written are the new files' bytes, not twice them."""
    print("bytes written", runs["bytes_written"], "files", runs["written"])
    assert runs["written"], "2 ranks wrote no checkpoint"
    assert runs["bytes_written"] == sum(runs["written"].values())
