"""ds4's save points (spec §5.2) as table tests."""

from __future__ import annotations

import pytest

from ds4_vllm.kvc import SaveReason
from ds4_vllm.store.options import StoreOptions
from ds4_vllm.store.policy import (
    AnswerEnd,
    SaveDecision,
    answer_comes_back,
    answer_start,
    answer_start_save,
    chat_anchor,
    cold_store_len,
    continued_due,
    divergence_save,
    finished_save,
    plan_prefill_saves,
    reasoning_open,
    store_len,
)

D = StoreOptions(disk_dir="/unused")
U, A = 900, 901  # <｜User｜>, <｜Assistant｜> ids in these tests
COLD, CONT = SaveReason.COLD, SaveReason.CONTINUED


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (2080, 2048),
        (4127, 2048),
        (4128, 4096),
        (30000, 28672),
        (512, 512),
        (1000, 1000),
        (2079, 2079),
        (1, 1),
    ],
)
def test_store_len_spec_examples(n: int, expected: int) -> None:
    assert store_len(D, n) == expected


def test_store_len_unchanged_for_every_short_prompt() -> None:
    assert all(store_len(D, n) == n for n in range(512, 2080))


@pytest.mark.parametrize(
    ("kw", "n", "expected"),
    [
        (dict(boundary_align_tokens=0), 2080, 2048),  # trim only
        (dict(boundary_align_tokens=0, boundary_trim_tokens=0), 2080, 2080),
        (dict(boundary_trim_tokens=0), 4096, 4096),
        (dict(min_tokens=3000), 4127, 4127),  # aligned result below min: unchanged
    ],
)
def test_store_len_other_options(kw: dict, n: int, expected: int) -> None:
    assert store_len(StoreOptions(disk_dir="/x", **kw), n) == expected


def test_continued_step_rounds_interval_up_to_alignment() -> None:
    assert D.continued_step == 10240
    assert StoreOptions(disk_dir="/x", boundary_align_tokens=0).continued_step == 10000
    assert StoreOptions(disk_dir="/x", continued_interval_tokens=0).continued_step == 0


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([1, U, 5, A, U, A], 1),
        ([1, U, 5, U, 6, A, U], 3),  # last User before the first Assistant
        ([1, 2, 3], -1),
        ([A, U], -1),
        ([U], 0),
    ],
)
def test_chat_anchor(tokens: list[int], expected: int) -> None:
    assert chat_anchor(tokens, U, A) == expected


def chat_prompt(anchor: int, total: int) -> list[int]:
    """BOS/system up to `anchor`, then <｜User｜> ... <｜Assistant｜> ..., `total` tokens."""
    body = [7] * anchor + [U] + [8] * 10 + [A]
    return body + [9] * (total - len(body))


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (chat_prompt(600, 5000), 600),  # anchor >= min: the anchor, not aligned
        (chat_prompt(100, 5000), 4096),  # anchor < min: trimmed and aligned
        ([7] * 2080, 2048),
        ([7] * 511, None),  # under min
        ([7] * 30001, None),  # above cold max
        ([7] * 30000, 28672),
    ],
)
def test_cold_store_len(prompt: list[int], expected: int | None) -> None:
    assert cold_store_len(D, prompt, U, A) == expected


def test_cold_disabled_by_zero_cold_max() -> None:
    assert cold_store_len(StoreOptions(disk_dir="/x", cold_max_tokens=0), [7] * 5000, U, A) is None


@pytest.mark.parametrize(
    ("live", "last", "due"),
    [(10240, 0, True), (20480, 10240, True), (10240, 10240, False), (10241, 0, False), (0, 0, False)],
)
def test_continued_due(live: int, last: int, due: bool) -> None:
    assert continued_due(D, live, last) is due


def test_continued_respects_min_and_disable() -> None:
    small = StoreOptions(
        disk_dir="/x", continued_interval_tokens=100, boundary_align_tokens=0, min_tokens=250
    )
    assert not continued_due(small, 200, 0)
    assert continued_due(small, 300, 0)
    assert not continued_due(StoreOptions(disk_dir="/x", continued_interval_tokens=0), 10240, 0)


