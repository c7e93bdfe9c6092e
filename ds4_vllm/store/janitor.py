"""The only code that deletes checkpoints: budget eviction and nested copies of one conversation.

Owned by `CheckpointStore` (scheduler side), which passes in the pins and the bytes reserved by
in-flight writes, so a file pinned for a pending load is never deleted and the budget is
counted once, in one process.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Collection

from ds4_vllm.kvc import IndexEntry, KvcFormatError, SaveReason, text_sha1

from .catalog import LogOnce
from .eviction import MIB, EvictionEntry, plan_eviction
from .fs import CheckpointFS
from .records import os_reason

logger = logging.getLogger(__name__)

#: Conversations whose own checkpoints we remember for the nested-file rule.
CONVERSATIONS_REMEMBERED = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class _Written:
    path: str
    sha1: str
    text_bytes: int
    reason: SaveReason


class Janitor:
    def __init__(self, fs: CheckpointFS, log_once: LogOnce) -> None:
        self.fs = fs
        self._log_once = log_once
        self._written: collections.OrderedDict[str, list[_Written]] = collections.OrderedDict()

    def evict(
        self,
        entries: list[IndexEntry],
        budget_bytes: int,
        now: float,
        *,
        pinned: Collection[str],
        reserved_bytes: int = 0,
        protected: str | None = None,
    ) -> list[str]:
        """ds4's eviction pass: delete lowest-score files until files + reserved bytes fit the budget.

        Pinned files are never chosen, not even when `protected`; their bytes still count.
        Stops at the first deletion that fails for another reason than the file being gone.
        """
        pinned_bytes = 0
        candidates: list[EvictionEntry] = []
        for e in entries:
            if str(e.path) in pinned:
                pinned_bytes += e.file_size
                continue
            h = e.header
            candidates.append(
                EvictionEntry(str(e.path), e.file_size, h.tokens, h.hits, h.created_at, h.last_used)
            )
        room = budget_bytes - pinned_bytes - reserved_bytes
        removed: list[str] = []
        for v in plan_eviction(candidates, room, now, protected):
            try:
                self.fs.remove(v.path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                self._log_once.warning(
                    f"evict:{exc.errno}", "kv cache evict failed file=%s: %s", v.path, os_reason(exc)
                )
                break
            removed.append(v.path)
            logger.info(
                "kv cache evicted reason=disk-cache-full tokens=%d hits=%d size=%.1f MiB file=%s",
                v.tokens,
                v.hits,
                v.file_size / MIB,
                v.path,
            )
        return removed

    def remember(self, key: str | None, path: str, sha: str, text_bytes: int, reason: SaveReason) -> None:
        """Record that conversation `key` owns `path` (for `remove_nested`)."""
        if key is None:
            return
        written = self._written.setdefault(key, [])
        if all(w.path != path for w in written):
            written.append(_Written(path, sha, text_bytes, reason))
        self._written.move_to_end(key)
        while len(self._written) > CONVERSATIONS_REMEMBERED:
            self._written.popitem(last=False)

    def remove_nested(
        self, key: str | None, text: bytes, new_path: str, pinned: Collection[str]
    ) -> list[str]:
        """Delete this conversation's older files that the new one makes redundant.

        Rule: an older file goes when (1) this store wrote it for the same conversation key,
        (2) its text is a byte prefix of the new text, (3) it is not a `cold` or `agent-system`
        file, (4) its header still says 0 hits, and (5) it is not pinned. Why: a conversation's
        next turn extends its latest text, so lookups pick the longest file and the shorter one
        only competes for budget (users saw five nested files of one prompt evicting each other).
        Cold and agent-system files are kept because their purpose is to be shared by other
        conversations with the same tools/system prompt; a file with hits was useful to someone
        else; files of other writers are never touched.
        """
        if key is None or key not in self._written:
            return []
        removed: list[str] = []
        keep: list[_Written] = []
        for w in self._written[key]:
            nested = (
                w.path != new_path
                and w.reason not in (SaveReason.COLD, SaveReason.AGENT_SYSTEM)
                and w.text_bytes < len(text)
                and text_sha1(text[: w.text_bytes]) == w.sha1
                and w.path not in pinned
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
            logger.info("kv cache removed nested file=%s reason=superseded-by file=%s", w.path, new_path)
        self._written[key] = keep
        return removed
