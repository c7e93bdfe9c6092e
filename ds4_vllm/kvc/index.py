"""Directory index of checkpoints: header + text scan, incremental refresh, longest-prefix lookup.

The scan never reads payloads. `refresh()` re-lists the directory and re-reads only new or
changed files, because other processes (ds4 servers, other vLLM ranks, `ds4-kv gc`) add,
touch and remove files at any time. Where the files are listed and read is a `Lister`:
`LocalLister` (a directory, here) or the fsspec one of `ds4_vllm.store.object_fs`; the bookkeeping
(which files changed, which vanished, which are invalid and why) is `CheckpointIndex.refresh`
for both. The table is `entry_table.EntryTable`, the search `lookup`. Not thread-safe: one
index per thread, or a lock.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
import time
from collections.abc import Callable, Container, Mapping
from pathlib import Path
from typing import Protocol

from .constants import KV_NAME_RE
from .entry_table import EntryTable, IndexEntry
from .errors import KvcFormatError
from .file import read_prefix, text_sha1
from .header import KvcHeader
from .lookup import LookupFilter, LookupResult, lookup

__all__ = [
    "CheckpointIndex",
    "FileHead",
    "IndexEntry",
    "Listed",
    "Lister",
    "LocalLister",
    "LookupResult",
    "RefreshStats",
]

PathArg = str | os.PathLike[str]

#: A directory whose mtime/ctime is at least this old when listed is trusted to be unchanged while
#: they stay the same; a younger one is listed again (a change within the same timestamp tick as
#: the listing would not move them).
DIR_SETTLE_NS = 1_000_000_000
#: The start of an invalid-entry reason for a file that could not be read (not a bad file).
UNREADABLE = "unreadable"


@dataclasses.dataclass(frozen=True, slots=True)
class RefreshStats:
    added: int = 0
    changed: int = 0
    removed: int = 0
    invalid: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class FileHead:
    """What a lister read of one file: its header and text (never its payload)."""

    header: KvcHeader
    text: bytes
    file_size: int
    #: Changes when the file is rewritten (a listing's timestamp remotely).
    mtime_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Listed:
    """One `<sha1>.kv` name a listing saw.

    `ident` tells a replaced file from the same one without reading it (an inode; 0 remotely).
    `sig` changes whenever the file does; None when the lister trusts the file unchanged
    without looking (the index keeps what it has). `read` gives the file's head, or why it is
    not a checkpoint (a reason starting with `UNREADABLE` when it could not be read).
    """

    name: str
    path: Path
    ident: int
    sig: tuple[object, ...] | None
    read: Callable[[], FileHead | str] | None = None


class Lister(Protocol):
    """Lists a checkpoint directory for `CheckpointIndex.refresh`."""

    def listing(self, known: Mapping[str, tuple[Path, int]], *, restat: bool) -> list[Listed] | None:
        """Every `<sha1>.kv` name now present (`known`: name -> (path, ident) of the last
        listing), or None when the directory is known not to have changed since then."""
        ...


class CheckpointIndex:
    """The valid checkpoints of one directory, keyed by path.

    Files are valid when their name is `<40 hex>.kv`, their header parses, header + text +
    payload fit the file, and (with `verify_text`, default) SHA-1(text) matches the name.
    Invalid files are remembered in `invalid` (path -> reason) and, like ds4, never deleted
    here; one that could not be read is read again at the next refresh. With `keep_text`
    (default) entry texts stay in memory to explain misses.
    """

    def __init__(
        self,
        directory: PathArg,
        *,
        keep_text: bool = True,
        verify_text: bool = True,
        lister: Lister | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.keep_text = keep_text
        self.verify_text = verify_text
        self._lister = lister if lister is not None else LocalLister(self.directory)
        self._entries = EntryTable(trust_text=verify_text)
        self._invalid: dict[Path, str] = {}
        self._sigs: dict[Path, tuple[object, ...]] = {}
        self._names: dict[str, tuple[Path, int]] = {}  # listed name -> (path, ident)

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

        restat (default): look at every file, so in-place rewrites (`touch_checkpoint`'s hit
        count and last-use time, a KTM trailer rewrite) are seen. Without it the lister may
        trust files it knows by identity, and a directory unchanged since a settled listing
        (`LocalLister`). In-place rewrites change no prefix-match field (text, tokens, context,
        quant), so lookups may use the cheap form; eviction, which orders by hits, restats.
        """
        listed = self._lister.listing(self._names, restat=restat)
        if listed is None:
            return RefreshStats()
        added = changed = invalid = 0
        names: dict[str, tuple[Path, int]] = {}
        for item in listed:
            names[item.name] = (item.path, item.ident)
            if item.sig is None or self._sigs.get(item.path) == item.sig:
                continue
            assert item.read is not None
            kind = "changed" if item.path in self._sigs else "added"
            self._sigs[item.path] = item.sig
            self._entries.pop(item.path)
            self._invalid.pop(item.path, None)
            head = item.read()
            entry_or_reason = head if isinstance(head, str) else self._entry(item, head)
            if isinstance(entry_or_reason, str):
                self._invalid[item.path] = entry_or_reason
                invalid += 1
                if entry_or_reason.startswith(UNREADABLE):
                    del self._sigs[item.path]  # not the file's fault: read it again next time
            else:
                self._entries[item.path] = entry_or_reason
            added += kind == "added"
            changed += kind == "changed"
        # Names are compared as strings: hashing 10,000 Paths costs more than the listing.
        vanished = [self._names[n][0] for n in self._names.keys() - names.keys()]
        self._names = names
        if len(self._sigs) - len(vanished) == len(names):
            removed = self._forget(vanished)
        else:  # paths known from elsewhere than this listing (entries set by hand)
            seen = {path for path, _ in names.values()}
            removed = self._forget([p for p in self._sigs if p not in seen])
        return RefreshStats(added, changed, removed, invalid)

    def _forget(self, paths: list[Path]) -> int:
        """Forget these files; returns how many valid entries went."""
        removed = 0
        for path in paths:
            self._sigs.pop(path, None)
            removed += self._entries.pop(path) is not None
            self._invalid.pop(path, None)
        return removed

    def _entry(self, item: Listed, head: FileHead) -> IndexEntry | str:
        """The entry of a file a lister read, or why it is invalid (its text must hash to its name)."""
        sha = item.name[:40].lower()
        if self.verify_text and text_sha1(head.text) != sha:
            return f"file_name: text SHA-1 is {text_sha1(head.text)}, not the name's"
        return IndexEntry(
            path=item.path,
            sha1=sha,
            header=head.header,
            text_bytes=len(head.text),
            file_size=head.file_size,
            mtime_ns=head.mtime_ns,
            text=head.text if self.keep_text else None,
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

        Entries are skipped as `LookupFilter` says: text_bytes > len(prompt), tokens <
        min_tokens, ctx_size > the current ctx_size (when given), quant_bits different (with
        reject_different_quant), or the path in `exclude` (set aside by the caller). Best =
        longest text, ties to more tokens, then to the earlier indexed entry. Entries with
        verified texts are kept sorted, so the prefixes of the prompt are found by bisection
        (cost ~ log(entries) per prefix tried, whatever the index size); entries without text
        are matched by one SHA-1 pass over their distinct lengths. Call `refresh()` first to
        see other processes' changes. Unlike ds4 the prompt is not cut at a NUL.
        """
        flt = LookupFilter(min_tokens, ctx_size, quant_bits if reject_different_quant else None, exclude)
        return lookup(self._entries, bytes(prompt), flt, explain=explain)


def _not_followed(mode: int) -> str:
    """The invalid-entry reason of a `<sha1>.kv` name that is not a regular file."""
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
    return f"file_type: {kind}, not a regular file; never followed or read"


class LocalLister:
    """A local directory through `os.scandir` and `lstat`: links are judged, never followed.

    Without restat, a name whose inode is unchanged is trusted without a stat, and a directory
    whose mtime/ctime/inode are unchanged since a settled listing is not listed at all.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._dir_sig: tuple[int, int, int] | None = None  # a settled, fully listed directory

    def listing(self, known: Mapping[str, tuple[Path, int]], *, restat: bool) -> list[Listed] | None:
        directory = self.directory
        try:
            dst = os.stat(directory)
        except FileNotFoundError:
            self._dir_sig = None
            return []
        dir_sig = (dst.st_mtime_ns, dst.st_ctime_ns, dst.st_ino)
        if not restat and dir_sig == self._dir_sig:
            return None
        listed_at = time.time_ns()
        out: list[Listed] = []
        try:
            it = os.scandir(directory)
        except FileNotFoundError:
            self._dir_sig = None
            return []
        with it:
            for dirent in it:
                name = dirent.name
                seen = known.get(name)
                if seen is None:
                    if not KV_NAME_RE.match(name):
                        continue
                    path = Path(dirent.path)
                else:
                    path = seen[0]
                    if not restat and dirent.inode() == seen[1]:
                        out.append(Listed(name, path, seen[1], None))
                        continue
                try:
                    st = dirent.stat(follow_symlinks=False)  # a link is judged, never followed
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    continue
                sig = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
                read: Callable[[], FileHead | str]
                if stat.S_ISREG(st.st_mode):
                    read = functools.partial(_read_local, path, st.st_mtime_ns)
                else:
                    read = functools.partial(_not_followed, st.st_mode)
                out.append(Listed(name, path, st.st_ino, sig, read))
        settled = listed_at - max(dst.st_mtime_ns, dst.st_ctime_ns) >= DIR_SETTLE_NS
        self._dir_sig = dir_sig if settled else None
        return out


def _read_local(path: Path, mtime_ns: int) -> FileHead | str:
    try:
        prefix = read_prefix(path, with_text=True, follow_symlinks=False)
    except KvcFormatError as exc:
        return f"{exc.field}: {exc.reason}"
    except OSError as exc:
        return f"{UNREADABLE}: {exc.strerror or exc}"
    assert prefix.text is not None
    return FileHead(prefix.header, prefix.text, prefix.file_size, mtime_ns)