@pytest.mark.parametrize(
    ("n", "cached", "expected"),
    [
        (400, 0, []),  # under min: nothing
        (5000, 0, [(4096, COLD)]),
        (25000, 0, [(10240, CONT), (20480, CONT), (24576, COLD)]),
        (25000, 4096, [(10240, CONT), (20480, CONT)]),  # reuse: no cold save
        (25000, 10240, [(20480, CONT)]),  # continued only beyond what was reused
        (40000, 0, [(10240, CONT), (20480, CONT), (30720, CONT)]),  # above cold max
        (10240, 0, [(8192, COLD), (10240, CONT)]),  # a prompt ending on a step is saved after prefill
        (10272, 0, [(10240, COLD)]),  # cold point on a continued frontier: saved once, as cold
    ],
)
def test_plan_prefill_saves(n: int, cached: int, expected: list[tuple[int, SaveReason]]) -> None:
    plan = plan_prefill_saves(D, [7] * n, cached, U, A)
    assert plan == [SaveDecision(t, r) for t, r in expected]


def test_plan_prefill_saves_uses_chat_anchor() -> None:
    plan = plan_prefill_saves(D, chat_prompt(1500, 12000), 0, U, A)
    assert plan == [SaveDecision(1500, COLD), SaveDecision(10240, CONT)]
    assert str(plan[0]) == "cold(anchor)@1500"  # the trace says why


@pytest.mark.parametrize(
    ("total", "last", "shutdown", "expected"),
    [
        (5000, 0, False, SaveDecision(5000, SaveReason.EVICT)),
        (5000, 4096, True, SaveDecision(5000, SaveReason.SHUTDOWN)),
        (5000, 5000, False, None),  # already stored at this length
        (511, 0, False, None),  # under min
    ],
)
def test_finished_save(total: int, last: int, shutdown: bool, expected: SaveDecision | None) -> None:
    assert finished_save(D, total, last, shutdown=shutdown) == expected


def test_divergence_saves_where_the_set_up_parts_from_a_known_prompt() -> None:
    """Issue 21: a prompt whose system prompt parts from a known one late (a folder's path) is
    saved where they part, as `agent-system`, so that the next folder reuses that far."""
    prompt = [7] * 9000 + [U] + [8] * 50 + [A]  # tools + system, then the user's message
    anchor = SaveDecision(6000, SaveReason.AGENT_SYSTEM)
    assert divergence_save(D, prompt, 6000, 0, U, A) == anchor
    assert divergence_save(D, prompt, 6000, 5400, U, A) == anchor  # gains 600 tokens
    assert divergence_save(D, prompt, 6000, 5600, U, A) is None  # gains under 512 tokens
    assert divergence_save(D, prompt, 400, 0, U, A) is None  # under --kv-cache-min-tokens
    assert divergence_save(D, prompt, 9020, 0, U, A) is None  # after the chat anchor: a turn's own
    plan = plan_prefill_saves(D, prompt, 8500, U, A, shared_tokens=9020)
    assert plan == []  # reused past its last rung, parts after the chat anchor: nothing
    off = StoreOptions(disk_dir="/unused", divergence_tokens=0)  # ds4's own policy
    assert divergence_save(off, prompt, 6000, 0, U, A) is None
    assert plan_prefill_saves(off, prompt, 0, U, A, shared_tokens=6000) == [SaveDecision(9000, COLD)]
    on_continued = plan_prefill_saves(D, [7] * 20_000 + [U, A], 0, U, A, shared_tokens=10240)
    assert SaveDecision(10240, CONT) in on_continued  # one file per point; ds4's reason wins


