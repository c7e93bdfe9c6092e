"""Issue 4: eight interleaved conversations on one engine keep hitting their own checkpoints.

Every turn sends all eight conversations together (vLLM batches them); each
conversation grows by its answer plus a new user turn. With vLLM's in-memory
prefix cache off, every turn after the first must load the previous turn's
`evict` checkpoint from disk, for all eight at once (no single-slot thrashing),
and answer exactly as an engine without the connector.
"""

from __future__ import annotations

import pytest

from tests.model.engine_helpers import greedy, make_engine, random_prompts, shutdown_engine

pytestmark = pytest.mark.slow

SESSIONS = 8
TURNS = 3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    disk_dir = tmp_path_factory.mktemp("kvdisk")
    config = {
        "kv_connector": "ds4disk",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kv_disk_dir": str(disk_dir)},
    }
    starts = random_prompts([600 + 37 * i for i in range(SESSIONS)], seed=5)
    new_turns = [random_prompts([20 + i for i in range(SESSIONS)], seed=100 + t) for t in range(TURNS)]
    llm = make_engine(kv_transfer_config=config, enable_prefix_caching=False, max_num_seqs=SESSIONS)
    prompts_by_turn, outputs_by_turn = [], []
    try:
        prompts = starts
        for turn in range(TURNS):
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(MAX_TOKENS))
            prompts_by_turn.append(prompts)
            outputs_by_turn.append(outputs)
            prompts = [
                p + list(o.outputs[0].token_ids) + new_turns[turn][i]
                for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
            ]
    finally:
        shutdown_engine(llm)
    reference = make_engine(enable_prefix_caching=False)
    try:
        flat = [p for turn in prompts_by_turn for p in turn]
        expected = reference.generate([{"prompt_token_ids": p} for p in flat], greedy(MAX_TOKENS))
    finally:
        shutdown_engine(reference)
    return prompts_by_turn, outputs_by_turn, expected


def test_every_later_turn_loads_its_own_previous_state(conversations):
    prompts_by_turn, outputs_by_turn, _ = conversations
    assert all(o.num_cached_tokens == 0 for o in outputs_by_turn[0])
    for turn in range(1, TURNS):
        previous = zip(prompts_by_turn[turn - 1], outputs_by_turn[turn - 1], strict=True)
        expected = [len(p) + MAX_TOKENS - 1 for p, _ in previous]
        assert [o.num_cached_tokens for o in outputs_by_turn[turn]] == expected, f"turn {turn + 1}"


def test_answers_equal_an_engine_without_the_connector(conversations):
    _, outputs_by_turn, expected = conversations
    got = [list(o.outputs[0].token_ids) for turn in outputs_by_turn for o in turn]
    assert got == [list(o.outputs[0].token_ids) for o in expected]
