"""Directory index of checkpoints: header + text scan, incremental refresh, longest-prefix lookup.

The scan never reads payloads. `refresh()` re-stats the directory and re-reads only new or
changed files, because other processes (ds4 servers, other vLLM ranks, `ds4-kv gc`) add,
touch and remove files at any time. Not thread-safe: one index per thread, or a lock.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
import stat
from collections.abc import Container
from pathlib import Path

import numpy as np

from .constants import KV_NAME_RE
from .errors import KvcFormatError
from .file import read_prefix, text_sha1
from .header import KvcHeader

PathArg = str | os.PathLike[str]
_StatSig = tuple[int, int, int, int]


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
class LookupResult:
    """Outcome of a prefix lookup, with enough detail to explain a miss in a trace.

    hit: the chosen entry, or None.
    nearest: on a miss, the valid entry sharing the longest byte prefix with the prompt.
    diverge_at: byte offset where the prompt and `nearest`'s text first differ (== the
        entry's text length when its whole text is a prefix of the prompt).
    nearest_skip: why `nearest` was not usable when its whole text matched (filter reason).
    skipped: how many entries each filter removed.
    """

    hit: IndexEntry | None
    prompt_bytes: int
    candidates: int
    hashed_lengths: int
    skipped: dict[str, int]
    nearest: IndexEntry | None = None
    diverge_at: int | None = None
    nearest_skip: str | None = None

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
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.frombuffer(a, np.uint8, count=n) != np.frombuffer(b, np.uint8, count=n))
    return int(diff[0])


class CheckpointIndex:
    """The valid checkpoints of one directory, keyed by path.

    Files are valid when their name is `<40 hex>.kv`, they are regular files (a link is listed
    as invalid and never followed), their header parses, header + text + payload fit the file,
    and (with `verify_text`, default) SHA-1(text) matches the name.
    Invalid files are remembered in `invalid` (path -> reason) and, like ds4, never deleted
    here. With `keep_text` (default) entry texts stay in memory to explain misses.
    """

    def __init__(self, directory: PathArg, *, keep_text: bool = True, verify_text: bool = True) -> None:
        self.directory = Path(directory)
        self.keep_text = keep_text
        self.verify_text = verify_text
        self._entries: dict[Path, IndexEntry] = {}
        self._invalid: dict[Path, str] = {}
        self._sigs: dict[Path, _StatSig] = {}

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

    def refresh(self) -> RefreshStats:
        """Re-stat the directory; re-read headers of new or changed files, drop vanished ones."""
        added = changed = invalid = 0
        seen: set[Path] = set()
        try:
            it = os.scandir(self.directory)
        except FileNotFoundError:
            it = None
        if it is not None:
            with it:
                for dirent in it:
                    if not KV_NAME_RE.match(dirent.name):
                        continue
                    path = Path(dirent.path)
                    try:
                        st = dirent.stat(follow_symlinks=False)  # a link is judged, never followed
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        continue
                    seen.add(path)
                    sig = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                    if stat.S_ISREG(st.st_mode):
                        read = functools.partial(self._read, path, dirent.name, st.st_mtime_ns)
                    else:
                        read = functools.partial(_not_followed, st.st_mode)
                    outcome = self._update(path, sig, read)
                    if outcome is not None:
                        added += outcome[0] == "added"
                        changed += outcome[0] == "changed"
                        invalid += outcome[1]
        return RefreshStats(added, changed, self._drop_unseen(seen), invalid)

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
        for entry in self._entries.values():
            if entry.sha1 == sha1.lower():
                return entry
        return None

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
        differ. Best = longest text, ties to more tokens. Matching hashes the prompt once:
        one SHA-1 pass that snapshots the digest at each distinct candidate length, so the
        cost is O(len(prompt) + distinct lengths), not O(files x prompt). Call `refresh()`
        first to see other processes' changes. Unlike ds4 the prompt is not cut at a NUL.
        Entries whose path is in `exclude` (set aside by the caller) are skipped as "set_aside".
        """
        prompt = bytes(prompt)
        skipped: collections.Counter[str] = collections.Counter()
        by_len: dict[int, dict[str, list[IndexEntry]]] = collections.defaultdict(
            lambda: collections.defaultdict(list)
        )
        candidates = 0
        for entry in self._entries.values():
            if entry.path in exclude:
                skipped["set_aside"] += 1
                continue
            reason = self._skip_reason(
                entry, len(prompt), min_tokens, ctx_size, quant_bits, reject_different_quant
            )
            if reason is not None:
                skipped[reason.split(":")[0]] += 1
                continue
            candidates += 1
            by_len[entry.text_bytes][entry.sha1].append(entry)

        best: IndexEntry | None = None
        hasher = hashlib.sha1()
        pos = 0
        view = memoryview(prompt)
        for length in sorted(by_len):
            hasher.update(view[pos:length])
            pos = length
            matches = by_len[length].get(hasher.copy().hexdigest())
            if matches:
                top = max(matches, key=lambda e: e.header.tokens)
                if best is None or (top.text_bytes, top.header.tokens) > (
                    best.text_bytes,
                    best.header.tokens,
                ):
                    best = top
        result = LookupResult(best, len(prompt), candidates, len(by_len), dict(skipped))
        if best is not None or not explain:
            return result
        return self._explain_miss(result, prompt, min_tokens, ctx_size, quant_bits, reject_different_quant)

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
        """Find the entry sharing the longest prefix with the prompt (texts kept in memory only)."""
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
