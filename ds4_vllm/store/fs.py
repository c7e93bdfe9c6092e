"""Where checkpoint files live: the operations the store needs on a directory (`CheckpointFS`).

`open_fs` picks the implementation: `local_fs.LocalFS` for paths and `file://` (straight to
`ds4_vllm.kvc`: mmap loads, atomic rename, so the hot path never goes through fsspec), and
`object_fs.FsspecFS` for every other URL (`memory://`, `s3://`, ...), where a file is serialized
into a local staging folder and uploaded whole, and loaded by reading the whole object. Remote
stores are for sharing and tests, not for speed.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Collection
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from ds4_vllm.kvc import (
    Checkpoint,
    CheckpointIndex,
    KvcFormatError,
    KvcHeader,
    ToolMapEntry,
)
from ds4_vllm.kvc.atomic import atomic_output
from ds4_vllm.kvc.constants import (
    FILE_MODE,
)
from ds4_vllm.kvc.file import open_regular_file

from .options import is_local_dir, local_path
from .trailers import ListedCheckpoint

logger = logging.getLogger(__name__)

#: Lock file of a local directory: admissions of all processes on it take turns (flock).
BUDGET_LOCK_NAME = ".ds4-budget.lock"
#: Suffix tag of a reservation file, `<sha1>.kv.tmp.<pid>.r<file size>` (see `LocalFS.reserve`).
RESERVATION_TAG = "r"

#: Sub-folder for files that failed validation; scans only look at `<sha1>.kv` in the top level.
QUARANTINE_DIR = "quarantine"
#: Sub-folder of load-lease markers (empty files whose names say who holds which file until when).
LEASE_DIR = "leases"

#: The small side files (model marker) are a few hundred bytes; a larger one is not ours.
SMALL_FILE_MAX_BYTES = 1 << 16


def write_private_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` atomically with `data`, as a file only the owner can read (0600 whatever the umask).

    A fresh temp file is created exclusively beside it (never through a link), written,
    then renamed over `path`; a link at `path` is replaced, not written through.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with atomic_output(path) as tmp, os.fdopen(os.open(tmp, flags, FILE_MODE), "wb") as fp:
        os.fchmod(fp.fileno(), FILE_MODE)
        fp.write(data)


def read_private_file(path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_MAX_BYTES) -> bytes | None:
    """The bytes of a small regular file, None when absent. Never follows a link, never blocks on a
    FIFO, never reads more than `max_bytes` (raises OSError EFBIG for a larger file)."""
    try:
        fd = open_regular_file(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except KvcFormatError as exc:
        raise OSError(errno.EINVAL, f"{Path(path).name} {exc.reason}", os.fspath(path)) from None
    with os.fdopen(fd, "rb") as fp:
        data = fp.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"{Path(path).name} is larger than {max_bytes} bytes", os.fspath(path))
    return data


class CheckpointFS(Protocol):
    """The directory operations the store uses. Paths are strings as the backend spells them."""

    url: str

    def prepare(self) -> None:
        """Create the directory (0700 when local) and prove it is writable; raises OSError."""

    def clean_temp(self, now: float | None = None) -> list[str]:
        """Remove temp files crashed writers left (ages counted from `now`); returns their paths."""

    def other_writes_bytes(self, own_sha1s: Collection[str], limit: int) -> int:
        """Bytes that other processes' admitted, unfinished writes will take (0 when unknown).

        Processes sharing the directory each reserve their in-flight writes in their own count;
        they see each other's through reservation files (`reserve`) and temp files. A temp
        file's header names its final size; a claim above `limit` (the budget: never admitted)
        counts as its current size. One write counts once however many of its files exist.
        """

    def budget_lock(self) -> AbstractContextManager[object]:
        """Held while one process decides and reserves an admission (other processes wait)."""

    def reserve(self, sha1: str, file_size: int) -> str | None:
        """Make an admitted write visible to other processes before its temp file exists."""

    def release(self, reservation: str) -> None: ...

    def version(self) -> int | None:
        """Changes when files are added or removed (directory mtime); None when unknown."""

    def new_index(self) -> CheckpointIndex: ...

    def path_of(self, sha1: str) -> str:
        """Where the checkpoint whose text has this SHA-1 lives (written or not)."""

    def write(self, text: bytes, header: KvcHeader, payload: Any, tool_map: list[ToolMapEntry]) -> str: ...

    def open(self, path: str) -> Checkpoint: ...

    def read_header(self, path: str) -> KvcHeader: ...

    def touch(self, path: str, now: int) -> KvcHeader: ...

    def remove(self, path: str) -> None: ...

    def quarantine(self, path: str) -> str: ...

    def free_bytes(self) -> int | None: ...

    def read_small(self, name: str) -> bytes | None:
        """A small non-checkpoint file of the directory (the model marker), None when absent."""

    def write_small(self, name: str, data: bytes) -> None: ...

    def put_marker(self, name: str) -> None:
        """Create the empty file `leases/<name>`."""

    def list_markers(self) -> list[str]:
        """Names of the files under `leases/` ([] when there is none)."""

    def remove_marker(self, name: str) -> None:
        """Delete `leases/<name>`; a missing one is not an error."""

    def list_checkpoints(self) -> list[ListedCheckpoint]:
        """The `<sha1>.kv` regular files of the directory ([] when it does not exist)."""

    def read_tool_map(self, path: str, max_bytes: int) -> list[tuple[str, str]] | None:
        """A checkpoint's tool map (`ds4_vllm.store.trailers`); None when it is not a checkpoint."""


def open_fs(url: str, *, fsync: bool = True) -> CheckpointFS:
    """LocalFS for paths and file:// URLs, FsspecFS for every other URL."""
    from .local_fs import LocalFS
    from .object_fs import FsspecFS

    if is_local_dir(url):
        return LocalFS(local_path(url), fsync=fsync)
    return FsspecFS(url)
