"""The disk cache of one server: lookup, load checks, store, budget, eviction, quarantine.

Many requests use one `CheckpointStore` at once, and several servers may share its
directory, so:
- the directory index lives in memory and is refreshed when the directory changes (or at
  most every `refresh_interval_s`), never rescanned per request;
- `lookup` changes no file (except quarantining a corrupt one) and no hit/miss counter, so
  the scheduler may ask it repeatedly for one request; the connector reports what actually
  happened with `record_hit` / `record_miss` (and `pin`s a file while its load is pending);
- every failure (corrupt file, file removed by another process, disk full, permission
  denied) ends as a miss or a skipped store with a reason, logged once per kind; nothing
  raises into the engine except `LoadFailure` from `open_for_load`, which the caller turns
  into recomputation.

Thread-safe: one lock guards the index and the bookkeeping; payload writes run outside it.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ds4_vllm.kvc import (
    Checkpoint,
    CheckpointIndex,
    IndexEntry,
    KvcFormatError,
    KvcHeader,
    LookupResult,
    ModelDims,
    SaveReason,
    ToolMapEntry,
    checkpoint_file_size,
    payload_size,
    text_sha1,
)
from ds4_vllm.kvc.trailer import pack_tool_map

from .eviction import MIB, EvictionEntry, plan_eviction
from .fs import CheckpointFS, open_fs
from .options import StoreConfigError, StoreOptions, flag_names
from .stats import StoreStats

logger = logging.getLogger(__name__)

#: ds4 refuses a file whose size plus 1 % exceeds the budget (spec §5.5).
BUDGET_HEADROOM = 1.01
#: Without a directory mtime change, re-stat the directory at most this often: touches by
#: other servers (hit counts) only matter to eviction, which always refreshes first.
DEFAULT_REFRESH_INTERVAL_S = 2.0
#: Token arrays of recently matched files, so repeated lookups do not reopen them.
TOKEN_CACHE_FILES = 64
#: Conversations whose own checkpoints we remember for the nested-file rule.
CONVERSATIONS_REMEMBERED = 4096
#: Lookup retries when the chosen file turns out corrupt or vanished.
LOOKUP_ATTEMPTS = 4


class LoadFailure(Exception):
    """A checkpoint chosen by `lookup` could not be used; the request must recompute."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class LookupOutcome:
    """Answer of `lookup`. On a hit, `agreed_tokens` tokens of the prompt can be loaded.

    `reason` explains a miss, or on a hit why fewer tokens agree than the file holds
    ("token mismatch at token N").
    """

    hit: bool
    reason: str | None = None
    path: str | None = None
    sha1: str | None = None
    entry_tokens: int = 0
    agreed_tokens: int = 0
    text_bytes: int = 0
    file_size: int = 0
    quant_bits: int = 0
    tokens_digest: str | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True, slots=True)
class StoreResult:
    """Answer of `store`: `stored` with the file, or why nothing was written."""

    stored: bool
    reason: str
    path: str | None = None
    file_size: int = 0
    seconds: float = 0.0
    evicted: tuple[str, ...] = ()
    deduplicated: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class _Written:
    path: str
    sha1: str
    text_bytes: int
    reason: SaveReason


def _tokens_digest(tokens: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(tokens, dtype=np.uint32).tobytes()).hexdigest()


