"""The index's table of valid checkpoints, with the structures a prefix lookup searches.

`EntryTable` maps path -> `IndexEntry` and keeps its lookup structures in step with every
insert and removal. It wraps a dict instead of subclassing one, so no dict method (`update`,
`setdefault`, `popitem`) can change the entries behind the structures' back.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, ValuesView
from pathlib import Path

from .header import KvcHeader

_SEQ_BITS = 40  # insertion numbers fit below tokens in one int sort key


@dataclasses.dataclass(frozen=True, slots=True)
class IndexEntry:
    """One valid checkpoint: its header, its text and how big it is on disk."""

    path: Path
    sha1: str
    header: KvcHeader
    text_bytes: int
    file_size: int
    mtime_ns: int
    text: bytes | None = dataclasses.field(default=None, repr=False)

    @property
    def tokens(self) -> int:
        return self.header.tokens


class EntryTable:
    """path -> entry, with the lookup structures kept in step.

    Entries whose text is known to hash to their name (`trust_text`) sit in `texts`, the sorted
    distinct texts, so the texts that are prefixes of a prompt are found by bisection. The others
    (no text kept, or text not verified) are matched by name: `by_len[text length][sha1]`.
    Groups list their entries in insertion order (`seq`), the order the old full walk saw them in.
    """

    def __init__(self, trust_text: bool) -> None:
        self.trust_text = trust_text
        self._entries: dict[Path, IndexEntry] = {}
        self.seq: dict[Path, int] = {}
        self._next_seq = 0
        self.texts: list[bytes] = []
        self.by_text: dict[bytes, list[IndexEntry]] = {}
        self.group_key: list[int] = []  # per text in `texts`: best sort_key of its group
        self.lengths: list[int] = []
        self.by_len: dict[int, dict[str, list[IndexEntry]]] = {}
        self.by_sha: dict[str, list[IndexEntry]] = {}
        self._snapshot: tuple[IndexEntry, ...] | None = ()

    # -- the mapping --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, path: object) -> bool:
        return path in self._entries

    def __iter__(self) -> Iterator[Path]:
        return iter(self._entries)

    def __getitem__(self, path: Path) -> IndexEntry:
        return self._entries[path]

    def values(self) -> ValuesView[IndexEntry]:
        return self._entries.values()

    def __setitem__(self, path: Path, entry: IndexEntry) -> None:
        old = self._entries.get(path)
        if old is not None:
            self._unlink(old)
        else:
            self.seq[path] = self._next_seq
            self._next_seq += 1
        self._entries[path] = entry
        self._link(entry)

    def __delitem__(self, path: Path) -> None:
        self._unlink(self._entries.pop(path))
        del self.seq[path]

    def pop(self, path: Path, default: IndexEntry | None = None) -> IndexEntry | None:
        entry = self._entries.get(path)
        if entry is None:
            return default
        del self[path]
        return entry

    def clear(self) -> None:
        for path in list(self._entries):
            del self[path]

    # -- lookup structures --------------------------------------------------------------------

    def sort_key(self, entry: IndexEntry) -> int:
        """More tokens first, then the earlier inserted: the full walk's tie rule as one int."""
        return (entry.header.tokens << _SEQ_BITS) - self.seq[entry.path]

    def snapshot(self) -> tuple[IndexEntry, ...]:
        if self._snapshot is None:
            self._snapshot = tuple(self._entries.values())
        return self._snapshot

    def _by_seq(self, group: list[IndexEntry], entry: IndexEntry) -> None:
        bisect.insort(group, entry, key=lambda e: self.seq[e.path])

    def _link(self, entry: IndexEntry) -> None:
        self._snapshot = None
        self._by_seq(self.by_sha.setdefault(entry.sha1, []), entry)
        if entry.text is not None and self.trust_text:
            text = entry.text
            group = self.by_text.get(text)
            if group is None:
                group = self.by_text[text] = []
                at = bisect.bisect_left(self.texts, text)
                self.texts.insert(at, text)
                self.group_key.insert(at, 0)
            self._by_seq(group, entry)
            self._rekey(text)
            return
        by_sha = self.by_len.get(entry.text_bytes)
        if by_sha is None:
            by_sha = self.by_len[entry.text_bytes] = {}
            bisect.insort(self.lengths, entry.text_bytes)
        self._by_seq(by_sha.setdefault(entry.sha1, []), entry)

    def _unlink(self, entry: IndexEntry) -> None:
        self._snapshot = None
        same_sha = self.by_sha[entry.sha1]
        same_sha.remove(entry)
        if not same_sha:
            del self.by_sha[entry.sha1]
        if entry.text is not None and self.trust_text:
            group = self.by_text[entry.text]
            group.remove(entry)
            if group:
                self._rekey(entry.text)
                return
            del self.by_text[entry.text]
            at = bisect.bisect_left(self.texts, entry.text)
            del self.texts[at]
            del self.group_key[at]
            return
        by_sha = self.by_len[entry.text_bytes]
        group = by_sha[entry.sha1]
        group.remove(entry)
        if not group:
            del by_sha[entry.sha1]
            if not by_sha:
                del self.by_len[entry.text_bytes]
                self.lengths.remove(entry.text_bytes)

    def _rekey(self, text: bytes) -> None:
        at = bisect.bisect_left(self.texts, text)
        self.group_key[at] = max(self.sort_key(e) for e in self.by_text[text])
