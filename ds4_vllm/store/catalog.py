"""The checkpoints in one directory as the scheduler sees them: index, prefix lookup, quarantine.

The directory index lives in memory and is refreshed when the directory changes (or at most
every `refresh_interval_s`), never rescanned per request. A lookup compares the chosen file's
tokens with the prompt's (token arrays of recent files are cached), and a file found corrupt
is moved to `quarantine/` so it is never chosen again.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ds4_vllm.kvc import CheckpointIndex, IndexEntry, KvcFormatError, LookupResult, ModelDims

from .fs import CheckpointFS
from .records import LookupOutcome, os_reason, tokens_digest
from .stats import StoreStats

logger = logging.getLogger(__name__)

#: Token arrays of recently matched files, so repeated lookups do not reopen them.
TOKEN_CACHE_FILES = 64
#: Miss reason of a file whose payload dims are not the model's.
OTHER_SHAPE = "written for another model shape"


class LogOnce:
    """Warn once per key (later repeats go to debug): a broken file must not flood the log."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warning(self, key: str, msg: str, *args: object) -> None:
        if key in self._seen:
            logger.debug(msg, *args)
            return
        self._seen.add(key)
        logger.warning(msg, *args)


def token_agreement(a: np.ndarray, b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    other = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(np.asarray(a[:n]).astype(np.int64) != other)
    return int(diff[0]) if diff.size else n


def agreement_outcome(
    tokens: np.ndarray, prompt_tokens: Sequence[int], min_tokens: int, **candidate: Any
) -> LookupOutcome:
    """The outcome for a candidate (a file or an in-flight write) holding `tokens`.

    A hit needs `min_tokens` agreeing tokens; fewer agreeing than the candidate holds is
    reported as "token mismatch at token N of M (...)": its text begins the prompt, but from
    token N on the prompt's ids are another tokenization of it. Text-keyed reuse in the API
    server makes this rare (the prompt starts with a known state's exact ids); it still happens
    when the API server did not know the state (e.g. a file it could not read).
    """
    agreed = token_agreement(tokens, prompt_tokens)
    mismatch = None
    if agreed < len(tokens):
        theirs = str(int(prompt_tokens[agreed])) if agreed < len(prompt_tokens) else "none (prompt ends)"
        mismatch = (
            f"token mismatch at token {agreed} of {len(tokens)} "
            f"(the text matches; file id {int(tokens[agreed])}, prompt id {theirs})"
        )
    if agreed < min_tokens:
        return LookupOutcome(False, f"{mismatch}, under the minimum {min_tokens}", **candidate)
    return LookupOutcome(
        True, mismatch, agreed_tokens=agreed, tokens_digest=tokens_digest(tokens[:agreed]), **candidate
    )


def miss_reason(result: LookupResult, entries: int) -> str:
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


class Catalog:
    """Index and lookups of one directory; `model_dims` rejects files of another model shape."""

    def __init__(
        self,
        fs: CheckpointFS,
        *,
        model_dims: ModelDims | None,
        refresh_interval_s: float,
        log_once: LogOnce,
        stats: StoreStats,
    ) -> None:
        self.fs = fs
        self._stats = stats  # the owning store's counters
        self.model_dims = model_dims
        self._refresh_interval_s = refresh_interval_s
        self._log_once = log_once
        self._index: CheckpointIndex = fs.new_index()
        self._dir_version: int | None = None
        self._refreshed_at = -float("inf")
        self._tokens: collections.OrderedDict[tuple[str, int, int], np.ndarray] = collections.OrderedDict()
        #: Files not to offer again until they change: corrupt ones that could not be moved, and
        #: files of another model shape. path -> (mtime_ns, size) when set aside.
        self._aside: dict[Path, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._index)

    def entries(self, *, refresh: bool = True) -> list[IndexEntry]:
        if refresh:
            self.refresh(force=True)
        return self._index.entries

    def get(self, sha1: str) -> IndexEntry | None:
        return self._index.get(sha1)

    def expire(self) -> None:
        """Make the next `refresh` re-list: this process just wrote a file (on an object store,
        whose listing has no version, the interval would otherwise hide it from lookups)."""
        self._refreshed_at = -float("inf")

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the directory when forced, when it changed, or after the interval."""
        now = time.monotonic()
        version = self.fs.version()
        recent = now - self._refreshed_at < self._refresh_interval_s
        if not force and recent and (version is None or version == self._dir_version):
            return
        try:
            # Unforced: only new or renamed-over files are read, an unchanged directory is not listed.
            self._index.refresh(restat=force)
        except OSError as exc:  # an object store that does not answer: keep the last listing
            self._refreshed_at = now
            self._log_once.warning(
                "listing", "kv cache cannot list %s: %s (using the last listing)", self.fs.url, os_reason(exc)
            )
            return
        self._dir_version, self._refreshed_at = version, now
        for path, why in self._index.invalid.items():
            # ds4 leaves unparseable files alone (they may be another engine's version) and
            # does not count them against the budget; we say so once.
            self._log_once.warning(f"invalid:{path}", "kv cache ignoring invalid file=%s: %s", path, why)

    def lookup_file(
        self,
        prompt_text: bytes,
        prompt_tokens: Sequence[int],
        *,
        min_tokens: int,
        ctx_size: int | None,
        quant_bits: int | None,
        reject_different_quant: bool,
    ) -> tuple[LookupOutcome | None, LookupOutcome]:
        """(usable file outcome or None, the outcome to report when nothing better turns up).

        A file found corrupt is quarantined, one of another model shape is set aside (kept on
        disk for its owner), and the next best file is tried: a bad file never hides a good one.
        """
        set_aside: LookupOutcome | None = None
        # Each retry sets one more entry aside (or it vanished), so this ends; the bound is a safety net.
        for _ in range(len(self._index) + 2):
            result = self._index.lookup(
                prompt_text,
                min_tokens=min_tokens,
                ctx_size=ctx_size,
                quant_bits=quant_bits,
                reject_different_quant=reject_different_quant,
                exclude=self._set_aside_paths(),
            )
            if result.hit is None:
                miss = set_aside or LookupOutcome(False, miss_reason(result, len(self._index)))
                return None, dataclasses.replace(miss, shared_bytes=result.shared_bytes)
            outcome = self._match_tokens(result.hit, prompt_tokens, min_tokens)
            if (
                outcome is not None
                and not outcome.hit
                and outcome.reason
                and outcome.reason.startswith(OTHER_SHAPE)
            ):
                self._set_aside(result.hit)
                set_aside = set_aside or outcome
                continue
            if outcome is not None:
                outcome = dataclasses.replace(outcome, shared_bytes=result.shared_bytes)
                return (outcome if outcome.hit else None), outcome
            self.refresh(force=True)  # quarantined or vanished: try the next one
        return None, LookupOutcome(False, "corrupt or vanishing files; gave up")

    def _set_aside(self, entry: IndexEntry) -> None:
        """Keep this version of a file out of lookups (it still counts against the budget)."""
        self._aside[entry.path] = (entry.mtime_ns, entry.file_size)

    def _set_aside_paths(self) -> set[Path]:
        """Entries set aside and unchanged since (a rewritten file is looked at again)."""
        if not self._aside:
            return set()
        current = {e.path: (e.mtime_ns, e.file_size) for e in self._index.entries}
        self._aside = {p: sig for p, sig in self._aside.items() if p in current}
        return {p for p, sig in self._aside.items() if current[p] == sig}

    def _match_tokens(
        self, entry: IndexEntry, prompt_tokens: Sequence[int], min_tokens: int
    ) -> LookupOutcome | None:
        """Compare the file's payload tokens with the prompt's; None when the file is unusable."""
        path = str(entry.path)
        key = (path, entry.mtime_ns, entry.file_size)
        tokens = self._tokens.get(key)
        if tokens is None:
            try:
                with self.fs.open(path) as ck:
                    dims = ck.payload.header.dims
                    if self.model_dims is not None and dims != self.model_dims:
                        return LookupOutcome(False, f"{OTHER_SHAPE} {dims}", path=path, sha1=entry.sha1)
                    tokens = np.array(ck.payload.tokens, dtype=np.uint32)
            except FileNotFoundError:
                return None
            except KvcFormatError as exc:
                self.quarantine(path, f"{exc.field}: {exc.reason}")
                return None
            except OSError as exc:
                reason = f"unreadable file: {os_reason(exc)}"
                self._log_once.warning(f"unreadable:{path}", "kv cache load failed file=%s: %s", path, reason)
                return LookupOutcome(False, reason, path=path, sha1=entry.sha1)
            self._tokens[key] = tokens
            while len(self._tokens) > TOKEN_CACHE_FILES:
                self._tokens.popitem(last=False)
        else:
            self._tokens.move_to_end(key)
        return agreement_outcome(
            tokens,
            prompt_tokens,
            min_tokens,
            path=path,
            sha1=entry.sha1,
            entry_tokens=entry.tokens,
            text_bytes=entry.text_bytes,
            file_size=entry.file_size,
            quant_bits=entry.header.quant_bits,
        )

    def quarantine(self, path: str, reason: str) -> bool:
        """Move a bad file out of the scan (DIR/quarantine/); True when it was moved."""
        self._stats.failures += 1
        # Out of lookups at once, whether or not it can be moved: a bad file that stays
        # (read-only directory, `quarantine` a link) must not hide the good ones.
        for entry in self._index.entries:
            if str(entry.path) == path:
                self._set_aside(entry)
        try:
            target = self.fs.quarantine(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._log_once.warning(
                f"quarantine:{path}",
                "kv cache quarantine failed file=%s: %s (%s)",
                path,
                os_reason(exc),
                reason,
            )
            return False
        self._stats.files_quarantined += 1
        self._tokens = collections.OrderedDict((k, v) for k, v in self._tokens.items() if k[0] != path)
        logger.warning("kv cache quarantined file=%s to=%s: %s", path, target, reason)
        return True
