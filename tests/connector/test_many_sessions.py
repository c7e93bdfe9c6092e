"""Issue 7: many interleaved conversations on one engine each load their own previous state.

Every turn sends all conversations together (vLLM batches them); each conversation grows by
its answer plus a new user turn, sent as soon as the previous turn returns, as an agent does
after a fast tool. With vLLM's in-memory prefix cache off, every turn after the first must
restore the previous turn's `evict` checkpoint, even while that checkpoint is still waiting
for the disk (then the worker serves it from memory; the trace says `disk_cache_in_flight`).

Set-ups: 8 conversations as they come, and 32 (CI: 12) conversations with every background
write slowed by an injected delay and a 2 MiB writer queue, so saves queue up, steps wait for room
(back-pressure) and the next turns' lookups find their checkpoints in flight. Answers must
equal an engine without the connector. `DS4_VLLM_RACE_ROUNDS=N` repeats the whole exchange N
times with fresh conversations in the same engines (the issue's 20-run check); each round's
loads are asserted, the answers of round 0. Each set-up runs in two engines (with the connector,
and the reference); the 8- and 32-conversation ones are `heavy`, CI runs the 12-conversation one.
"""

from __future__ import annotations

import os
import re

import pytest

from ds4_vllm.connector.worker import WRITE_DELAY_ENV
from tests.model.engine_helpers import ds4disk_config, greedy, make_engine, random_prompts, shutdown_engine

pytestmark = pytest.mark.slow

TURNS = 3
MAX_TOKENS = 6
ROUNDS = int(os.environ.get("DS4_VLLM_RACE_ROUNDS", "1"))
VARIANTS = {
    "8-sessions": {"sessions": 8, "write_delay_s": 0.0, "extra": {}},
    "32-sessions-slow-writer": {"sessions": 32, "write_delay_s": 0.25, "extra": {"kv_write_queue_mb": 2}},
    "12-sessions-slow-writer": {"sessions": 12, "write_delay_s": 0.25, "extra": {"kv_write_queue_mb": 2}},
}


def run_turns(llm, sessions: int, seed: int):
    starts = random_prompts([520 + 23 * i for i in range(sessions)], seed=seed)
    new_turns = [random_prompts([20 + i for i in range(sessions)], seed=seed + 100 + t) for t in range(TURNS)]
    prompts_by_turn, outputs_by_turn = [], []
    prompts = starts
    for turn in range(TURNS):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(MAX_TOKENS), use_tqdm=False)
        prompts_by_turn.append(prompts)
        outputs_by_turn.append(outputs)
        prompts = [
            p + list(o.outputs[0].token_ids) + new_turns[turn][i]
            for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
        ]
    return prompts_by_turn, outputs_by_turn


def run_variant(name: str, tmp_path_factory) -> dict:
    variant = VARIANTS[name]
    disk_dir = tmp_path_factory.mktemp(f"kvdisk-{name}")
    trace = disk_dir.parent / f"trace-{name}.txt"
    config = ds4disk_config(disk_dir, trace=str(trace), **variant["extra"])
    os.environ[WRITE_DELAY_ENV] = str(variant["write_delay_s"])  # read by the worker process
    try:
        llm = make_engine(
            kv_transfer_config=config, enable_prefix_caching=False, max_num_seqs=variant["sessions"]
        )
    finally:
        del os.environ[WRITE_DELAY_ENV]
    try:
        rounds = [run_turns(llm, variant["sessions"], seed=5 + 1000 * r) for r in range(ROUNDS)]
    finally:
        shutdown_engine(llm)
    run = {"rounds": rounds, "trace": trace.read_text()}
    reference = make_engine(enable_prefix_caching=False, max_num_seqs=variant["sessions"])
    try:
        flat = [p for turn in rounds[0][0] for p in turn]
        run["expected"] = reference.generate(
            [{"prompt_token_ids": p} for p in flat], greedy(MAX_TOKENS), use_tqdm=False
        )
    finally:
        shutdown_engine(reference)
    return run


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """Each set-up's runs, made when a test first asks for them."""
    runs: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in runs:
            runs[name] = run_variant(name, tmp_path_factory)
        return runs[name]

    return get


VARIANT_PARAMS = [
    pytest.param("8-sessions", marks=pytest.mark.heavy),
    pytest.param("32-sessions-slow-writer", marks=pytest.mark.heavy),
    "12-sessions-slow-writer",
]


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_every_later_turn_loads_its_own_previous_state(conversations, variant):
    for r, (prompts_by_turn, outputs_by_turn) in enumerate(conversations(variant)["rounds"]):
        assert all(o.num_cached_tokens == 0 for o in outputs_by_turn[0])
        for turn in range(1, TURNS):
            previous = zip(prompts_by_turn[turn - 1], outputs_by_turn[turn - 1], strict=True)
            expected = [len(p) + MAX_TOKENS - 1 for p, _ in previous]
            got = [o.num_cached_tokens for o in outputs_by_turn[turn]]
            assert got == expected, f"round {r}, turn {turn + 1}"


@pytest.mark.parametrize("variant", VARIANT_PARAMS[1:])
def test_slow_writer_hits_were_served_in_flight(conversations, variant):
    """With the writer slowed, some turns find their checkpoint still queued and load it anyway."""
    trace = conversations(variant)["trace"]
    in_flight = len(re.findall(r"^disk_cache_in_flight: true$", trace, re.M))
    disk_hits = len(re.findall(r"^cache_source: disk$", trace, re.M))
    assert disk_hits == VARIANTS[variant]["sessions"] * (TURNS - 1) * ROUNDS
    assert in_flight > 0


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_answers_equal_an_engine_without_the_connector(conversations, variant):
    run = conversations(variant)
    outputs_by_turn = run["rounds"][0][1]
    got = [list(o.outputs[0].token_ids) for turn in outputs_by_turn for o in turn]
    assert got == [list(o.outputs[0].token_ids) for o in run["expected"]]
