"""Text-keyed reuse: a prompt whose text extends a known token sequence's text reuses its exact ids.

The ds4 engine keys checkpoints by text and, on a hit, builds the prompt as the checkpoint's
exact tokens followed by the tokenization of the rest of the text (spec §5.4, step 4). Sampled
tokens need not be the canonical tokenization of their text (and BPE may merge across a turn
boundary), so re-tokenizing a whole follow-up prompt can diverge in ids from the state that was
computed, and every id-keyed cache (vLLM's block hashes, the connector's token check) then
misses. `TextReuse.encode` does what the engine does, with two sources of known sequences:

- `TokenMemory`: every finished request's prompt + output ids (this process, bounded);
- `CheckpointPrefixes`: the checkpoint files of the ds4disk directory (text + payload tokens),
  the only source after a restart and the one other servers on the directory fill.

Each sequence gives two keys: its token text, and its *visible* text, where hidden reasoning
(a `<think>` right after `<｜Assistant｜>`, up to the `</think>` that closes it) is left out, as
the engine's thinking-visible key (ext bit 2, §5.2.3) leaves it out. A follow-up turn renders
an earlier thinking answer without its reasoning, so the visible key is the one that matches
it; the reused ids then still hold the reasoning, and the model's context with them.

Pure logic over ids and bytes (no vLLM); the tokenizer is anything with `token_bytes`,
`encode` and `special_ids` (`ds4_vllm.chat.tokenizer.Ds4Tokenizer`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from ds4_vllm.contracts import ASSISTANT, THINK_END, THINK_START
from ds4_vllm.kvc import CheckpointIndex, KvcFormatError, open_checkpoint

logger = logging.getLogger(__name__)


#: A reuse shorter than this many tokens is not worth leaving the canonical tokenization for.
DEFAULT_MIN_TOKENS = 16
DEFAULT_MAX_ENTRIES = 512
DEFAULT_MAX_BYTES = 256 << 20
#: How many trailing tokens a key may give up to end on a safe boundary (§8.3 notes below).
MAX_BACKOFF_TOKENS = 8


class SpecialIds(Protocol):
    """What `hidden_spans` reads of a tokenizer: the ids of its special tokens."""

    @property
    def special_ids(self) -> Mapping[str, int]: ...


class TokenizerLike(SpecialIds, Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...

    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class KeyText:
    """One key of a token sequence: `text`, and the ids whose state it stands for.

    `ends[i]` is a byte offset in `text` at which the key may be cut and `counts[i]` how many of
    `ids` stand for `text[:ends[i]]` (ascending; the last pair is the whole key).
    """

    text: bytes
    ids: tuple[int, ...]
    ends: tuple[int, ...]
    counts: tuple[int, ...]
    visible: bool = False

    @property
    def digest(self) -> bytes:
        return text_digest(self.text)

    @property
    def nbytes(self) -> int:
        return len(self.text) + 4 * len(self.ids)


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A key of a known sequence whose first `text_bytes` bytes begin the prompt."""

    ids: tuple[int, ...]
    text_bytes: int
    source: str  # "memory" or the checkpoint file's path
    visible: bool = False


def text_digest(text: bytes | memoryview) -> bytes:
    return hashlib.blake2b(text, digest_size=16).digest()


def sequence_keys(ids: Sequence[int], tokenizer: TokenizerLike) -> list[KeyText]:
    """The token-text key of `ids` and, when it holds hidden reasoning, its visible key.

    Hidden reasoning: from a `<think>` token that directly follows `<｜Assistant｜>` up to (not
    including) the next `</think>` token; an unclosed one (a cut answer) is not hidden, since a
    client cannot render it back without its reasoning.
    """
    ids = tuple(int(t) for t in ids)
    pieces = [tokenizer.token_bytes(t) for t in ids]
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    ends = np.cumsum(lengths)
    keys = [KeyText(b"".join(pieces), ids, tuple(int(e) for e in ends), tuple(range(1, len(ids) + 1)))]
    hidden = hidden_spans(ids, tokenizer)
    if not hidden:
        return keys
    keep = np.ones(len(ids), dtype=bool)
    for start, stop in hidden:
        keep[start:stop] = False
    text = b"".join(p for p, k in zip(pieces, keep, strict=True) if k)
    vis_ends: list[int] = []
    vis_counts: list[int] = []
    offset = 0
    for i, (piece, k) in enumerate(zip(pieces, keep, strict=True)):
        if not k:
            continue
        offset += len(piece)
        if vis_ends and vis_ends[-1] == offset:
            continue  # an empty piece: keep the shorter count for this offset
        vis_ends.append(offset)
        vis_counts.append(i + 1)
    keys.append(KeyText(text, ids, tuple(vis_ends), tuple(vis_counts), visible=True))
    return keys


