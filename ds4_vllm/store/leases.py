"""Load leases: the rule that keeps every server sharing a store from evicting a file being loaded.

Each server evicts (its `Janitor`, after its own writes and at start-up), and each pins the files
its loads need. Pins are in memory, so another server cannot see them; a lease makes a pin
visible to all: an empty marker `leases/<sha1>.kv.<holder>.<until>` created when the pin is
taken (before the load is sent to the worker) and removed when the last pin of that file by
this holder goes. Eviction and nested-copy removal skip every file with an unexpired lease of
any holder. `until` (epoch seconds) is `now + --kv-cache-lease-s`, so a server that dies
holding a lease delays that file's eviction by at most that long, and a lease outlives the
load as long as no load takes longer than that.

What it does not close: a lease created after an evicting server listed the leases and before
it deleted the file (the width of one eviction pass). Then the load finds the file gone and
fails cleanly; the request recomputes its prompt (a miss, never wrong output).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable

from ds4_vllm.kvc.constants import KV_SUFFIX

from .fs import CheckpointFS

logger = logging.getLogger(__name__)

_MARKER_RE = re.compile(r"^([0-9a-f]{40})\.kv\.([A-Za-z0-9_-]+)\.([0-9]+)$")


def holder_name() -> str:
    """This server's lease holder id: host, pid and a random part (dots would break the name)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def marker_name(file_name: str, holder: str, until: int) -> str:
    return f"{file_name}.{holder}.{until}"


def parse_marker(name: str) -> tuple[str, str, int] | None:
    """(checkpoint file name, holder, until) of a marker name; None for anything else."""
    m = _MARKER_RE.match(name)
    if m is None:
        return None
    return f"{m.group(1)}{KV_SUFFIX}", m.group(2), int(m.group(3))


class LeaseBook:
    """This server's leases on one store, and the reader of everyone's."""

    def __init__(
        self,
        fs: CheckpointFS,
        lease_s: int,
        *,
        clock: Callable[[], float] = time.time,
        holder: str | None = None,
    ) -> None:
        self.fs = fs
        self.lease_s = lease_s
        self.holder = holder or holder_name()
        self._clock = clock
        self._held: collections.Counter[str] = collections.Counter()  # file name -> pins
        self._markers: dict[str, str] = {}  # file name -> marker name

    def acquire(self, path: str) -> None:
        """Take (or count again) this server's lease on the file at `path`."""
        name = _file_name(path)
        self._held[name] += 1
        if self._held[name] > 1:
            return
        marker = marker_name(name, self.holder, int(self._clock()) + self.lease_s)
        try:
            self.fs.put_marker(marker)
        except OSError as exc:  # the load still runs; only other servers' eviction may race it
            logger.warning("kv cache lease failed file=%s: %s", name, exc)
            return
        self._markers[name] = marker

    def release(self, path: str) -> None:
        name = _file_name(path)
        if self._held[name] <= 0:
            return
        self._held[name] -= 1
        if self._held[name] > 0:
            return
        del self._held[name]
        marker = self._markers.pop(name, None)
        if marker is None:
            return
        try:
            self.fs.remove_marker(marker)
        except OSError as exc:  # it expires by itself
            logger.debug("kv cache lease release failed marker=%s: %s", marker, exc)

    def leased(self) -> set[str]:
        """File names with an unexpired lease of any holder (this one's included).

        Expired markers are deleted on the way: their holders are gone or far past any load.
        """
        now = self._clock()
        out: set[str] = set(self._held)
        for marker in self.fs.list_markers():
            parsed = parse_marker(marker)
            if parsed is None:
                continue
            name, _, until = parsed
            if until > now:
                out.add(name)
            elif marker not in self._markers.values():
                self.fs.remove_marker(marker)
        return out


def _file_name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]
