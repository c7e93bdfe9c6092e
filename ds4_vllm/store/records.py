"""What the two sides of the disk cache tell each other: lookups, write tickets, write and load reports.

The scheduler side (`CheckpointStore`) decides; the worker side (`CheckpointWriter`) moves bytes.
These frozen records cross that boundary (pickled between processes under vLLM), so they hold
plain values only.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
from collections.abc import Sequence

import numpy as np


class LoadFailure(Exception):
    """A checkpoint chosen by a lookup could not be used; the request must recompute.

    `corrupt` says the file itself is bad (the store quarantines it), as opposed to gone,
    unreadable or replaced by another valid file.
    """

    def __init__(self, path: str, reason: str, *, corrupt: bool = False) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.corrupt = corrupt


@dataclasses.dataclass(frozen=True, slots=True)
class LookupOutcome:
    """Answer of a lookup. On a hit, `agreed_tokens` tokens of the prompt can be loaded.

    `reason` explains a miss, or on a hit why fewer tokens agree than the file holds
    ("token mismatch at token N"). `in_flight` hits name a checkpoint whose write has been
    handed to the worker but not yet reported done: the worker restores it from its copy in
    memory, or from the file once written. `tokens_digest` lets the loader check that what it
    opens is what the lookup chose. `shared_bytes`: how many leading bytes of the prompt's
    text a known checkpoint's text shares with it, hit or miss (where they part).
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
    in_flight: bool = False
    tokens_digest: str | None = dataclasses.field(default=None, repr=False)
    shared_bytes: int = 0

    def file_path(self) -> str:
        """The checkpoint a hit names (pinned, loaded, reported); a miss names none."""
        if self.path is None:
            raise ValueError(f"lookup outcome names no checkpoint: {self.reason}")
        return self.path


@dataclasses.dataclass(frozen=True, slots=True)
class WriteTicket:
    """A checkpoint the scheduler side has admitted: budget reserved, lookups may already use it."""

    sha1: str
    path: str
    text_bytes: int
    n_tokens: int
    file_size: int
    reason: int
    conversation_key: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class WriteReport:
    """How a ticket ended: written (`stored`), or why not. Every ticket gets exactly one."""

    sha1: str
    path: str
    stored: bool
    reason: str
    file_size: int = 0
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class LoadReport:
    """How a load ended on the worker side; `corrupt` asks the store to quarantine `path`.

    `seconds` is the worker's time for the load: the store that logs and counts the hit runs in
    the scheduler, which does not see it otherwise.
    """

    path: str
    ok: bool
    reason: str = ""
    corrupt: bool = False
    seconds: float = 0.0


def tokens_digest(tokens: Sequence[int] | np.ndarray) -> str:
    """SHA-1 of the token ids as little-endian uint32: what a load checks against its lookup."""
    return hashlib.sha1(np.ascontiguousarray(np.asarray(tokens, dtype=np.uint32)).tobytes()).hexdigest()


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
