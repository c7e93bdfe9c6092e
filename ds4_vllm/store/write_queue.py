"""Checkpoints copied out of the KV cache and waiting for the disk, bounded by bytes.

The engine thread `put`s copies; one writer thread `take`s them in order and calls `done` when
the file is written (or failed). Until then a copy stays findable by its SHA-1 (`find`), so a
load of a checkpoint still in flight is served from memory instead of missing it.

When the queued bytes would pass `max_bytes`, `put` blocks (back-pressure on the engine step)
until the writer catches up, for at most `wait_s`; only then is the save dropped, and the caller
counts and logs it. One item larger than the bound is accepted when the queue is empty, so no
checkpoint is impossible to save.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any


class WriteQueue:
    def __init__(self, max_bytes: int, wait_s: float) -> None:
        self.max_bytes = max_bytes
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._order: collections.deque[str] = collections.deque()
        self._items: dict[str, tuple[int, Any]] = {}  # sha1 -> (bytes, item), queued or being written
        self._bytes = 0
        self._closed = False

    def put(self, sha1: str, nbytes: int, item: Any) -> tuple[bool, float]:
        """Queue `item`; (accepted, seconds spent waiting for room)."""
        started = time.monotonic()
        deadline = started + self.wait_s
        with self._cond:
            while self._items and self._bytes + nbytes > self.max_bytes and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, time.monotonic() - started
                self._cond.wait(left)
            if self._closed:
                return False, time.monotonic() - started
            if sha1 in self._items:  # the same checkpoint is already on its way
                return True, time.monotonic() - started
            self._items[sha1] = (nbytes, item)
            self._order.append(sha1)
            self._bytes += nbytes
            self._cond.notify_all()
            return True, time.monotonic() - started

    def take(self) -> tuple[str, Any] | None:
        """Next item for the writer (it stays findable until `done`); None once closed and empty."""
        with self._cond:
            while not self._order and not self._closed:
                self._cond.wait()
            if not self._order:
                return None
            sha1 = self._order.popleft()
            return sha1, self._items[sha1][1]

    def done(self, sha1: str) -> None:
        with self._cond:
            entry = self._items.pop(sha1, None)
            if entry is not None:
                self._bytes -= entry[0]
            self._cond.notify_all()

    def find(self, sha1: str) -> Any | None:
        with self._cond:
            entry = self._items.get(sha1)
            return None if entry is None else entry[1]

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued item is done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Wake the writer so `take` returns None once the queue is empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
