"""`--trace FILE`: one block per request explaining its cache decision, in the spirit of ds4's trace.

Block format (one `key: value` per line; values never contain a newline, they are escaped):

    ===== request <id> <YYYY-MM-DD HH:MM:SS> =====
    prompt_tokens: <P>
    prompt_bytes: <B>

    --- cache decision ---
    cache_source: vllm-memory|disk|none
    cached_tokens: <reused tokens, any source>
    vllm_cached_tokens: <from vLLM's memory>
    disk_cached_tokens: <loaded from disk>
    disk_cache_file: <path>                 (disk hit only)
    disk_entry_tokens: <tokens in that file> (disk hit only)
    disk_cache_in_flight: true              (the hit's write had not finished: served from memory)
    disk_miss_reason: <why disk gave nothing or less than the file holds>
    shared_tokens: <tokens of the prompt a known checkpoint's text shares>  (when it shares any)
    planned_saves: cold@2048 continued@10240 (or "none")

Other events are single lines: `--- trace: <message> ---`, among them one per save the store
admitted, with why it was made: `--- trace: save request=<id> <reason>[(<rule>)]@<tokens>
file=<path> ---` (reasons: cold, continued, evict, shutdown, agent-system; rules: anchor,
ladder, divergence, answer-start). Blocks end with a blank line.
Writes are appended and flushed per block under a lock, so blocks of concurrent requests
never interleave; a failing trace file is reported once and then ignored (never fails a request).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import IO

from .policy import SaveDecision

logger = logging.getLogger(__name__)

#: Where a request's reused tokens came from.
SOURCE_VLLM_MEMORY = "vllm-memory"
SOURCE_DISK = "disk"
SOURCE_NONE = "none"


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


@dataclasses.dataclass(frozen=True, slots=True)
class CacheDecision:
    """What the connector decided for one request; `trace_fields()` is its trace section."""

    prompt_tokens: int
    prompt_bytes: int
    vllm_cached_tokens: int = 0
    disk_cached_tokens: int = 0
    disk_file: str | None = None
    disk_entry_tokens: int | None = None
    disk_miss_reason: str | None = None
    disk_in_flight: bool = False
    #: Tokens of the prompt whose text a known checkpoint's text shares (cut at a line end):
    #: where the prompt parts from the nearest known one, also past a hit.
    shared_tokens: int = 0
    planned_saves: tuple[SaveDecision, ...] = ()

    @property
    def source(self) -> str:
        if self.disk_cached_tokens > 0:
            return SOURCE_DISK
        return SOURCE_VLLM_MEMORY if self.vllm_cached_tokens > 0 else SOURCE_NONE

    @property
    def cached_tokens(self) -> int:
        return max(self.vllm_cached_tokens, self.disk_cached_tokens)

    def trace_fields(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "cache_source": self.source,
            "cached_tokens": self.cached_tokens,
            "vllm_cached_tokens": self.vllm_cached_tokens,
            "disk_cached_tokens": self.disk_cached_tokens,
        }
        if self.disk_file is not None:
            fields["disk_cache_file"] = self.disk_file
        if self.disk_entry_tokens is not None:
            fields["disk_entry_tokens"] = self.disk_entry_tokens
        if self.disk_in_flight:
            fields["disk_cache_in_flight"] = "true"
        if self.disk_miss_reason:
            fields["disk_miss_reason"] = self.disk_miss_reason
        if self.shared_tokens:
            fields["shared_tokens"] = self.shared_tokens
        fields["planned_saves"] = " ".join(map(str, self.planned_saves)) or "none"
        return fields


class TraceWriter:
    """Appends request blocks to a trace file; safe to share between threads."""

    def __init__(self, path: str, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._failed = False
        # Line-buffered append: each line reaches the file even if the process dies. Created 0600:
        # a trace quotes prompt text, as private as the checkpoints it explains.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        self._fp: IO[str] | None = open(fd, "a", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115

    def _stamp(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self._clock()))

    def _emit(self, lines: Iterable[str]) -> None:
        text = "".join(line + "\n" for line in lines)
        with self._lock:
            if self._fp is None:
                return
            try:
                self._fp.write(text)
                self._fp.flush()
            except OSError as exc:
                if not self._failed:
                    self._failed = True
                    logger.warning("kv cache trace write failed file=%s: %s", self.path, exc)

    def request(
        self,
        request_id: str,
        decision: CacheDecision,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """Write one request block (header, `extra` fields, then the cache decision)."""
        lines = [f"===== request {_escape(request_id)} {self._stamp()} ====="]
        lines.append(f"prompt_tokens: {decision.prompt_tokens}")
        lines.append(f"prompt_bytes: {decision.prompt_bytes}")
        lines += [f"{k}: {_escape(v)}" for k, v in (extra or {}).items()]
        lines += ["", "--- cache decision ---"]
        lines += [f"{k}: {_escape(v)}" for k, v in decision.trace_fields().items()]
        lines.append("")
        self._emit(lines)

    def event(self, message: str) -> None:
        """One `--- trace: <message> ---` line (stores, evictions, failures)."""
        self._emit([f"--- trace: {_escape(message)} ---"])

    def close(self) -> None:
        with self._lock:
            fp, self._fp = self._fp, None
        if fp is not None:
            fp.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
