"""Text-keyed reuse: a prompt extending a known sequence's text gets its exact ids + the rest tokenized.

Everything runs on the real DeepSeek V4 vocabulary (`default_tokenizer`), so "not canonical"
below is checked, not assumed: each scenario first asserts that re-tokenizing the text gives
other ids than the sequence that was computed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ds4_vllm.chat.tokenizer import (
    _BYTE_CHARS,
    ASSISTANT,
    BOS,
    EOS,
    THINK_END,
    THINK_START,
    USER,
    default_tokenizer,
)
from ds4_vllm.kvc import ExtFlag, write_checkpoint
from ds4_vllm.store.text_reuse import (
    MAX_BACKOFF_TOKENS,
    CheckpointPrefixes,
    TextReuse,
    TokenMemory,
    hidden_spans,
    sequence_keys,
)
from tests.store.store_helpers import header, payload

TOK = default_tokenizer()
SYSTEM = BOS + "You are a helpful assistant that answers in one short sentence."


def prompt_ids(user: str, *, think: bool = False) -> list[int]:
    return TOK.encode(SYSTEM + USER + user + ASSISTANT + (THINK_START if think else THINK_END))


#: "hello" sampled as "hel" + "lo": canonically it is one token.
SPLIT_HELLO = TOK.encode("hel") + TOK.encode("lo")


def answer_ids() -> list[int]:
    return TOK.encode("Sure, ") + SPLIT_HELLO + TOK.encode(" to you too.") + [TOK.eos_id]


def text(ids: list[int]) -> str:
    return TOK.decode_bytes(ids).decode("utf-8")


def test_a_follow_up_turn_reuses_the_sampled_ids_not_the_canonical_ones() -> None:
    turn1 = prompt_ids("Say hello to me, twice please.") + answer_ids()
    follow = text(turn1) + USER + "And now goodbye." + ASSISTANT + THINK_END
    assert TOK.encode(follow)[: len(turn1)] != turn1  # the canonical ids diverge from the state
    reuse = TextReuse(TOK)
    assert reuse.remember(turn1)
    assert reuse.encode(follow) == turn1 + TOK.encode(USER + "And now goodbye." + ASSISTANT + THINK_END)
    assert reuse.last_match is not None and reuse.last_match.source == "memory"
    assert reuse.last_match.text_bytes == len(text(turn1).encode())


def test_no_merge_across_the_boundary() -> None:
    """Text after a cut-off answer ("foo" then "bar" in the next prompt) is not merged into it."""
    turn1 = prompt_ids("Write foo.") + TOK.encode("foo")  # cut by max_tokens: no EOS
    follow = text(turn1) + "bar" + EOS + USER + "ok" + ASSISTANT + THINK_END
    assert TOK.encode(follow)[: len(turn1)] != turn1  # canonically "foobar" merges
    reuse = TextReuse(TOK)
    reuse.remember(turn1)
    assert reuse.encode(follow) == turn1 + TOK.encode("bar" + EOS + USER + "ok" + ASSISTANT + THINK_END)


def test_the_longest_key_wins_and_ties_go_to_the_most_recent() -> None:
    short = prompt_ids("Say hello.") + answer_ids()
    longer = short + TOK.encode(USER + "Again") + SPLIT_HELLO + TOK.encode(" again")
    reuse = TextReuse(TOK)
    reuse.remember(longer)
    reuse.remember(short)  # a prefix of a known sequence: kept on its own
    follow = text(longer) + "!"
    assert reuse.encode(follow) == longer + TOK.encode("!")
    # two sequences with the same text: the most recently remembered one is used
    other = prompt_ids("Say hello.") + TOK.encode("Sure, hello to you too.") + [TOK.eos_id]
    assert text(other) == text(short) and other != short
    reuse.remember(other)
    assert reuse.encode(text(short) + "x")[: len(other)] == other


def test_unknown_and_too_short_prefixes_tokenize_canonically() -> None:
    reuse = TextReuse(TOK, min_tokens=16)
    tiny = TOK.encode(BOS + "hi ") + SPLIT_HELLO  # 4 tokens
    assert not reuse.remember(tiny)
    assert reuse.encode(text(tiny) + " there") == TOK.encode(text(tiny) + " there")
    assert reuse.last_match is None
    reuse.remember(prompt_ids("Say hello.") + answer_ids())
    unrelated = SYSTEM + USER + "Something else entirely." + ASSISTANT + THINK_END
    assert reuse.encode(unrelated) == TOK.encode(unrelated)


def test_caps_drop_the_least_recently_used_first() -> None:
    seqs = [prompt_ids(f"Question number {i}: say hello.") + answer_ids() for i in range(4)]
    memory = TokenMemory(TOK, max_entries=3)
    for s in seqs[:3]:
        memory.remember(s)
    assert memory.longest_prefix(TOK.decode_bytes(seqs[0]) + b"?") is not None  # marks 0 used
    memory.remember(seqs[3])  # over the cap: 1 is the least recently used
    assert len(memory) == 3
    found = {i for i, s in enumerate(seqs) if memory.longest_prefix(TOK.decode_bytes(s) + b"?") is not None}
    assert found == {0, 2, 3}
    # the byte cap: keys cost their text + 4 bytes per id
    one = sum(k.nbytes for k in sequence_keys(seqs[0], TOK))
    memory = TokenMemory(TOK, max_bytes=2 * one + one // 2)
    for s in seqs[:3]:
        assert memory.remember(s)
    assert len(memory) == 2 and memory.nbytes <= 2 * one + one // 2
    assert not TokenMemory(TOK, max_bytes=one - 1).remember(seqs[0])  # alone over the cap
    with pytest.raises(ValueError, match="caps must be positive"):
        TokenMemory(TOK, max_entries=0)


def test_a_regenerated_turn_still_extends_the_turn_before() -> None:
    """Turn 2 extended turn 1; the client then edits turn 2's question: turn 1's ids are reused."""
    turn1 = prompt_ids("Say hello.") + answer_ids()
    turn2 = turn1 + TOK.encode(USER + "more" + ASSISTANT + THINK_END) + SPLIT_HELLO + [TOK.eos_id]
    reuse = TextReuse(TOK)
    reuse.remember(turn1)
    reuse.remember(turn2)
    edited = text(turn1) + USER + "something else" + ASSISTANT + THINK_END
    assert reuse.encode(edited) == turn1 + TOK.encode(USER + "something else" + ASSISTANT + THINK_END)


def test_a_cut_inside_a_utf8_character_backs_off_to_the_character() -> None:
    """The answer was cut after the first byte of "é": the prompt's "é" is tokenized whole."""
    c3 = TOK.token_ids[_BYTE_CHARS[0xC3]]
    turn1 = prompt_ids("Write café.") + TOK.encode("caf") + [c3]
    follow = text(turn1[:-1]) + "é" + EOS + USER + "ok" + ASSISTANT + THINK_END
    assert follow.encode().startswith(TOK.decode_bytes(turn1))  # the key's bytes do begin the prompt
    reuse = TextReuse(TOK)
    reuse.remember(turn1)
    assert reuse.encode(follow) == turn1[:-1] + TOK.encode("é" + EOS + USER + "ok" + ASSISTANT + THINK_END)
    assert reuse.last_match is not None and reuse.last_match.text_bytes == len(TOK.decode_bytes(turn1[:-1]))


