"""The checkpoint key text: token ids back to the exact bytes of the prompt they came from."""

from __future__ import annotations

import pytest

from ds4_vllm.connector.token_text import TokenText
from ds4_vllm.model.default_model import default_model_dir

PROMPT = "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Grüße, 世界! 🙂 x=1\n\n<｜Assistant｜></think>Ok."


@pytest.fixture(scope="module")
def tokenizer_dir():
    return default_model_dir()


@pytest.fixture(scope="module")
def token_text(tokenizer_dir):
    return TokenText.from_tokenizer_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def ids(tokenizer_dir):
    from tokenizers import Tokenizer

    return (
        Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        .encode(PROMPT, add_special_tokens=False)
        .ids
    )


def test_text_of_all_tokens_is_the_prompt(token_text, ids):
    assert token_text.text(ids) == PROMPT.encode("utf-8")


def test_every_token_prefix_is_a_byte_prefix(token_text, ids):
    whole = PROMPT.encode("utf-8")
    for k in range(len(ids) + 1):
        assert whole.startswith(token_text.text(ids[:k]))


def test_a_prefix_can_end_inside_a_utf8_character(token_text, tokenizer_dir):
    from tokenizers import Tokenizer

    parrots = "🦜🦜"  # byte-level BPE splits each 4-byte character into 3 tokens
    ids = (
        Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        .encode(parrots, add_special_tokens=False)
        .ids
    )
    cuts = [token_text.text(ids[:k]) for k in range(len(ids) + 1)]
    assert cuts[-1] == parrots.encode("utf-8")
    assert any(len(c) % 4 for c in cuts), "some prefix ends inside a character"
    assert all(parrots.encode("utf-8").startswith(c) for c in cuts)


def test_special_tokens_are_verbatim(token_text):
    user = token_text.token_id("<｜User｜>")
    assert user is not None
    assert token_text.text([user]) == "<｜User｜>".encode()


def test_visible_text_leaves_out_closed_reasoning_after_the_assistant_token(token_text) -> None:
    """The connector's second lookup key: ds4's thinking-visible text (§5.2.3) of a prompt's ids."""
    from ds4_vllm.chat.tokenizer import default_tokenizer

    tok = default_tokenizer()
    head = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>"
    ids = tok.encode(head + "<think>Greet back.</think>Hello!<｜end▁of▁sentence｜><｜User｜>Again")
    assert (
        token_text.visible_text(ids) == (head + "</think>Hello!<｜end▁of▁sentence｜><｜User｜>Again").encode()
    )
    assert token_text.visible_text(tok.encode(head + "</think>Hello!")) is None  # nothing hidden
    assert token_text.visible_text(tok.encode(head + "<think>still thinking")) is None  # unclosed


def test_ids_outside_the_vocabulary_add_nothing(token_text) -> None:
    user = token_text.token_id("<｜User｜>")
    assert token_text.text([user, -1, len(token_text.pieces), user]) == "<｜User｜><｜User｜>".encode()
    assert token_text.text([]) == b""


def test_a_shared_prefix_is_cut_at_a_line_end(token_text, tokenizer_dir) -> None:
    """Issue 21: two prompts that part inside a word tokenize that word apart; the save where
    they part ends at the last line end before it, where both tokenize alike."""
    from tokenizers import Tokenizer

    encode = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode
    a = "Rules.\nAlways test.\nWorking directory: /home/u/alpha-service\nMore.\n"
    b = a.replace("alpha-service", "beta-service")
    ids_a, ids_b = encode(a, add_special_tokens=False).ids, encode(b, add_special_tokens=False).ids
    shared = next(i for i, (x, y) in enumerate(zip(a.encode(), b.encode(), strict=False)) if x != y)
    cut = token_text.line_prefix(ids_a, shared)
    assert token_text.text(ids_a[:cut]) == b"Rules.\nAlways test.\n"
    assert ids_a[:cut] == ids_b[:cut]
    # no line end in the first 3 bytes: the tokens that fit in them
    assert len(token_text.text(ids_a[: token_text.line_prefix(ids_a, 3)])) <= 3
