"""Longest-prefix lookup over an `EntryTable` (ds4's `find_text_prefix`), and why a lookup missed.

`LookupFilter` is the one rule for which entries a lookup may use; the search, the miss
explanation and the per-filter counts all ask it. Best = longest text, ties to more tokens,
then to the earlier indexed entry.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
from collections.abc import Callable, Container
from pathlib import Path

import numpy as np

from .entry_table import EntryTable, IndexEntry


@dataclasses.dataclass(frozen=True, slots=True)
class LookupFilter:
    """Which entries a lookup may use.

    An entry is skipped when its path is in `exclude` (set aside by the caller), its tokens are
    below `min_tokens`, its context is larger than `ctx_size` (when given), or its quantization
    differs from `quant_bits` (when given: the caller rejects other quantizations).
    """

    min_tokens: int = 0
    ctx_size: int | None = None
    quant_bits: int | None = None
    exclude: Container[Path] = frozenset()

    def skip_reason(self, entry: IndexEntry, prompt_len: int | None = None) -> str | None:
        """Why `entry` is not usable for a prompt of `prompt_len` bytes ("kind: detail"), or None."""
        h = entry.header
        if entry.path in self.exclude:
            return "set_aside: excluded by the caller"
        if prompt_len is not None and entry.text_bytes > prompt_len:
            return f"text_longer_than_prompt: {entry.text_bytes} > {prompt_len} bytes"
        if h.tokens < self.min_tokens:
            return f"below_min_tokens: tokens {h.tokens} < min {self.min_tokens}"
        if self.ctx_size is not None and h.ctx_size > self.ctx_size:
            return f"ctx_too_large: ctx_size {h.ctx_size} > current {self.ctx_size}"
        if self.quant_bits is not None and h.quant_bits != self.quant_bits:
            return f"quant_mismatch: quant {h.quant_bits} != current {self.quant_bits}"
        return None

    def usable_top(self, group: list[IndexEntry]) -> IndexEntry | None:
        """The group's usable entry with most tokens (the first such on ties), or None."""
        top: IndexEntry | None = None
        for e in group:
            if self.skip_reason(e) is None and (top is None or e.header.tokens > top.header.tokens):
                top = e
        return top