def test_a_cut_inside_a_special_token_backs_off_before_it() -> None:
    """The model spelled "\\n<｜User" with ordinary tokens; the next prompt has the real special there."""
    spelled = TOK.encode_ordinary("\n<｜User")  # [\n, <, ｜, User]
    assert len(spelled) <= MAX_BACKOFF_TOKENS
    base = prompt_ids("Write a chat transcript.") + TOK.encode("Sure:")
    turn1 = base + spelled
    follow = text(base) + "\n" + USER + "hi" + ASSISTANT + THINK_END
    assert follow.encode().startswith(TOK.decode_bytes(turn1))
    reuse = TextReuse(TOK)
    reuse.remember(turn1)
    ids = reuse.encode(follow)
    assert ids == base + spelled[:1] + TOK.encode(USER + "hi" + ASSISTANT + THINK_END)
    assert TOK.user_id in ids  # the prompt's special stays one special token


def test_nul_ends_the_prompt_as_in_the_engine() -> None:
    turn1 = prompt_ids("Say hello.") + answer_ids()
    reuse = TextReuse(TOK)
    reuse.remember(turn1)
    assert reuse.encode(text(turn1) + USER + "a\0b") == turn1 + TOK.encode(USER + "a")


def thinking_turn() -> tuple[list[int], list[int]]:
    prompt = prompt_ids("Think, then say hello.", think=True)
    output = (
        TOK.encode("The user wants a greeting.")
        + [TOK.think_end_id]
        + TOK.encode("Sure, ")
        + SPLIT_HELLO
        + [TOK.eos_id]
    )
    return prompt, output


