"""Directory index of checkpoints: header + text scan, incremental refresh, longest-prefix lookup.

The scan never reads payloads. `refresh()` re-stats the directory and re-reads only new or
changed files, because other processes (ds4 servers, other vLLM ranks, `ds4-kv gc`) add,
touch and remove files at any time. Not thread-safe: one index per thread, or a lock.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import hashlib
import os
import stat
import time
from collections.abc import Callable, Container
from pathlib import Path

import numpy as np

from .constants import KV_NAME_RE
from .errors import KvcFormatError
from .file import read_prefix, text_sha1
from .header import KvcHeader

PathArg = str | os.PathLike[str]
_StatSig = tuple[int, int, int, int]

#: A directory whose mtime/ctime is at least this old when listed is trusted to be unchanged while
#: they stay the same; a younger one is listed again (a change within the same timestamp tick as
#: the listing would not move them).
DIR_SETTLE_NS = 1_000_000_000
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


@dataclasses.dataclass(frozen=True, slots=True)
class RefreshStats:
    added: int = 0
    changed: int = 0
    removed: int = 0
    invalid: int = 0


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
    candidates / hashed_lengths / skipped (counted on first use, from the entries the lookup
    saw, so a lookup does not walk the whole index): entries that passed the filters, their
    distinct text lengths, and how many entries each filter removed.
    """

    hit: IndexEntry | None
    prompt_bytes: int
    nearest: IndexEntry | None = None
    diverge_at: int | None = None
    nearest_skip: str | None = None
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


def _not_followed(mode: int) -> str:
    """The invalid-entry reason of a `<sha1>.kv` name that is not a regular file."""
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
    return f"file_type: {kind}, not a regular file; never followed or read"


def _common_prefix(a: bytes, b: bytes) -> int:
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


class _EntryTable(dict[Path, IndexEntry]):
    """path -> entry, keeping the lookup structures in step with every insert and removal.

    Entries whose text is known to hash to their name (`trust_text`) sit in `texts`, the sorted
    distinct texts, so the texts that are prefixes of a prompt are found by bisection. The others
    (no text kept, or text not verified) are matched by name: `by_len[text length][sha1]`.
    Groups list their entries in insertion order (`seq`), the order the old full walk saw them in.
    """

    def __init__(self, trust_text: bool) -> None:
        super().__init__()
        self.trust_text = trust_text
        self.seq: dict[Path, int] = {}
        self._next_seq = 0
        self.texts: list[bytes] = []
        self.by_text: dict[bytes, list[IndexEntry]] = {}
        self.group_key: list[int] = []  # per text in `texts`: best sort_key of its group
        self.lengths: list[int] = []
        self.by_len: dict[int, dict[str, list[IndexEntry]]] = {}
        self.by_sha: dict[str, list[IndexEntry]] = {}
        self._snapshot: tuple[IndexEntry, ...] | None = ()

    def sort_key(self, entry: IndexEntry) -> int:
        """More tokens first, then the earlier inserted: the full walk's tie rule as one int."""
        return (entry.header.tokens << _SEQ_BITS) - self.seq[entry.path]

    def snapshot(self) -> tuple[IndexEntry, ...]:
        if self._snapshot is None:
            self._snapshot = tuple(self.values())
        return self._snapshot

    def __setitem__(self, path: Path, entry: IndexEntry) -> None:
        if path in self:
            self._unlink(super().__getitem__(path))
        else:
            self.seq[path] = self._next_seq
            self._next_seq += 1
        super().__setitem__(path, entry)
        self._link(entry)

    def __delitem__(self, path: Path) -> None:
        self._unlink(super().__getitem__(path))
        super().__delitem__(path)
        del self.seq[path]

    def pop(self, path: Path, *default: object):  # type: ignore[override]
        if path not in self:
            if default:
                return default[0]
            raise KeyError(path)
        entry = super().__getitem__(path)
        del self[path]
        return entry

    def clear(self) -> None:
        for path in list(self):
            del self[path]

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