@dataclasses.dataclass(frozen=True, slots=True)
class LookupTally:
    """How the filters split the index for one lookup (see `LookupResult`)."""

    candidates: int
    hashed_lengths: int
    skipped: dict[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class LookupResult:
    """Outcome of a prefix lookup, with enough detail to explain a miss in a trace.

    hit: the chosen entry, or None.
    nearest: on a miss, the valid entry sharing the longest byte prefix with the prompt.
    diverge_at: byte offset where the prompt and `nearest`'s text first differ (== the
        entry's text length when its whole text is a prefix of the prompt).
    nearest_skip: why `nearest` was not usable when its whole text matched (filter reason).
    shared_bytes: how many leading bytes of the prompt some entry's text shares with it, hit
        or miss (0 when not explained): past the hit, where known prompts and this one part.
    candidates / hashed_lengths / skipped (counted on first use, from the entries the lookup
    saw, so a lookup does not walk the whole index): entries that passed the filters, their
    distinct text lengths, and how many entries each filter removed.
    """

    hit: IndexEntry | None
    prompt_bytes: int
    nearest: IndexEntry | None = None
    diverge_at: int | None = None
    nearest_skip: str | None = None
    shared_bytes: int = 0
    count: Callable[[], LookupTally] | None = dataclasses.field(default=None, repr=False, compare=False)
    _tally: LookupTally | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def tally(self) -> LookupTally:
        if self._tally is None:
            tally = self.count() if self.count is not None else LookupTally(0, 0, {})
            object.__setattr__(self, "_tally", tally)
        assert self._tally is not None
        return self._tally

    @property
    def candidates(self) -> int:
        return self.tally.candidates

    @property
    def hashed_lengths(self) -> int:
        return self.tally.hashed_lengths

    @property
    def skipped(self) -> dict[str, int]:
        return self.tally.skipped

    def describe(self) -> str:
        """One line for logs / --trace."""
        if self.hit is not None:
            h = self.hit
            return f"hit file={h.path.name} text={h.text_bytes} tokens={h.header.tokens} prompt={self.prompt_bytes}"
        skipped = " ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()) if v)
        tail = f" skipped: {skipped}" if skipped else ""
        if self.nearest is None:
            return f"miss: no usable entry (prompt={self.prompt_bytes} bytes){tail}"
        n = self.nearest
        if self.nearest_skip is not None:
            return (
                f"miss: nearest entry {n.path.name} matches all {n.text_bytes} text bytes but was skipped: "
                f"{self.nearest_skip}{tail}"
            )
        return (
            f"miss: text diverges at byte {self.diverge_at} from the nearest entry {n.path.name} "
            f"(text={n.text_bytes} bytes, prompt={self.prompt_bytes} bytes){tail}"
        )


def lookup(table: EntryTable, prompt: bytes, flt: LookupFilter, *, explain: bool = True) -> LookupResult:
    """Longest usable entry whose text is a byte prefix of `prompt` (see `CheckpointIndex.lookup`)."""
    best = _longest_text_prefix(table, prompt, flt)
    hashed = _longest_hashed_prefix(table, prompt, flt)
    if hashed is not None and (
        best is None or (hashed.text_bytes, table.sort_key(hashed)) > (best.text_bytes, table.sort_key(best))
    ):
        best = hashed
    snapshot = table.snapshot()
    result = LookupResult(best, len(prompt), count=lambda: _tally(snapshot, len(prompt), flt))
    if not explain or (best is not None and not table.trust_text):  # a hit walks no texts
        return result
    found = _nearest_sorted(table, prompt) if table.trust_text else _nearest_walk(table, prompt)
    if found is None:
        return result
    nearest, common = found
    result = dataclasses.replace(result, shared_bytes=common)
    if best is not None:
        return result
    skip = flt.skip_reason(nearest, len(prompt)) if common == nearest.text_bytes else None
    return dataclasses.replace(result, nearest=nearest, diverge_at=common, nearest_skip=skip)


def common_prefix(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if a.startswith(b) if len(a) >= len(b) else b.startswith(a):
        return n
    diff = np.flatnonzero(np.frombuffer(a, np.uint8, count=n) != np.frombuffer(b, np.uint8, count=n))
    return int(diff[0])


def _prefix_range_end(texts: list[bytes], head: bytes, lo: int) -> int:
    """End of the run of sorted `texts` (from `lo`) that start with `head`."""
    stem = head.rstrip(b"\xff")
    if not stem:
        return len(texts)
    return bisect.bisect_left(texts, stem[:-1] + bytes([stem[-1] + 1]), lo)


def _longest_text_prefix(table: EntryTable, prompt: bytes, flt: LookupFilter) -> IndexEntry | None:
    """Walk down the sorted texts: each step finds the next shorter text that can still be a prefix.

    Invariant: no text at index >= `hi` is a usable prefix of the prompt. The text just
    below `hi` is the greatest one <= the current probe (a prefix of the prompt); if it is
    a prefix its group is tried, else every prefix of the prompt shorter than their common
    part sorts below the probe cut to that common part.
    """
    texts = table.texts
    hi = bisect.bisect_right(texts, prompt)
    while hi > 0:
        text = texts[hi - 1]
        if prompt.startswith(text):
            top = flt.usable_top(table.by_text[text])
            if top is not None:
                return top
            if not text:
                return None
            probe_len = len(text) - 1
        else:
            probe_len = common_prefix(prompt, text)
        hi = bisect.bisect_right(texts, prompt[:probe_len], 0, hi - 1)
    return None


def _longest_hashed_prefix(table: EntryTable, prompt: bytes, flt: LookupFilter) -> IndexEntry | None:
    """Entries matched by name: one SHA-1 pass snapshotting the digest at each stored length."""
    lengths = table.lengths
    stop = bisect.bisect_right(lengths, len(prompt))
    if stop == 0:
        return None
    best: IndexEntry | None = None
    hasher = hashlib.sha1()
    pos = 0
    view = memoryview(prompt)
    for length in lengths[:stop]:
        hasher.update(view[pos:length])
        pos = length
        group = table.by_len[length].get(hasher.copy().hexdigest())
        if group:
            top = flt.usable_top(group)
            if top is not None:
                best = top  # lengths ascend: a later match is longer
    return best


def _tally(entries: tuple[IndexEntry, ...], prompt_len: int, flt: LookupFilter) -> LookupTally:
    skipped: collections.Counter[str] = collections.Counter()
    lengths: set[int] = set()
    candidates = 0
    for entry in entries:
        reason = flt.skip_reason(entry, prompt_len)
        if reason is not None:
            skipped[reason.split(":")[0]] += 1
            continue
        candidates += 1
        lengths.add(entry.text_bytes)
    return LookupTally(candidates, len(lengths), dict(skipped))


def _nearest_walk(table: EntryTable, prompt: bytes) -> tuple[IndexEntry, int] | None:
    """The entry sharing the longest prefix with the prompt (then a whole-text match, then more
    tokens, then the earlier one), by walking every kept text: for texts not verified against
    their names, which are not in the sorted list."""
    nearest: IndexEntry | None = None
    best_common = -1
    for entry in table.values():
        if entry.text is None:
            continue
        common = common_prefix(prompt, entry.text)
        rank = (common, common == entry.text_bytes, entry.header.tokens)
        if nearest is None or rank > (best_common, best_common == nearest.text_bytes, nearest.header.tokens):
            nearest, best_common = entry, common
    return None if nearest is None else (nearest, best_common)


def _nearest_sorted(table: EntryTable, prompt: bytes) -> tuple[IndexEntry, int] | None:
    """`_nearest_walk`'s ranking on the sorted texts.

    The longest common prefix with the prompt is found at the prompt's neighbours in sort
    order; every text sharing that much is in one run of the sorted list, and within it
    a text equal to that common part (a whole-text match) sorts first.
    """
    texts = table.texts
    if not texts:
        return None
    at = bisect.bisect_left(texts, prompt)
    common = max(common_prefix(prompt, texts[j]) for j in (at - 1, at) if 0 <= j < len(texts))
    head = prompt[:common]
    lo = bisect.bisect_left(texts, head)
    if texts[lo] == head:
        group = table.by_text[head]
    else:
        hi = _prefix_range_end(texts, head, lo)
        key = max(table.group_key[lo:hi])
        group = table.by_text[texts[table.group_key.index(key, lo, hi)]]
    return max(group, key=table.sort_key), common
