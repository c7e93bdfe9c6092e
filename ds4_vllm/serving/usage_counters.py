"""Cumulative cache usage (hit, miss and disk tokens), kept in the checkpoint directory across restarts.

One small JSON file, `ds4-vllm-usage.json`, next to the `.kv` files (the ds4 engine and the
directory index ignore every other name). Several servers may share a directory, so each
update is a locked read-add-replace: an exclusive `flock` on `.ds4-vllm-usage.lock`, read the
totals, add this response, write a temporary file and rename it over the old one (readers
never see a partial file). The file therefore holds the sum over every server that used the
directory. Without a local directory (no ds4disk, or an fsspec URL) the totals live in
memory, for this process only. No vLLM here.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from ds4_vllm.kvc import ensure_directory
from ds4_vllm.serving.usage import CacheUsage
from ds4_vllm.store.fs import write_private_file

logger = logging.getLogger(__name__)

COUNTERS_FILE = "ds4-vllm-usage.json"
LOCK_FILE = ".ds4-vllm-usage.lock"
COUNTERS_VERSION = 1


@dataclasses.dataclass(frozen=True, slots=True)
class UsageTotals:
    """Sums over responses: requests, prompt tokens, and the prompt tokens' hit/miss/disk split."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    disk_tokens: int = 0

    def plus(self, cache: CacheUsage) -> UsageTotals:
        return UsageTotals(
            self.requests + 1,
            self.prompt_tokens + cache.prompt_tokens,
            self.hit_tokens + cache.hit_tokens,
            self.miss_tokens + cache.miss_tokens,
            self.disk_tokens + (cache.disk_tokens or 0),
        )

    @property
    def hit_rate(self) -> float | None:
        """hit / (hit + miss); None before any prompt token was counted."""
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else None

    def to_json(self) -> dict[str, Any]:
        return {"version": COUNTERS_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> UsageTotals:
        """Parse the counters file; a malformed one raises ValueError naming the file and field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
        values = {}
        for field in dataclasses.fields(cls):
            value = data.get(field.name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"{where}: field {field.name!r} must be a non-negative integer, got {value!r}"
                )
            values[field.name] = value
        return cls(**values)


class UsageCounters:
    """The cumulative totals, in `directory` (shared, persistent) or in memory (`directory=None`)."""

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._memory = UsageTotals()
        self._lock = threading.Lock()

    @property
    def persistent(self) -> bool:
        return self.directory is not None

    @property
    def path(self) -> Path | None:
        return self.directory / COUNTERS_FILE if self.directory is not None else None

    def add(self, cache: CacheUsage) -> None:
        """Add one response (locked read-add-replace when persistent)."""
        with self._lock:
            if self.directory is None:
                self._memory = self._memory.plus(cache)
                return
            ensure_directory(self.directory)  # 0700, as the checkpoint store creates it
            with self._file_lock():
                totals = self._read().plus(cache)
                self._write(totals)

    def totals(self) -> UsageTotals:
        """The current sums (of every server sharing the directory, when persistent)."""
        with self._lock:
            return self._memory if self.directory is None else self._read()

    def _file_lock(self):
        assert self.directory is not None
        return _Flock(self.directory / LOCK_FILE)

    def _read(self) -> UsageTotals:
        path = self.path
        assert path is not None
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return UsageTotals()
        try:
            return UsageTotals.from_json(json.loads(raw), str(path))
        except ValueError as e:
            # Statistics only: a damaged file restarts the counts rather than failing requests.
            logger.warning("ds4 usage counters: %s; counting from zero again", e)
            return UsageTotals()

    def _write(self, totals: UsageTotals) -> None:
        path = self.path
        assert path is not None
        write_private_file(path, (json.dumps(totals.to_json()) + "\n").encode())  # 0600, temp + rename


class _Flock:
    """An exclusive `flock` on a lock file for the duration of a `with` block."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> _Flock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