class CheckpointIndex:
    """The valid checkpoints of one directory, keyed by path.

    Files are valid when their name is `<40 hex>.kv`, their header parses, header + text +
    payload fit the file, and (with `verify_text`, default) SHA-1(text) matches the name.
    Invalid files are remembered in `invalid` (path -> reason) and, like ds4, never deleted
    here. With `keep_text` (default) entry texts stay in memory to explain misses.
    """

    def __init__(self, directory: PathArg, *, keep_text: bool = True, verify_text: bool = True) -> None:
        self.directory = Path(directory)
        self.keep_text = keep_text
        self.verify_text = verify_text
        self._entries: _EntryTable = _EntryTable(trust_text=verify_text)
        self._invalid: dict[Path, str] = {}
        self._sigs: dict[Path, _StatSig] = {}
        self._names: dict[str, tuple[Path, int]] = {}  # listed name -> (path, inode)
        self._dir_sig: tuple[int, int, int] | None = None  # a settled, fully listed directory

    @property
    def entries(self) -> list[IndexEntry]:
        return list(self._entries.values())

    @property
    def invalid(self) -> dict[Path, str]:
        return dict(self._invalid)

    @property
    def total_bytes(self) -> int:
        """Bytes of valid files: what counts against the budget (invalid ones do not, as in ds4)."""
        return sum(e.file_size for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def refresh(self, *, restat: bool = True) -> RefreshStats:
        """Re-list the directory; re-read headers of new or changed files, drop vanished ones.

        restat (default): stat every file, so in-place rewrites (`touch_checkpoint`'s hit count
        and last-use time, a KTM trailer rewrite) are seen. Without it only what the listing
        shows is checked: new names and names whose inode changed (a file replaced by rename),
        and a directory whose mtime/ctime/inode are unchanged since a settled listing is not
        listed at all. In-place rewrites change no prefix-match field (text, tokens, context,
        quant), so lookups may use the cheap form; eviction, which orders by hits, restats.
        """
        try:
            dst = os.stat(self.directory)
        except FileNotFoundError:
            self._names, self._dir_sig = {}, None
            return RefreshStats(removed=self._drop_unseen(set()))
        dir_sig = (dst.st_mtime_ns, dst.st_ctime_ns, dst.st_ino)
        if not restat and dir_sig == self._dir_sig:
            return RefreshStats()
        listed_at = time.time_ns()
        added = changed = invalid = 0
        names: dict[str, tuple[Path, int]] = {}
        known_names = self._names
        sigs = self._sigs
        try:
            it = os.scandir(self.directory)
        except FileNotFoundError:
            it = None
        if it is not None:
            with it:
                for dirent in it:
                    name = dirent.name
                    known = known_names.get(name)
                    if known is None:
                        if not KV_NAME_RE.match(name):
                            continue
                        path = Path(dirent.path)
                    else:
                        path = known[0]
                        if not restat and dirent.inode() == known[1]:
                            names[name] = known
                            continue
                    try:
                        st = dirent.stat(follow_symlinks=False)  # a link is judged, never followed
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        continue
                    names[name] = (path, st.st_ino)
                    sig = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                    if sigs.get(path) == sig:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        read = functools.partial(self._read, path, name, st.st_mtime_ns)
                    else:
                        read = functools.partial(_not_followed, st.st_mode)
                    outcome = self._update(path, sig, read)
                    if outcome is not None:
                        added += outcome[0] == "added"
                        changed += outcome[0] == "changed"
                        invalid += outcome[1]
        # Names are compared as strings: hashing 10,000 Paths costs more than the listing.
        vanished = [known_names[n][0] for n in known_names.keys() - names.keys()]
        self._names = names
        if len(sigs) - len(vanished) == len(names):
            removed = self._drop_paths(vanished)
        else:  # paths known from elsewhere than this listing (entries set by hand)
            removed = self._drop_unseen({path for path, _ in names.values()})
        settled = listed_at - max(dst.st_mtime_ns, dst.st_ctime_ns) >= DIR_SETTLE_NS
        self._dir_sig = dir_sig if settled and it is not None else None
        return RefreshStats(added, changed, removed, invalid)

    def _update(self, path: Path, sig: tuple, read) -> tuple[str, bool] | None:
        """Re-read ``path`` if its signature changed: None, or ("added"|"changed", whether invalid)."""
        if self._sigs.get(path) == sig:
            return None
        known = path in self._sigs
        self._sigs[path] = sig
        self._entries.pop(path, None)
        self._invalid.pop(path, None)
        entry_or_reason = read()
        kind = "changed" if known else "added"
        if isinstance(entry_or_reason, str):
            self._invalid[path] = entry_or_reason
            return kind, True
        self._entries[path] = entry_or_reason
        return kind, False

    def _drop_paths(self, paths: list[Path]) -> int:
        """Forget these files; returns how many valid entries went."""
        removed = 0
        for path in paths:
            self._sigs.pop(path, None)
            removed += path in self._entries
            self._entries.pop(path, None)
            self._invalid.pop(path, None)
        return removed

    def _drop_unseen(self, seen) -> int:
        """Forget files no longer in the directory; returns how many valid entries went."""
        removed = 0
        for path in list(self._sigs):
            if path not in seen:
                del self._sigs[path]
                removed += path in self._entries
                self._entries.pop(path, None)
                self._invalid.pop(path, None)
        return removed

    def _read(self, path: Path, name: str, mtime_ns: int) -> IndexEntry | str:
        try:
            prefix = read_prefix(path, with_text=True, follow_symlinks=False)
        except KvcFormatError as exc:
            return f"{exc.field}: {exc.reason}"
        except OSError as exc:
            return f"unreadable: {exc.strerror or exc}"
        sha = name[:40].lower()
        assert prefix.text is not None
        if self.verify_text and text_sha1(prefix.text) != sha:
            return f"file_name: text SHA-1 is {text_sha1(prefix.text)}, not the name's"
        return IndexEntry(
            path=path,
            sha1=sha,
            header=prefix.header,
            text_bytes=prefix.text_bytes,
            file_size=prefix.file_size,
            mtime_ns=mtime_ns,
            text=prefix.text if self.keep_text else None,
        )

    def get(self, sha1: str) -> IndexEntry | None:
        """The first indexed entry named `sha1` (a name can repeat only across directories)."""
        same = self._entries.by_sha.get(sha1.lower())
        return same[0] if same else None

    def lookup(
        self,
        prompt: bytes,
        *,
        min_tokens: int = 0,
        ctx_size: int | None = None,
        quant_bits: int | None = None,
        reject_different_quant: bool = False,
        explain: bool = True,
        exclude: Container[Path] = frozenset(),
    ) -> LookupResult:
        """Longest entry whose text is a byte prefix of `prompt` (ds4's `find_text_prefix`).

        Entries are skipped when text_bytes > len(prompt), tokens < min_tokens, ctx_size >
        the current ctx_size (when given), or, with reject_different_quant, quant_bits
        differ. Best = longest text, ties to more tokens, then to the earlier indexed entry.
        Entries with verified texts are kept sorted, so the prefixes of the prompt are found by
        bisection (cost ~ log(entries) per prefix tried, whatever the index size); entries
        without text are matched by one SHA-1 pass over their distinct lengths. Call
        `refresh()` first to see other processes' changes. Unlike ds4 the prompt is not cut at a NUL.
        Entries whose path is in `exclude` (set aside by the caller) are skipped as "set_aside".
        """
        prompt = bytes(prompt)
        filters = (min_tokens, ctx_size, quant_bits if reject_different_quant else None, exclude)
        best = self._longest_text_prefix(prompt, filters)
        hashed = self._longest_hashed_prefix(prompt, filters)
        table = self._entries
        if hashed is not None and (
            best is None
            or (hashed.text_bytes, table.sort_key(hashed)) > (best.text_bytes, table.sort_key(best))
        ):
            best = hashed
        snapshot = table.snapshot()
        result = LookupResult(
            best,
            len(prompt),
            count=lambda: self._tally(
                snapshot, len(prompt), min_tokens, ctx_size, quant_bits, reject_different_quant, exclude
            ),
        )
        if best is not None or not explain:
            return result
        if table.trust_text:
            return self._explain_miss_sorted(
                result, prompt, min_tokens, ctx_size, quant_bits, reject_different_quant
            )
        return self._explain_miss(result, prompt, min_tokens, ctx_size, quant_bits, reject_different_quant)

    @staticmethod
    def _usable_top(
        group: list[IndexEntry], filters: tuple[int, int | None, int | None, Container[Path]]
    ) -> IndexEntry | None:
        """The group's usable entry with most tokens (the first such on ties), or None."""
        min_tokens, ctx_size, quant_bits, exclude = filters
        top: IndexEntry | None = None
        for e in group:
            h = e.header
            if (
                e.path in exclude
                or h.tokens < min_tokens
                or (ctx_size is not None and h.ctx_size > ctx_size)
                or (quant_bits is not None and h.quant_bits != quant_bits)
            ):
                continue
            if top is None or h.tokens > top.header.tokens:
                top = e
        return top

    def _longest_text_prefix(
        self, prompt: bytes, filters: tuple[int, int | None, int | None, Container[Path]]
    ) -> IndexEntry | None:
        """Walk down the sorted texts: each step finds the next shorter text that can still be a prefix.

        Invariant: no text at index >= `hi` is a usable prefix of the prompt. The text just
        below `hi` is the greatest one <= the current probe (a prefix of the prompt); if it is
        a prefix its group is tried, else every prefix of the prompt shorter than their common
        part sorts below the probe cut to that common part.
        """
        texts = self._entries.texts
        hi = bisect.bisect_right(texts, prompt)
        while hi > 0:
            text = texts[hi - 1]
            if prompt.startswith(text):
                top = self._usable_top(self._entries.by_text[text], filters)
                if top is not None:
                    return top
                if not text:
                    return None
                probe_len = len(text) - 1
            else:
                probe_len = _common_prefix(prompt, text)
            hi = bisect.bisect_right(texts, prompt[:probe_len], 0, hi - 1)
        return None

    def _longest_hashed_prefix(
        self, prompt: bytes, filters: tuple[int, int | None, int | None, Container[Path]]
    ) -> IndexEntry | None:
        """Entries matched by name: one SHA-1 pass snapshotting the digest at each stored length."""
        table = self._entries
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
                top = self._usable_top(group, filters)
                if top is not None:
                    best = top  # lengths ascend: a later match is longer
        return best

    @classmethod
    def _tally(
        cls,
        entries: tuple[IndexEntry, ...],
        prompt_len: int,
        min_tokens: int,
        ctx_size: int | None,
        quant_bits: int | None,
        reject_different_quant: bool,
        exclude: Container[Path],
    ) -> LookupTally:
        skipped: collections.Counter[str] = collections.Counter()
        lengths: set[int] = set()
        candidates = 0
        for entry in entries:
            if entry.path in exclude:
                skipped["set_aside"] += 1
                continue
            reason = cls._skip_reason(
                entry, prompt_len, min_tokens, ctx_size, quant_bits, reject_different_quant
            )
            if reason is not None:
                skipped[reason.split(":")[0]] += 1
                continue
            candidates += 1
            lengths.add(entry.text_bytes)
        return LookupTally(candidates, len(lengths), dict(skipped))

    @staticmethod
    def _skip_reason(
        entry: IndexEntry,
        prompt_len: int,
        min_tokens: int,
        ctx_size: int | None,
        quant_bits: int | None,
        reject_different_quant: bool,
    ) -> str | None:
        h = entry.header
        if entry.text_bytes > prompt_len:
            return f"text_longer_than_prompt: {entry.text_bytes} > {prompt_len} bytes"
        if h.tokens < min_tokens:
            return f"below_min_tokens: tokens {h.tokens} < min {min_tokens}"
        if ctx_size is not None and h.ctx_size > ctx_size:
            return f"ctx_too_large: ctx_size {h.ctx_size} > current {ctx_size}"
        if reject_different_quant and quant_bits is not None and h.quant_bits != quant_bits:
            return f"quant_mismatch: quant {h.quant_bits} != current {quant_bits}"
        return None

    def _explain_miss(
        self,
        result: LookupResult,
        prompt: bytes,
        min_tokens: int,
        ctx_size: int | None,
        quant_bits: int | None,
        reject_different_quant: bool,
    ) -> LookupResult:
        """Find the entry sharing the longest prefix with the prompt by walking every kept text.

        Used when texts are not verified against names (they are then not in the sorted list).
        """
        nearest: IndexEntry | None = None
        best_common = -1
        for entry in self._entries.values():
            if entry.text is None:
                continue
            common = _common_prefix(prompt, entry.text)
            full = common == entry.text_bytes
            rank = (common, full, entry.header.tokens)
            if nearest is None or rank > (
                best_common,
                best_common == nearest.text_bytes,
                nearest.header.tokens,
            ):
                nearest, best_common = entry, common
        if nearest is None:
            return result
        skip = None
        if best_common == nearest.text_bytes:
            skip = self._skip_reason(
                nearest, len(prompt), min_tokens, ctx_size, quant_bits, reject_different_quant
            )
        return dataclasses.replace(result, nearest=nearest, diverge_at=best_common, nearest_skip=skip)

    def _explain_miss_sorted(
        self,
        result: LookupResult,
        prompt: bytes,
        min_tokens: int,
        ctx_size: int | None,
        quant_bits: int | None,
        reject_different_quant: bool,
    ) -> LookupResult:
        """`_explain_miss` on the sorted texts: same ranking (common prefix, whole text, tokens, order).

        The longest common prefix with the prompt is found at the prompt's neighbours in sort
        order; every text sharing that much is in one run of the sorted list, and within it
        a text equal to that common part (a whole-text match) sorts first.
        """
        table = self._entries
        texts = table.texts
        if not texts:
            return result
        at = bisect.bisect_left(texts, prompt)
        common = max(_common_prefix(prompt, texts[j]) for j in (at - 1, at) if 0 <= j < len(texts))
        head = prompt[:common]
        lo = bisect.bisect_left(texts, head)
        if texts[lo] == head:
            group = table.by_text[head]
        else:
            hi = _prefix_range_end(texts, head, lo)
            key = max(table.group_key[lo:hi])
            group = table.by_text[texts[table.group_key.index(key, lo, hi)]]
        nearest = max(group, key=table.sort_key)
        skip = None
        if common == nearest.text_bytes:
            skip = self._skip_reason(
                nearest, len(prompt), min_tokens, ctx_size, quant_bits, reject_different_quant
            )
        return dataclasses.replace(result, nearest=nearest, diverge_at=common, nearest_skip=skip)