def test_a_new_set_up_is_saved_every_2048_tokens() -> None:
    """Issue 21: the first prompt that parts from another late in their shared set-up reuses
    all but at most 2048 tokens of it: a prompt leaves an `agent-system` file every 2048 tokens
    of the set-up it did not reuse (before its chat anchor), besides ds4's cold save there."""
    prompt = [7] * 9000 + [U] + [8] * 50 + [A]
    rungs = [SaveDecision(m, SaveReason.AGENT_SYSTEM) for m in (2048, 4096, 6144, 8192)]
    assert plan_prefill_saves(D, prompt, 0, U, A) == [*rungs, SaveDecision(9000, COLD)]
    assert " ".join(map(str, plan_prefill_saves(D, prompt, 0, U, A, shared_tokens=6000))) == (
        "agent-system(ladder)@2048 agent-system(ladder)@4096 agent-system(divergence)@6000 "
        "agent-system(ladder)@6144 agent-system(ladder)@8192 cold(anchor)@9000"
    )
    assert plan_prefill_saves(D, prompt, 0, U, A, shared_tokens=6000) == sorted(
        [*rungs, SaveDecision(6000, SaveReason.AGENT_SYSTEM), SaveDecision(9000, COLD)]
    )
    # a new folder that reused 4500 tokens of another's set-up: rungs for the rest of it
    assert plan_prefill_saves(D, prompt, 4500, U, A) == rungs[2:]
    # a later turn, which reuses its whole set-up: none
    assert plan_prefill_saves(D, prompt + [9] * 3000, 9060, U, A) == [SaveDecision(10240, CONT)]
    # bounded: no rung past cold_max (30000), so at most cold_max / 2048 files per set-up; a
    # rung on a continued point is saved once, as continued
    long_set_up = plan_prefill_saves(D, [7] * 40_000 + [U, A], 0, U, A)
    continued = [SaveDecision(m, CONT) for m in (10240, 20480, 30720)]
    ladder = [SaveDecision(m, SaveReason.AGENT_SYSTEM) for m in range(2048, 30001, 2048) if m % 10240]
    assert long_set_up == sorted(continued + ladder)
    assert plan_prefill_saves(D, [7] * 3000 + [8] * 2000, 0, U, A) == [SaveDecision(4096, COLD)]  # no set-up


THINK, UNTHINK = 902, 903  # <think>, </think>


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ([A, THINK], 1001),  # thinking: a later turn renders `<｜Assistant｜></think>...`
        ([A, UNTHINK], 1001),  # non-thinking: the same prefix
        ([A], 1001),
        ([A, 5, 6], 1003),  # no assistant turn at the end (a raw completion): its length
        ([5], 1001),
    ],
)
def test_answer_start(tail: list[int], expected: int) -> None:
    assert answer_start([7] * 1000 + tail, A) == expected


@pytest.mark.parametrize(
    ("answer", "open_"),
    [
        ([THINK, 5, 6], True),  # cut inside its reasoning
        ([THINK, 5, UNTHINK, 6], False),
        ([UNTHINK, 6], False),
        ([5, 6], False),
        ([THINK, 5, UNTHINK, THINK, 6], True),
    ],
)
def test_reasoning_open(answer: list[int], open_: bool) -> None:
    assert reasoning_open(answer, THINK, UNTHINK) is open_


def test_answer_start_save() -> None:
    """Issue 21: a finished request whose answer will not come back is saved where it starts."""
    assert answer_start_save(D, 5000, set()) == SaveDecision(5000, SaveReason.EVICT)
    assert str(answer_start_save(D, 5000, set())) == "evict(answer-start)@5000"
    assert answer_start_save(D, 5000, {4096}, shutdown=True) == SaveDecision(5000, SaveReason.SHUTDOWN)
    assert answer_start_save(D, 5000, {5000}) is None  # a file holds that length already
    assert answer_start_save(D, 511, set()) is None  # under --kv-cache-min-tokens


ENDED, STOPPED, ABORTED = AnswerEnd.ENDED, AnswerEnd.STOPPED, AnswerEnd.ABORTED
CHAT, RAW = [7] * 10 + [A], [7] * 10


@pytest.mark.parametrize(
    ("end", "prompt", "answer", "text", "expected"),
    [
        (ENDED, CHAT + [THINK], [5, UNTHINK, 6], b"hello", True),
        (ENDED, CHAT, [UNTHINK, 6], "héllo".encode(), True),
        (STOPPED, CHAT, [UNTHINK, 6], b"hello", False),  # a stop string or token
        (ABORTED, CHAT, [UNTHINK, 6], b"hello", False),
        (ENDED, CHAT + [THINK], [5, 6], b"hello", False),  # cut inside its reasoning
        (ENDED, CHAT, [UNTHINK, 6], "héllo".encode()[:2], False),  # a broken UTF-8 sequence
        # not a chat render: the client appends what it got; only a retry resends the prompt
        (STOPPED, RAW, [5, 6], b"hello", True),
        (ENDED, RAW + [THINK], [5, 6], "héllo".encode()[:2], True),
        (ABORTED, RAW, [5, 6], b"hello", False),
    ],
)
def test_answer_comes_back(
    end: AnswerEnd, prompt: list[int], answer: list[int], text: bytes, expected: bool
) -> None:
    assert answer_comes_back(end, prompt, answer, text, (A, THINK, UNTHINK)) is expected
