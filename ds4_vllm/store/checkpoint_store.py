"""The disk cache's decisions for one directory, made in one place: the scheduler side.

`CheckpointStore` owns every piece of mutable policy state (the index, pins, in-flight writes,
the budget, eviction, nested copies, quarantine, start-up cleanup), so a file pinned for a
load is never evicted, the budget is counted once and start-up cleanup runs once per server.
The worker side (`CheckpointWriter`) only moves bytes and reports back:

    outcome = store.lookup(text, tokens, ctx, quant)   # files and in-flight writes
    store.pin(outcome.path) ... store.finish_load(outcome, report); store.unpin(outcome.path)
    ticket = store.admit(text, tokens, header, size, conversation_key)  # reserve, maybe evict
    report = writer.write(ticket, text, header, payload)               # worker side
    store.finish_write(report)                                          # nested copies, stats

`lookup` changes no file (except quarantining a corrupt one) and no hit/miss counter, so the
scheduler may ask it repeatedly for one request. Every failure ends as a miss or a skipped
store with a reason, logged once per kind. Not thread-safe: it has one owner.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ds4_vllm.kvc import (
    IndexEntry,
    KvcHeader,
    ModelDims,
    SaveReason,
    ToolMapEntry,
    checkpoint_file_size,
    payload_size,
    text_sha1,
)
from ds4_vllm.kvc.trailer import pack_tool_map

from .catalog import Catalog, LogOnce, agreement_outcome
from .eviction import MIB
from .fs import CheckpointFS, open_fs
from .janitor import Janitor
from .leases import LeaseBook
from .model_identity import claim_directory
from .options import StoreConfigError, StoreOptions, flag_names
from .pending import PendingFiles
from .records import LoadReport, LookupOutcome, WriteReport, WriteTicket, os_reason
from .stats import StoreStats
from .writer import CheckpointWriter

logger = logging.getLogger(__name__)

#: ds4 refuses a file whose size plus 1 % exceeds the budget (spec §5.5).
BUDGET_HEADROOM = 1.01
#: How often a running store looks for temp files that crashed writers left (another server on
#: the directory, or this one's own previous process when it restarted within the temp file's
#: minimum age): without it they stay, outside the budget, until the next restart.
TEMP_CLEAN_INTERVAL_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class StoreResult:
    """Answer of the synchronous `store`: `stored` with the file, or why nothing was written."""

    stored: bool
    reason: str
    path: str | None = None
    file_size: int = 0
    seconds: float = 0.0
    evicted: tuple[str, ...] = ()
    deduplicated: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """Answer of `admit`: a ticket to write, or why the checkpoint is not written."""

    ticket: WriteTicket | None
    reason: str
    evicted: tuple[str, ...] = ()


class CheckpointStore:
    """Disk checkpoints of one directory with ds4's lookup, budget and eviction rules.

    Call `open()` once before use; it creates the directory, removes stale temp files and
    runs the start-up eviction pass. `model_dims`, when given, rejects files written for a
    different model shape (a miss; the file is left for whoever owns it).

    Several servers may share the directory or bucket (docs/ray.md): each one re-lists it at a
    lookup once `refresh_interval_s` (default `--kv-cache-rescan-ms`) has passed, each one
    evicts to the shared budget, and none evicts a file that any of them holds a load lease on
    (`leases.py`).
    """

    def __init__(
        self,
        options: StoreOptions,
        *,
        clock: Callable[[], float] = time.time,
        fs: CheckpointFS | None = None,
        model_dims: ModelDims | None = None,
        refresh_interval_s: float | None = None,
        fsync: bool = True,
        model_fingerprint: str | None = None,
    ) -> None:
        self.options = options
        self.fs = fs if fs is not None else open_fs(options.directory, fsync=fsync)
        self.model_dims = model_dims
        self.model_fingerprint = model_fingerprint
        self._clock = clock
        self._log_once = LogOnce()
        self._stats = StoreStats()
        self._catalog = Catalog(
            self.fs,
            model_dims=model_dims,
            refresh_interval_s=(
                options.rescan_ms / 1000 if refresh_interval_s is None else refresh_interval_s
            ),
            log_once=self._log_once,
            stats=self._stats,
        )
        self._pending = PendingFiles()
        self._janitor = Janitor(self.fs, self._log_once)
        self._leases = LeaseBook(self.fs, options.lease_s, clock=clock)
        self._writer = CheckpointWriter(self.fs, model_dims)  # for the synchronous `store` only
        self._temp_cleaned_at = -float("inf")
        self._reservations: dict[str, str] = {}  # sha1 -> reservation file of an admitted write

    # ------------------------------------------------------------------ set-up

    def open(self) -> CheckpointStore:
        """Create and check the directory; raise StoreConfigError (naming --kv-disk-dir) if unusable.

        With a `model_fingerprint`, the directory must be this model's (or unclaimed, then it
        is claimed), unless `--kv-cache-shared-models` says several models share it on purpose.
        """
        try:
            self.fs.prepare()
            if self.model_fingerprint is not None:
                claim_directory(self.fs, self.options, self.model_fingerprint)
        except OSError as exc:
            raise StoreConfigError(
                f"{flag_names('kv_disk_dir')}: cannot use {self.options.directory!r}: {os_reason(exc)}"
            ) from exc
        self._clean_temp()
        evicted = self.evict()
        entries = self._catalog.entries()
        logger.info(
            "KV disk cache %s (%s, files=%d, bytes=%d, evicted=%d)",
            self.fs.url,
            self.options.describe(),
            len(entries),
            sum(e.file_size for e in entries),
            len(evicted),
        )
        return self

    def _clean_temp(self) -> None:
        """Remove stale temp files of crashed writers (`clean_temp_files` decides which are stale)."""
        self._temp_cleaned_at = time.monotonic()
        try:
            removed = self.fs.clean_temp(now=self._clock())
        except OSError as exc:
            self._log_once.warning("clean_temp", "kv cache temp clean-up failed: %s", os_reason(exc))
            return
        if removed:
            logger.info("kv cache removed stale temp files count=%d dir=%s", len(removed), self.fs.url)

    @property
    def stats(self) -> StoreStats:
        return self._stats.snapshot()

    def entries(self) -> list[IndexEntry]:
        return self._catalog.entries()

    @property
    def pinned(self) -> frozenset[str]:
        return self._pending.pinned

    # ------------------------------------------------------------------ lookup and load

    def lookup(
        self,
        prompt_text: bytes,
        prompt_tokens: Sequence[int],
        ctx_size: int | None,
        quant_bits: int | None,
    ) -> LookupOutcome:
        """Longest stored or in-flight prefix of `prompt_text`, and how many of its tokens agree.

        Skips files under `min_tokens`, above `ctx_size`, and (with
        `--kv-cache-reject-different-quant`) of another quant. A hit needs at least
        `min_tokens` agreeing tokens. A file found corrupt here is quarantined and the
        next best one tried. An in-flight write wins over a file when its text is longer.
        """
        prompt_text = bytes(prompt_text)
        self._stats.lookups += 1
        self._catalog.refresh()
        found, fallback = self._catalog.lookup_file(
            prompt_text,
            prompt_tokens,
            min_tokens=self.options.min_tokens,
            ctx_size=ctx_size,
            quant_bits=quant_bits,
            reject_different_quant=self.options.reject_different_quant,
        )
        shared = max(fallback.shared_bytes, self._pending.shared_prefix(prompt_text))
        pending = self._pending.longest_prefix_write(prompt_text, self.options.min_tokens)
        if pending is not None and (found is None or pending.ticket.text_bytes > found.text_bytes):
            ticket = pending.ticket
            outcome = agreement_outcome(
                np.asarray(pending.tokens, dtype=np.uint32),
                prompt_tokens,
                self.options.min_tokens,
                path=ticket.path,
                sha1=ticket.sha1,
                entry_tokens=ticket.n_tokens,
                text_bytes=ticket.text_bytes,
                file_size=ticket.file_size,
                quant_bits=quant_bits or 0,
                in_flight=True,
            )
            if outcome.hit or found is None:
                return dataclasses.replace(outcome, shared_bytes=shared)
        return dataclasses.replace(found if found is not None else fallback, shared_bytes=shared)

    def pin(self, path: str) -> None:
        """Keep `path` from eviction and nested-file removal until `unpin` (a load is pending).

        The pin is also a lease (`leases.py`), so the other servers of a shared store keep it too.
        """
        self._pending.pin(path)
        self._leases.acquire(path)

    def unpin(self, path: str) -> None:
        self._pending.unpin(path)
        self._leases.release(path)

    def _kept_paths(self, entries: Iterable[IndexEntry]) -> frozenset[str]:
        """Paths no deletion may touch: this server's pins and every server's leased files."""
        leased = self._leases.leased()
        by_name = {str(e.path) for e in entries if e.path.name in leased}
        return self._pending.pinned | by_name | {self.fs.path_of(name[:40]) for name in leased}

    def finish_load(self, outcome: LookupOutcome, report: LoadReport) -> None:
        """Count a load the worker ended; touch the file on success, quarantine it when corrupt.

        ds4 deletes ("consumes") a loaded file above cold_max; we keep it, because vLLM may
        drop the state from memory before this conversation writes it back.
        """
        if not report.ok:
            if report.corrupt:
                self._catalog.quarantine(report.path, report.reason)
            else:
                self._stats.failures += 1
            self._log_once.warning(
                f"load:{report.path}:{report.reason}",
                "kv cache load failed file=%s: %s",
                report.path,
                report.reason,
            )
            return
        assert outcome.path is not None
        try:
            self.fs.touch(outcome.path, int(self._clock()))
        except Exception as exc:  # a missing or read-only file only loses the hit count
            logger.debug("kv cache touch failed file=%s: %s", outcome.path, exc)
        s = self._stats
        s.hits += 1
        s.tokens_loaded += outcome.agreed_tokens
        s.bytes_read += outcome.file_size
        s.load_seconds += report.seconds
        logger.info(
            "kv cache hit tokens=%d file_tokens=%d text=%d quant=%d load=%.1f ms%s file=%s",
            outcome.agreed_tokens,
            outcome.entry_tokens,
            outcome.text_bytes,
            outcome.quant_bits,
            report.seconds * 1000,
            " (in flight)" if outcome.in_flight else "",
            outcome.path,
        )

    def record_miss(self) -> None:
        """Count a request that found nothing usable on disk (or whose load failed)."""
        self._stats.misses += 1

    def quarantine(self, path: str, reason: str) -> None:
        """Move a bad file out of the scan (DIR/quarantine/)."""
        self._catalog.quarantine(path, reason)

    # ------------------------------------------------------------------ writes

    def file_size(self, text_bytes: int, payload_bytes: int, tool_map: Iterable[ToolMapEntry] = ()) -> int:
        return checkpoint_file_size(text_bytes, payload_bytes, len(pack_tool_map(list(tool_map))))

    def admit(
        self,
        text: bytes,
        tokens: Sequence[int],
        header: KvcHeader,
        file_size: int,
        *,
        conversation_key: str | None = None,
    ) -> Admission:
        """Decide whether a checkpoint is written, and reserve its room in the budget.

        Refuses a file that would not fit the budget (+1 %), or that exists already (same text,
        tokens, context and quant; ds4 does not rewrite it either) or is in flight. Otherwise
        evicts what the budget needs (never a pinned file), and returns a ticket: from now on
        lookups may choose it, until `finish_write` gets its report.
        """
        text = bytes(text)
        budget = self.options.budget_bytes
        if file_size * BUDGET_HEADROOM > budget:
            return self._skip(
                header, f"estimated file size {file_size / MIB:.1f} MiB exceeds budget {budget / MIB:.0f} MiB"
            )
        sha = text_sha1(text)
        if self._pending.write(sha) is not None:
            return self._skip(header, "already being written", quiet=True)
        self._catalog.refresh()
        same = self._catalog.get(sha)
        if (
            same is not None
            and same.header.tokens == header.tokens
            and same.header.ctx_size == header.ctx_size
            and same.header.quant_bits == header.quant_bits
        ):
            self._janitor.remember(
                conversation_key, str(same.path), sha, len(text), SaveReason(header.reason)
            )
            return self._skip(header, "already stored", quiet=True)
        ticket = WriteTicket(
            sha,
            self.fs.path_of(sha),
            len(text),
            header.tokens,
            file_size,
            int(header.reason),
            conversation_key,
        )
        # Servers sharing the directory take turns here, and each admitted write is reserved in a
        # file the others count until it lands: together they never pass the budget.
        with self.fs.budget_lock():
            evicted = self._evict(extra=file_size)
            entries = self._catalog.entries(refresh=False)
            room = budget - self._reserved_bytes(entries) - sum(e.file_size for e in entries)
            if file_size > room:
                return self._skip(
                    header, f"no room: {room / MIB:.1f} MiB left after eviction (pinned or in-flight files)"
                )
            reservation = self.fs.reserve(sha, file_size)
        if reservation is not None:
            self._reservations[sha] = reservation
        self._pending.add_write(ticket, text, tokens)
        return Admission(ticket, SaveReason(header.reason).label, tuple(evicted))

    def close(self) -> None:
        """Release the reservations of writes whose report will never come (the engine is stopping).

        A write admitted in the last step (a shutdown save) lands before the step returns, but its
        report would reach the scheduler only in a next step; its reservation file must not stay
        behind for the next start to clean. A write that has not landed is still counted by the
        other servers through its temp file.
        """
        for reservation in self._reservations.values():
            self.fs.release(reservation)
        self._reservations.clear()

    def finish_write(self, report: WriteReport) -> tuple[list[str], list[str]]:
        """Take the worker's report of a ticket; returns (evicted, nested copies removed)."""
        pending = self._pending.finish_write(report.sha1)
        reservation = self._reservations.pop(report.sha1, None)
        if reservation is not None:
            self.fs.release(reservation)
        if not report.stored:
            self._stats.failures += 1
            return [], []
        s = self._stats
        s.stores += 1
        s.bytes_written += report.file_size
        s.save_seconds += report.seconds
        self._catalog.expire()  # a request waiting for this write looks it up next
        if pending is None:
            return [], []
        ticket = pending.ticket
        reason = SaveReason(ticket.reason)
        nested = self._janitor.remove_nested(
            ticket.conversation_key,
            pending.text,
            report.path,
            self._kept_paths(self._catalog.entries(refresh=False)),
        )
        self._stats.files_deduplicated += len(nested)
        self._janitor.remember(ticket.conversation_key, report.path, ticket.sha1, ticket.text_bytes, reason)
        # Other servers on the directory may have grown it meanwhile.
        evicted = self.evict(protected=report.path)
        if time.monotonic() - self._temp_cleaned_at >= TEMP_CLEAN_INTERVAL_S:
            self._clean_temp()
        return evicted, nested

    def store(
        self,
        text: bytes,
        header: KvcHeader,
        payload: Any,
        tool_map: Iterable[ToolMapEntry] = (),
        *,
        tokens: Sequence[int] | None = None,
        conversation_key: str | None = None,
    ) -> StoreResult:
        """Admit and write one checkpoint synchronously (tools and tests; the connector splits it)."""
        tool_map = list(tool_map)
        if isinstance(payload, bytes | bytearray | memoryview):
            p_bytes = memoryview(payload).nbytes
        else:
            p_bytes = payload_size(payload.header, payload.n_comp, payload.n_index_comp)
            if tokens is None:
                tokens = [int(t) for t in payload.tokens]
        admission = self.admit(
            text,
            tokens or (),
            header,
            self.file_size(len(text), p_bytes, tool_map),
            conversation_key=conversation_key,
        )
        if admission.ticket is None:
            same = self._catalog.get(text_sha1(bytes(text)))
            return StoreResult(False, admission.reason, str(same.path) if same is not None else None)
        report = self._writer.write(admission.ticket, text, header, payload, tool_map)
        evicted, nested = self.finish_write(report)
        if not report.stored:
            return StoreResult(False, report.reason)
        return StoreResult(
            True,
            report.reason,
            report.path,
            report.file_size,
            report.seconds,
            (*admission.evicted, *evicted),
            tuple(nested),
        )

    def _skip(self, header: KvcHeader, why: str, *, quiet: bool = False) -> Admission:
        self._stats.store_skips += 1
        log = logger.debug if quiet else logger.info
        log(
            "kv cache skipped tokens=%d reason=%s because %s",
            header.tokens,
            SaveReason(header.reason).label,
            why,
        )
        return Admission(None, why)

    # ------------------------------------------------------------------ eviction

    def _reserved_bytes(self, entries: list[IndexEntry]) -> int:
        """Bytes of in-flight writes not yet on disk (a landed, unreported write counts as a file),
        this store's and other processes' (their temp files)."""
        on_disk = {str(e.path) for e in entries}
        writes = self._pending.writes
        own = sum(w.ticket.file_size for w in writes if w.ticket.path not in on_disk)
        others = self.fs.other_writes_bytes({w.ticket.sha1 for w in writes}, self.options.budget_bytes)
        return own + others

    def evict(self, protected: str | None = None) -> list[str]:
        """ds4's eviction pass over the files, counting the bytes reserved by in-flight writes."""
        return self._evict(protected=protected)

    def _evict(self, *, extra: int = 0, protected: str | None = None) -> list[str]:
        """Evict until files + in-flight writes + `extra` bytes fit the budget.

        This runs on the engine loop for every admitted save, so the directory is re-read in
        full (forced refresh, to see other servers' hit counts) only when something must go.
        """
        self._catalog.refresh()  # cheap unless the directory changed
        entries = self._catalog.entries(refresh=False)
        needed = sum(e.file_size for e in entries) + self._reserved_bytes(entries) + extra
        if needed <= self.options.budget_bytes:
            return []
        entries = self._catalog.entries()
        removed = self._janitor.evict(
            entries,
            self.options.budget_bytes,
            self._clock(),
            pinned=self._kept_paths(entries),
            reserved_bytes=self._reserved_bytes(entries) + extra,
            protected=protected,
        )
        self._stats.files_evicted += len(removed)
        if removed:
            self._catalog.refresh(force=True)
        return removed