def hidden_spans(ids: Sequence[int], tokenizer: SpecialIds) -> list[tuple[int, int]]:
    """[start, stop) of every closed reasoning block that starts right after `<｜Assistant｜>`."""
    special = tokenizer.special_ids
    assistant, start_id, end_id = special[ASSISTANT], special[THINK_START], special[THINK_END]
    spans: list[tuple[int, int]] = []
    i = 1
    n = len(ids)
    while i < n:
        if ids[i] == start_id and ids[i - 1] == assistant:
            j = i + 1
            while j < n and ids[j] != end_id:
                j += 1
            if j >= n:
                break
            spans.append((i, j))
            i = j + 1
        else:
            i += 1
    return spans


class TokenMemory:
    """Keys of the token sequences this process finished, bounded, least recently used first out.

    Keys match whole (as checkpoint files do), so a sequence that a later turn extended is kept:
    a client that edits or regenerates that later turn still extends it. Lookup hashes the prompt once, snapshotting the
    digest at each distinct key length (as `CheckpointIndex.lookup` does), then compares bytes.
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        min_tokens: int = DEFAULT_MIN_TOKENS,
    ) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"token memory caps must be positive (entries={max_entries}, bytes={max_bytes})")
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        # sequence (ids) -> its keys with their digests; order = least recently used first
        self._sequences: collections.OrderedDict[tuple[int, ...], list[tuple[KeyText, bytes]]] = (
            collections.OrderedDict()
        )
        self._nbytes = 0

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def remember(self, ids: Sequence[int]) -> bool:
        """Keep the keys of one finished sequence; False when it is too short or too big to keep."""
        ids = tuple(int(t) for t in ids)
        if len(ids) < self.min_tokens:
            return False
        if ids in self._sequences:
            self._sequences.move_to_end(ids)
            return True
        keys = sequence_keys(ids, self.tokenizer)
        size = sum(k.nbytes for k in keys)
        if size > self.max_bytes:
            return False
        self._sequences[ids] = [(k, k.digest) for k in keys]
        self._nbytes += size
        while len(self._sequences) > self.max_entries or self._nbytes > self.max_bytes:
            self._drop(next(iter(self._sequences)))
        return True

    def _drop(self, ids: tuple[int, ...]) -> None:
        keys = self._sequences.pop(ids)
        self._nbytes -= sum(k.nbytes for k, _ in keys)

    def longest_prefix(self, prompt: bytes) -> KeyText | None:
        """The longest key whose whole text begins `prompt` (most recent on ties), marked used."""
        by_len: dict[int, list[tuple[tuple[int, ...], KeyText, bytes]]] = collections.defaultdict(list)
        for seq, keys in self._sequences.items():
            for key, digest in keys:
                if len(key.text) <= len(prompt):
                    by_len[len(key.text)].append((seq, key, digest))
        best: tuple[tuple[int, ...], KeyText] | None = None
        view = memoryview(prompt)
        hasher = hashlib.blake2b(digest_size=16)
        pos = 0
        for length in sorted(by_len):
            hasher.update(view[pos:length])
            pos = length
            digest = hasher.copy().digest()
            for seq, key, key_digest in reversed(by_len[length]):  # most recent first
                if key_digest == digest and prompt.startswith(key.text):
                    best = (seq, key)
                    break
        if best is None:
            return None
        self._sequences.move_to_end(best[0])
        return best[1]


class CheckpointPrefixes:
    """Keys of the checkpoint files in a directory: the file's text (whatever key kind ds4 or we
    wrote) with its payload tokens, and the visible key of a token-text file holding reasoning.

    The directory is re-scanned (headers and texts; a payload only for its tokens) on each
    lookup, since other servers write into it; unreadable files are skipped.
    """

    def __init__(self, directory: str | os.PathLike[str], tokenizer: TokenizerLike) -> None:
        self.directory = Path(directory)
        self.tokenizer = tokenizer
        self._index = CheckpointIndex(self.directory, keep_text=True)
        self._visible: dict[tuple[Path, int, int], KeyText | None] = {}
        self._marker = (ASSISTANT + THINK_START).encode("utf-8")

    def longest_prefix(self, prompt: bytes) -> tuple[KeyText, str] | None:
        """(key, file path) of the longest file key that begins `prompt`; None when none does."""
        try:
            self._index.refresh()
        except OSError as exc:
            logger.debug("text reuse: cannot scan %s: %s", self.directory, exc)
            return None
        best: tuple[KeyText, str] | None = None
        hit = self._index.lookup(prompt, explain=False).hit
        if hit is not None:
            tokens = self._tokens(hit.path)
            if tokens is not None and hit.text is not None:
                key = sequence_keys(tokens, self.tokenizer)[0]
                # Our token-text files decode to their text; a visible-keyed file (ds4's ext bits
                # 1 and 2) does not, and is matched on its whole text only.
                if key.text != hit.text:
                    key = KeyText(hit.text, key.ids, (len(hit.text),), (len(key.ids),), visible=True)
                best = (key, str(hit.path))
        for key, path in self._visible_keys():
            if len(key.text) <= len(prompt) and prompt.startswith(key.text):
                if best is None or len(key.text) > len(best[0].text):
                    best = (key, path)
        return best

    def _visible_keys(self) -> Iterable[tuple[KeyText, str]]:
        live = set()
        for entry in self._index.entries:
            if entry.text is None or self._marker not in entry.text:
                continue
            sig = (entry.path, entry.mtime_ns, entry.file_size)
            live.add(sig)
            if sig not in self._visible:
                tokens = self._tokens(entry.path)
                keys = sequence_keys(tokens, self.tokenizer) if tokens is not None else []
                self._visible[sig] = keys[1] if len(keys) > 1 and keys[0].text == entry.text else None
            key = self._visible[sig]
            if key is not None:
                yield key, str(entry.path)
        for sig in [s for s in self._visible if s not in live]:
            del self._visible[sig]

    def _tokens(self, path: Path) -> list[int] | None:
        try:
            with open_checkpoint(path, strict_trailer=False) as ck:
                return [int(t) for t in np.asarray(ck.payload.tokens)]
        except (OSError, KvcFormatError) as exc:
            logger.debug("text reuse: skipping %s: %s", path, exc)
            return None


class TextReuse:
    """Prompt text -> ids: the exact ids of the longest known key that begins it, then the
    engine's tokenization of the rest (`encode`); `remember` feeds finished sequences in."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        memory: TokenMemory | None = None,
        files: CheckpointPrefixes | None = None,
        *,
        min_tokens: int = DEFAULT_MIN_TOKENS,
    ) -> None:
        self.tokenizer = tokenizer
        self.memory = memory if memory is not None else TokenMemory(tokenizer, min_tokens=min_tokens)
        self.files = files
        self.min_tokens = min_tokens
        self._specials = [s.encode("utf-8") for s in tokenizer.special_ids]
        self.last_match: PrefixMatch | None = None  # for logs and tests

    def remember(self, ids: Sequence[int]) -> bool:
        return self.memory.remember(ids)

    def match(self, prompt: bytes) -> PrefixMatch | None:
        """The reusable prefix of `prompt` (cut at the first NUL, as the engine reads it)."""
        prompt = prompt.split(b"\0", 1)[0]
        candidates: list[tuple[KeyText, str]] = []
        mem = self.memory.longest_prefix(prompt)
        if mem is not None:
            candidates.append((mem, "memory"))
        if self.files is not None:
            found = self.files.longest_prefix(prompt)
            if found is not None:
                candidates.append(found)
        best: PrefixMatch | None = None
        for key, source in candidates:
            cut = self._safe_cut(key, prompt)
            if cut is None:
                continue
            end, count = cut
            if count < self.min_tokens or (best is not None and end <= best.text_bytes):
                continue
            best = PrefixMatch(key.ids[:count], end, source, key.visible)
        return best

    def encode(self, text: str) -> list[int]:
        """Ids of a rendered prompt: a known prefix's exact ids + the rest tokenized (§5.4)."""
        prompt = text.split("\0", 1)[0].encode("utf-8", "surrogatepass")
        found = self.match(prompt)
        self.last_match = found
        if found is None:
            return self.tokenizer.encode(text)
        rest = prompt[found.text_bytes :].decode("utf-8", "surrogatepass")
        return [*found.ids, *self.tokenizer.encode(rest)]

    def _safe_cut(self, key: KeyText, prompt: bytes) -> tuple[int, int] | None:
        """The longest cut of `key` (at most `MAX_BACKOFF_TOKENS` cuts back) that is a safe boundary.

        Unsafe: inside a UTF-8 character of the prompt (the rest would not be text), or inside one
        of the 7 special strings of the prompt (the engine tokenizes specials anywhere, so the
        prompt's special would become ordinary tokens on both sides of the cut).
        """
        for i in range(len(key.ends) - 1, max(-1, len(key.ends) - 1 - MAX_BACKOFF_TOKENS), -1):
            end = key.ends[i]
            if end < len(prompt) and prompt[end] & 0xC0 == 0x80:
                continue
            if self._inside_special(prompt, end):
                continue
            return end, key.counts[i]
        return None

    def _inside_special(self, prompt: bytes, cut: int) -> bool:
        for special in self._specials:
            start = prompt.find(special, max(0, cut - len(special) + 1), cut + len(special) - 1)
            while start != -1 and start < cut:
                if start + len(special) > cut:
                    return True
                start = prompt.find(special, start + 1, cut + len(special) - 1)
        return False