def _agreement(a: np.ndarray, b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    other = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(a[:n].astype(np.int64) != other)
    return int(diff[0]) if diff.size else n


def os_reason(exc: OSError) -> str:
    """Short, stable description of an I/O failure for logs, traces and results."""
    labels = {
        errno.ENOSPC: "disk full",
        errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.EROFS: "read-only file system",
        errno.ENOENT: "file removed",
        errno.ENOTDIR: "not a directory",
    }
    label = labels.get(exc.errno or 0, exc.strerror or type(exc).__name__)
    code = errno.errorcode.get(exc.errno or 0)
    return f"{label} ({code})" if code else label


def _save_reason(header: KvcHeader) -> SaveReason:
    known = header.reason in SaveReason._value2member_map_
    return SaveReason(header.reason) if known else SaveReason.UNKNOWN


def _reason_label(header: KvcHeader) -> str:
    return _save_reason(header).label


def _miss_reason(result: LookupResult, entries: int) -> str:
    """The trace's miss reasons: no entry, text diverges, under the minimum, context, quant."""
    if entries == 0:
        return "no entry"
    n = result.nearest
    if n is None:
        return "no entry shares a prefix with the prompt"
    if result.nearest_skip:
        kind, _, detail = result.nearest_skip.partition(": ")
        label = {
            "below_min_tokens": "under the minimum",
            "ctx_too_large": "context size",
            "quant_mismatch": "quant",
            "text_longer_than_prompt": "entry longer than the prompt",
        }.get(kind, kind)
        return f"{label}: {detail} (file {n.path.name})"
    return f"text diverges at byte {result.diverge_at} from the nearest entry {n.path.name} ({n.text_bytes} bytes)"


class CheckpointStore:
    """Disk checkpoints of one directory with ds4's lookup, budget and eviction rules.

    Call `open()` once before use; it creates the directory, removes stale temp files and
    runs the start-up eviction pass. `model_dims`, when given, rejects files written for a
    different model shape (a miss, the file is left for whoever owns it).
    """

    def __init__(
        self,
        options: StoreOptions,
        *,
        clock: Callable[[], float] = time.time,
        fs: CheckpointFS | None = None,
        model_dims: ModelDims | None = None,
        refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S,
        fsync: bool = True,
    ) -> None:
        self.options = options
        self.fs = fs if fs is not None else open_fs(options.disk_dir, fsync=fsync)
        self.model_dims = model_dims
        self._clock = clock
        self._refresh_interval_s = refresh_interval_s
        self._lock = threading.RLock()
        self._index: CheckpointIndex = self.fs.new_index()
        self._dir_version: int | None = None
        self._refreshed_at = -float("inf")
        self._stats = StoreStats()
        self._reported: set[str] = set()
        self._pinned: collections.Counter[str] = collections.Counter()
        self._tokens: collections.OrderedDict[tuple[str, int, int], np.ndarray] = collections.OrderedDict()
        self._written: collections.OrderedDict[str, list[_Written]] = collections.OrderedDict()

    # ------------------------------------------------------------------ set-up

    def open(self) -> CheckpointStore:
        """Create and check the directory; raise StoreConfigError (naming --kv-disk-dir) if unusable."""
        try:
            self.fs.prepare()
        except OSError as exc:
            raise StoreConfigError(
                f"{flag_names('kv_disk_dir')}: cannot use {self.options.disk_dir!r}: {os_reason(exc)}"
            ) from exc
        removed = self.fs.clean_temp()
        if removed:
            logger.info("kv cache removed stale temp files count=%d dir=%s", len(removed), self.fs.url)
        evicted = self.evict()
        logger.info(
            "KV disk cache %s (%s, files=%d, evicted=%d)",
            self.fs.url,
            self.options.describe(),
            len(self._index),
            len(evicted),
        )
        return self

    @property
    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats.snapshot()

    def entries(self) -> list[IndexEntry]:
        with self._lock:
            self._refresh(force=True)
            return self._index.entries

    # ------------------------------------------------------------------ index

    def _refresh(self, *, force: bool = False) -> None:
        """Refresh when forced, when the directory changed, or after the interval."""
        now = time.monotonic()
        version = self.fs.version()
        recent = now - self._refreshed_at < self._refresh_interval_s
        if not force and recent and (version is None or version == self._dir_version):
            return
        self._index.refresh()
        self._dir_version, self._refreshed_at = version, now
        for path, why in self._index.invalid.items():
            # ds4 leaves unparseable files alone (they may be another engine's version) and
            # does not count them against the budget; we say so once.
            self._report_once(f"invalid:{path}", "kv cache ignoring invalid file=%s: %s", path, why)

    def _report_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._reported:
            self._reported.add(key)
            logger.warning(msg, *args)
        else:
            logger.debug(msg, *args)

    # ------------------------------------------------------------------ lookup and load

    def lookup(
        self,
        prompt_text: bytes,
        prompt_tokens: Sequence[int],
        ctx_size: int | None,
        quant_bits: int | None,
    ) -> LookupOutcome:
        """Longest stored prefix of `prompt_text`, and how many of its tokens agree with the prompt's.

        Skips entries under `min_tokens`, above `ctx_size`, and (with
        `--kv-cache-reject-different-quant`) of another quant. A hit needs at least
        `min_tokens` agreeing tokens. A file found corrupt here is quarantined and the
        next best entry is tried.
        """
        prompt_text = bytes(prompt_text)
        with self._lock:
            self._stats.lookups += 1
            self._refresh()
            for _ in range(LOOKUP_ATTEMPTS):
                result = self._index.lookup(
                    prompt_text,
                    min_tokens=self.options.min_tokens,
                    ctx_size=ctx_size,
                    quant_bits=quant_bits,
                    reject_different_quant=self.options.reject_different_quant,
                )
                entry = result.hit
                if entry is None:
                    return LookupOutcome(False, _miss_reason(result, len(self._index)))
                outcome = self._match_tokens(entry, prompt_tokens)
                if outcome is not None:
                    return outcome
                self._refresh(force=True)  # the file was quarantined or vanished: try the next one
            return LookupOutcome(False, "corrupt or vanishing files; gave up")

    def _match_tokens(self, entry: IndexEntry, prompt_tokens: Sequence[int]) -> LookupOutcome | None:
        """Compare the file's payload tokens with the prompt's; None when the file is unusable."""
        path = str(entry.path)
        key = (path, entry.mtime_ns, entry.file_size)
        tokens = self._tokens.get(key)
        if tokens is None:
            try:
                with self.fs.open(path) as ck:
                    self._check_model(ck)
                    tokens = np.array(ck.payload.tokens, dtype=np.uint32)
            except FileNotFoundError:
                return None
            except KvcFormatError as exc:
                self._quarantine(path, f"{exc.field}: {exc.reason}")
                return None
            except LoadFailure as exc:
                return LookupOutcome(False, exc.reason, path=path, sha1=entry.sha1)
            except OSError as exc:
                reason = f"unreadable file: {os_reason(exc)}"
                self._report_once(f"unreadable:{path}", "kv cache load failed file=%s: %s", path, reason)
                return LookupOutcome(False, reason, path=path, sha1=entry.sha1)
            self._tokens[key] = tokens
            while len(self._tokens) > TOKEN_CACHE_FILES:
                self._tokens.popitem(last=False)
        else:
            self._tokens.move_to_end(key)
        agreed = _agreement(tokens, prompt_tokens)
        common = dict(
            path=path,
            sha1=entry.sha1,
            entry_tokens=entry.tokens,
            text_bytes=entry.text_bytes,
            file_size=entry.file_size,
            quant_bits=entry.header.quant_bits,
        )
        mismatch = f"token mismatch at token {agreed}" if agreed < entry.tokens else None
        if agreed < self.options.min_tokens:
            return LookupOutcome(False, f"{mismatch}, under the minimum {self.options.min_tokens}", **common)
        return LookupOutcome(
            True, mismatch, agreed_tokens=agreed, tokens_digest=_tokens_digest(tokens[:agreed]), **common
        )

    def _check_model(self, ck: Checkpoint) -> None:
        if self.model_dims is not None and ck.payload.header.dims != self.model_dims:
            raise LoadFailure(str(ck.path), f"written for another model shape {ck.payload.header.dims}")

    def open_for_load(self, outcome: LookupOutcome) -> Checkpoint:
        """Open the file a hit named, re-checking that it is still what `lookup` saw.

        Returns the validated checkpoint (close it after copying). Raises LoadFailure when
        the file vanished, is corrupt (then it is quarantined) or changed since the lookup;
        the caller recomputes and calls `record_miss`.
        """
        if not outcome.hit or outcome.path is None:
            raise LoadFailure(str(outcome.path), "not a hit")
        path = outcome.path
        try:
            ck = self.fs.open(path)
        except FileNotFoundError as exc:
            raise self._load_failed(path, "file removed by another process") from exc
        except KvcFormatError as exc:
            with self._lock:
                self._quarantine(path, f"{exc.field}: {exc.reason}")
            raise self._load_failed(path, f"corrupt file: {exc.field}: {exc.reason}") from exc
        except OSError as exc:
            raise self._load_failed(path, f"unreadable file: {os_reason(exc)}") from exc
        try:
            self._check_model(ck)
            tokens = np.asarray(ck.payload.tokens)
            if (
                ck.sha1 != outcome.sha1
                or ck.header.tokens != outcome.entry_tokens
                or _tokens_digest(tokens[: outcome.agreed_tokens]) != outcome.tokens_digest
            ):
                raise LoadFailure(path, "file changed since the lookup")
        except LoadFailure as exc:
            ck.close()
            raise self._load_failed(path, exc.reason) from exc
        return ck

    def _load_failed(self, path: str, reason: str) -> LoadFailure:
        with self._lock:
            self._stats.failures += 1
            self._report_once(f"load:{path}:{reason}", "kv cache load failed file=%s: %s", path, reason)
        return LoadFailure(path, reason)

    def record_hit(self, outcome: LookupOutcome, *, load_seconds: float = 0.0) -> None:
        """Count a successful load and touch the file (hits + 1, last_used = now), as ds4 does.

        ds4 deletes ("consumes") a loaded file above cold_max; we keep it, because vLLM may
        drop the state from memory before this conversation writes it back.
        """
        assert outcome.path is not None
        now = int(self._clock())
        try:
            self.fs.touch(outcome.path, now)
        except (OSError, KvcFormatError) as exc:
            logger.debug("kv cache touch failed file=%s: %s", outcome.path, exc)
        with self._lock:
            s = self._stats
            s.hits += 1
            s.tokens_loaded += outcome.agreed_tokens
            s.bytes_read += outcome.file_size
            s.load_seconds += load_seconds
        logger.info(
            "kv cache hit tokens=%d file_tokens=%d text=%d quant=%d load=%.1f ms file=%s",
            outcome.agreed_tokens,
            outcome.entry_tokens,
            outcome.text_bytes,
            outcome.quant_bits,
            load_seconds * 1000,
            outcome.path,
        )

    def record_load(self, seconds: float, *, failed: bool = False) -> None:
        """Count the time of a load done outside `open_for_load` (the connector's worker side)."""
        with self._lock:
            self._stats.load_seconds += seconds
            self._stats.failures += int(failed)

    def record_miss(self) -> None:
        """Count a request that found nothing usable on disk (or whose load failed)."""
        with self._lock:
            self._stats.misses += 1

    def pin(self, path: str) -> None:
        """Keep `path` from eviction and nested-file removal until `unpin` (a load is pending)."""
        with self._lock:
            self._pinned[path] += 1

    def unpin(self, path: str) -> None:
        with self._lock:
            self._pinned[path] -= 1
            if self._pinned[path] <= 0:
                del self._pinned[path]

    # ------------------------------------------------------------------ quarantine

    def quarantine(self, path: str, reason: str) -> None:
        """Move a bad file out of the scan (DIR/quarantine/); for the connector's own checks too."""
        with self._lock:
            self._quarantine(path, reason)

    def _quarantine(self, path: str, reason: str) -> None:
        self._stats.failures += 1
        try:
            target = self.fs.quarantine(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._report_once(
                f"quarantine:{path}",
                "kv cache quarantine failed file=%s: %s (%s)",
                path,
                os_reason(exc),
                reason,
            )
            return
        self._stats.files_quarantined += 1
        self._tokens = collections.OrderedDict((k, v) for k, v in self._tokens.items() if k[0] != path)
        logger.warning("kv cache quarantined file=%s to=%s: %s", path, target, reason)

    # ------------------------------------------------------------------ store

    def store(
        self,
        text: bytes,
        header: KvcHeader,
        payload: Any,
        tool_map: Iterable[ToolMapEntry] = (),
        *,
        conversation_key: str | None = None,
    ) -> StoreResult:
        """Write one checkpoint, then keep the directory within budget.

        `header.reason` is the save reason. Skips the write when the file would not fit the
        budget (+1 %), when the disk lacks the space, or when a compatible file of the same
        text exists (ds4 does not rewrite it either). After writing, runs an eviction pass
        that protects the new file, and removes this conversation's nested older files
        (see `_remove_nested`). Never raises for I/O: failures come back as `stored=False`.
        """
        text = bytes(text)
        tool_map = list(tool_map)
        reason_label = _reason_label(header)
        if isinstance(payload, bytes | bytearray | memoryview):
            p_bytes = memoryview(payload).nbytes
        else:
            p_bytes = payload_size(payload.header, payload.n_comp, payload.n_index_comp)
        size = checkpoint_file_size(len(text), p_bytes, len(pack_tool_map(tool_map)))
        budget = self.options.budget_bytes
        if size * BUDGET_HEADROOM > budget:
            return self._skipped(
                header,
                f"estimated file size {size / MIB:.1f} MiB exceeds budget {budget / MIB:.0f} MiB",
            )
        sha = text_sha1(text)
        with self._lock:
            self._refresh()
            same = self._index.get(sha)
            if (
                same is not None
                and same.header.tokens == header.tokens
                and same.header.ctx_size == header.ctx_size
                and same.header.quant_bits == header.quant_bits
            ):
                self._remember(conversation_key, str(same.path), sha, len(text), _save_reason(header))
                return self._skipped(header, "already stored", path=str(same.path), quiet=True)
        free = self.fs.free_bytes()
        if free is not None and free < size:
            return self._store_failed(
                header, reason_label, f"disk full: {free} bytes free, file needs {size}"
            )

        started = time.monotonic()
        try:
            path = self.fs.write(text, header, payload, tool_map)
        except OSError as exc:
            return self._store_failed(header, reason_label, os_reason(exc))
        except KvcFormatError as exc:  # the caller handed inconsistent data: a bug, not a disk problem
            return self._store_failed(header, reason_label, f"invalid checkpoint data: {exc}")
        seconds = time.monotonic() - started

        with self._lock:
            s = self._stats
            s.stores += 1
            s.bytes_written += size
            s.save_seconds += seconds
            logger.info(
                "kv cache stored tokens=%d reason=%s text=%d size=%.1f MiB save=%.1f ms file=%s",
                header.tokens,
                reason_label,
                len(text),
                size / MIB,
                seconds * 1000,
                path,
            )
            evicted = self.evict(protected=path)
            nested = self._remove_nested(conversation_key, text, path)
            self._remember(conversation_key, path, sha, len(text), _save_reason(header))
        return StoreResult(True, reason_label, path, size, seconds, tuple(evicted), tuple(nested))

    def _skipped(
        self, header: KvcHeader, why: str, *, path: str | None = None, quiet: bool = False
    ) -> StoreResult:
        with self._lock:
            self._stats.store_skips += 1
        log = logger.debug if quiet else logger.info
        log("kv cache skipped tokens=%d reason=%s because %s", header.tokens, _reason_label(header), why)
        return StoreResult(False, why, path)

    def _store_failed(self, header: KvcHeader, reason_label: str, why: str) -> StoreResult:
        with self._lock:
            self._stats.failures += 1
            self._report_once(
                f"store:{why.split(':')[0]}",
                "kv cache store failed (%s): tokens=%d %s",
                reason_label,
                header.tokens,
                why,
            )
        return StoreResult(False, why)

    # ------------------------------------------------------------------ eviction

    def evict(self, protected: str | None = None) -> list[str]:
        """ds4's eviction pass: delete lowest-score files until the valid files fit the budget.

        Pinned files (pending loads) are never chosen; their bytes still count. Stops at the
        first deletion that fails for another reason than the file being gone already.
        """
        with self._lock:
            self._refresh(force=True)
            now = self._clock()
            pinned_bytes = 0
            candidates: list[EvictionEntry] = []
            for e in self._index.entries:
                if str(e.path) in self._pinned and str(e.path) != protected:
                    pinned_bytes += e.file_size
                    continue
                h = e.header
                candidates.append(
                    EvictionEntry(str(e.path), e.file_size, h.tokens, h.hits, h.created_at, h.last_used)
                )
            victims = plan_eviction(candidates, self.options.budget_bytes - pinned_bytes, now, protected)
            removed: list[str] = []
            for v in victims:
                try:
                    self.fs.remove(v.path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    self._stats.failures += 1
                    self._report_once(
                        f"evict:{exc.errno}", "kv cache evict failed file=%s: %s", v.path, os_reason(exc)
                    )
                    break
                removed.append(v.path)
                self._stats.files_evicted += 1
                logger.info(
                    "kv cache evicted reason=disk-cache-full tokens=%d hits=%d size=%.1f MiB file=%s",
                    v.tokens,
                    v.hits,
                    v.file_size / MIB,
                    v.path,
                )
            if removed:
                self._refresh(force=True)
            return removed

    # ------------------------------------------------------------------ nested files of one conversation

    def _remember(self, key: str | None, path: str, sha: str, text_bytes: int, reason: SaveReason) -> None:
        if key is None:
            return
        written = self._written.setdefault(key, [])
        if all(w.path != path for w in written):
            written.append(_Written(path, sha, text_bytes, reason))
        self._written.move_to_end(key)
        while len(self._written) > CONVERSATIONS_REMEMBERED:
            self._written.popitem(last=False)

    def _remove_nested(self, key: str | None, text: bytes, new_path: str) -> list[str]:
        """Delete this conversation's older files that the new one makes redundant.

        Rule: an older file goes when (1) this store wrote it for the same
        `conversation_key`, (2) its text is a byte prefix of the new text, (3) it is not a
        `cold` file, (4) its header still says 0 hits, and (5) no load is pending on it.
        Why: a conversation's next turn extends its latest text, so lookups pick the longest
        file and the shorter one only competes for budget (users saw five nested files of
        one prompt evicting each other). Cold files are kept because their purpose is to be
        shared by other conversations with the same tools/system prompt; a file with hits
        was useful to someone else; files of other writers are never touched.
        """
        if key is None or key not in self._written:
            return []
        removed: list[str] = []
        keep: list[_Written] = []
        for w in self._written[key]:
            nested = (
                w.path != new_path
                and w.reason != SaveReason.COLD
                and w.text_bytes < len(text)
                and text_sha1(text[: w.text_bytes]) == w.sha1
                and w.path not in self._pinned
            )
            if not nested:
                keep.append(w)
                continue
            try:
                if self.fs.read_header(w.path).hits != 0:
                    keep.append(w)
                    continue
                self.fs.remove(w.path)
            except FileNotFoundError:
                continue
            except (OSError, KvcFormatError) as exc:
                logger.debug("kv cache nested removal failed file=%s: %s", w.path, exc)
                keep.append(w)
                continue
            removed.append(w.path)
            self._stats.files_deduplicated += 1
            logger.info("kv cache removed nested file=%s reason=superseded-by file=%s", w.path, new_path)
        self._written[key] = keep
        if removed:
            self._refresh(force=True)
        return removed
