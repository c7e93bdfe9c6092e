"""Token ids -> the exact bytes they stand for: the text that names a checkpoint.

ds4 keys checkpoints on the byte-exact concatenation of its tokens' bytes
(``ds4_token_text``): a vocabulary string holding U+FF5C (the DS4 specials such
as ``<｜User｜>``) is emitted verbatim as UTF-8; every other string goes through
the GPT-2 byte-level reverse map, dropping code points that map to no byte. A
prefix may therefore end in the middle of a UTF-8 character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ds4_vllm.contracts import ASSISTANT, THINK_END, THINK_START
from ds4_vllm.store.text_reuse import hidden_spans

FULLWIDTH_BAR = "\uff5c"


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's printable byte encoding (bytes 33-126, 161-172, 174-255 map to themselves)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in mapping.values():
            mapping[chr(256 + shift)] = b
            shift += 1
    return mapping


class TokenText:
    """Byte strings of a byte-level BPE vocabulary, indexed by token id."""

    def __init__(self, pieces: list[bytes], special: dict[str, int]) -> None:
        self.pieces = pieces
        self.special = special

    @classmethod
    def from_tokenizer_dir(cls, path: str | Path) -> TokenText:
        data = json.loads((Path(path) / "tokenizer.json").read_text(encoding="utf-8"))
        strings: dict[int, str] = {i: s for s, i in data["model"]["vocab"].items()}
        special: dict[str, int] = {}
        for added in data.get("added_tokens", []):
            strings[added["id"]] = added["content"]
            special[added["content"]] = added["id"]
        to_byte = _gpt2_unicode_to_byte()
        pieces = [b""] * (max(strings) + 1)
        for i, s in strings.items():
            if FULLWIDTH_BAR in s:
                pieces[i] = s.encode("utf-8")
            else:
                pieces[i] = bytes(to_byte[c] for c in s if c in to_byte)
        return cls(pieces, special)

    def text(self, token_ids: Sequence[int]) -> bytes:
        """The bytes of `token_ids`; ids outside the vocabulary add nothing.

        Every lookup of a request renders its whole prompt (a 32k-token prompt took 20-40 ms
        with a per-id bounds check), so the bounds are checked once and the join maps ids
        straight to pieces.
        """
        pieces = self.pieces
        if len(token_ids) == 0:
            return b""
        if 0 <= min(token_ids) and max(token_ids) < len(pieces):
            return b"".join(map(pieces.__getitem__, token_ids))
        return b"".join(pieces[t] if 0 <= t < len(pieces) else b"" for t in token_ids)

    def line_prefix(self, token_ids: Sequence[int], n_bytes: int) -> int:
        """The most tokens of `token_ids` whose text ends a line within the first `n_bytes` bytes
        (or, with no line end there, whose text fits in them). A prompt that shares `n_bytes` of
        text with another is cut where the tokenizer splits both alike: at a line end, not inside
        the word where they part."""
        pieces = self.pieces
        size, fits, line = 0, 0, 0
        for i, t in enumerate(token_ids):
            piece = pieces[t] if 0 <= t < len(pieces) else b""
            size += len(piece)
            if size > n_bytes:
                break
            fits = i + 1
            if piece.endswith(b"\n"):
                line = fits
        return line or fits

    def token_id(self, content: str) -> int | None:
        return self.special.get(content)

    @property
    def special_ids(self) -> dict[str, int]:
        return self.special

    def visible_text(self, token_ids: Sequence[int]) -> bytes | None:
        """The text of `token_ids` without their closed reasoning blocks (ds4's thinking-visible
        key, spec §5.2.3), or None when they hold none."""
        if not all(s in self.special for s in (ASSISTANT, THINK_START, THINK_END)):
            return None
        spans = hidden_spans(token_ids, self)
        if not spans:
            return None
        kept, at = [], 0
        for start, stop in spans:
            kept.append(self.text(token_ids[at:start]))
            at = stop
        kept.append(self.text(token_ids[at:]))
        return b"".join(kept)