def visible_follow_up(prompt: list[int], output: list[int]) -> str:
    """The next turn's rendering: the earlier reasoning is dropped (ds4's thinking-visible key)."""
    prompt_text = text(prompt)
    assert prompt_text.endswith(THINK_START)
    content = text(output[output.index(TOK.think_end_id) + 1 :])
    return (
        prompt_text[: -len(THINK_START)] + THINK_END + content + USER + "And again?" + ASSISTANT + THINK_START
    )


def test_hidden_spans_are_reasoning_blocks_after_the_assistant_token() -> None:
    prompt, output = thinking_turn()
    ids = prompt + output
    start = len(prompt) - 1
    assert hidden_spans(ids, TOK) == [(start, ids.index(TOK.think_end_id))]
    assert hidden_spans(prompt + output[:3], TOK) == []  # unclosed: the client saw no end of it
    user_typed = TOK.encode(SYSTEM + USER + THINK_START + "x" + THINK_END)  # not after the Assistant token
    assert hidden_spans(user_typed, TOK) == []


def test_a_follow_up_after_a_thinking_answer_reuses_the_state_with_its_reasoning() -> None:
    prompt, output = thinking_turn()
    follow = visible_follow_up(prompt, output)
    reuse = TextReuse(TOK)
    reuse.remember(prompt + output)
    ids = reuse.encode(follow)
    assert ids == prompt + output + TOK.encode(USER + "And again?" + ASSISTANT + THINK_START)
    assert reuse.last_match is not None and reuse.last_match.visible
    # the ids hold the reasoning the rendered text does not show
    assert TOK.decode_bytes(ids) != follow.encode()
    assert b"The user wants a greeting." in TOK.decode_bytes(ids)


def test_after_a_restart_the_files_are_the_source(tmp_path: Path) -> None:
    turn1 = prompt_ids("Say hello to me, twice please.") + answer_ids()
    saved = turn1[:-1]  # the finished request's checkpoint: its last sampled token was never fed
    write_checkpoint(tmp_path, TOK.decode_bytes(saved), header(len(saved)), payload(saved), (), fsync=False)
    follow = text(turn1) + USER + "And now goodbye." + ASSISTANT + THINK_END
    reuse = TextReuse(TOK, files=CheckpointPrefixes(tmp_path, TOK))
    ids = reuse.encode(follow)
    rest = EOS + USER + "And now goodbye." + ASSISTANT + THINK_END
    assert ids == saved + TOK.encode(rest)
    assert reuse.last_match is not None and reuse.last_match.source.endswith(".kv")
    # memory wins over a file only when its key is longer
    reuse.remember(turn1)
    assert reuse.encode(follow) == turn1 + TOK.encode(rest[len(EOS) :])
    assert reuse.last_match is not None and reuse.last_match.source == "memory"


def test_thinking_state_in_files_our_token_text_and_the_engines_visible_key(tmp_path: Path) -> None:
    prompt, output = thinking_turn()
    follow = visible_follow_up(prompt, output)
    rest = TOK.encode(USER + "And again?" + ASSISTANT + THINK_START)
    ours = prompt + output[:-1]  # keyed by its token text (reasoning included), as our connector writes it
    write_checkpoint(tmp_path, TOK.decode_bytes(ours), header(len(ours)), payload(ours), (), fsync=False)
    reuse = TextReuse(TOK, files=CheckpointPrefixes(tmp_path, TOK))
    assert reuse.encode(follow) == ours + TOK.encode(EOS) + rest
    assert reuse.last_match is not None and reuse.last_match.visible

    # the ds4 engine's evict/shutdown file: key = the visible text, ext bit 2, payload with reasoning
    engine_dir = tmp_path / "engine"
    full = prompt + output
    visible_text = follow.encode()[: len(follow.encode()) - len(TOK.decode_bytes(rest))]
    head = dataclasses.replace(header(len(full)), ext_flags=int(ExtFlag.THINKING_VISIBLE))
    write_checkpoint(engine_dir, visible_text, head, payload(full), (), fsync=False)
    reuse = TextReuse(TOK, files=CheckpointPrefixes(engine_dir, TOK))
    assert reuse.encode(follow) == full + rest
