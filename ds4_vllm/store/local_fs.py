"""A local checkpoint directory through `ds4_vllm.kvc` and plain OS calls (flock, rename, mmap)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
from collections.abc import Collection
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ds4_vllm.kvc import (
    Checkpoint,
    CheckpointIndex,
    KvcFormatError,
    KvcHeader,
    ToolMapEntry,
    checkpoint_file_size,
    clean_temp_files,
    ensure_directory,
    open_checkpoint,
    read_prefix,
    touch_checkpoint,
    write_checkpoint,
)
from ds4_vllm.kvc.constants import (
    DIR_MODE,
    FIXED_HEADER_BYTES,
    KV_NAME_RE,
    KV_SUFFIX,
    PREFIX_BYTES,
    TMP_NAME_RE,
)

from .fs import (
    BUDGET_LOCK_NAME,
    LEASE_DIR,
    QUARANTINE_DIR,
    RESERVATION_TAG,
    read_private_file,
    write_private_file,
)
from .trailers import ListedCheckpoint, read_tool_map

logger = logging.getLogger(__name__)


class _DirectoryLock:
    """An exclusive flock on a lock file; a directory where it cannot be created is not locked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> _DirectoryLock:
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # read-only: nothing will be written, so there is nothing to order
            return self
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


class LocalFS:
    """A local directory, through `ds4_vllm.kvc` and plain OS calls."""

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.directory = Path(directory)
        self.url = str(self.directory)
        self.fsync = fsync

    def prepare(self) -> None:
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(20, "not a directory", str(self.directory))
        ensure_directory(self.directory)
        # os.access() lies for root and on read-only mounts: create a file to be sure.
        probe = self.directory / f".write-probe.{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        os.unlink(probe)

    def clean_temp(self, now: float | None = None) -> list[str]:
        return [str(p) for p in clean_temp_files(self.directory, now=now)]

    def budget_lock(self) -> AbstractContextManager[object]:
        return _DirectoryLock(self.directory / BUDGET_LOCK_NAME)

    def reserve(self, sha1: str, file_size: int) -> str | None:
        # A temp-file name (cleaned like one when its process dies) whose suffix is the size.
        path = self.directory / f"{sha1}{KV_SUFFIX}.tmp.{os.getpid()}.{RESERVATION_TAG}{int(file_size)}"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        except OSError:  # read-only or full: the write will fail too; nothing to share
            return None
        return str(path)

    def release(self, reservation: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(reservation)

    def other_writes_bytes(self, own_sha1s: Collection[str], limit: int) -> int:
        claims: dict[str, int] = {}
        landed: set[str] = set()  # written already: counted as a file (its writer has not reported yet)
        try:
            it = os.scandir(self.directory)
        except OSError:
            return 0
        with it:
            for entry in it:
                sha1 = entry.name[:40].lower()
                if KV_NAME_RE.match(entry.name):
                    landed.add(sha1)
                if not TMP_NAME_RE.match(entry.name) or sha1 in own_sha1s:
                    continue
                tag = entry.name.rsplit(".", 1)[-1]
                if tag.startswith(RESERVATION_TAG) and tag[len(RESERVATION_TAG) :].isdigit():
                    size = int(tag[len(RESERVATION_TAG) :])
                    claims[sha1] = max(claims.get(sha1, 0), size if size <= limit else 0)
                    continue
                try:
                    with open(entry.path, "rb") as fp:
                        head = fp.read(PREFIX_BYTES)
                        size = os.fstat(fp.fileno()).st_size
                except OSError:  # renamed or removed meanwhile
                    continue
                final = size
                if len(head) == PREFIX_BYTES:
                    try:
                        header = KvcHeader.unpack(head[:FIXED_HEADER_BYTES])
                    except KvcFormatError:
                        header = None
                    if header is not None:
                        text_bytes = int.from_bytes(head[FIXED_HEADER_BYTES:PREFIX_BYTES], "little")
                        claimed = checkpoint_file_size(text_bytes, header.payload_bytes)
                        final = max(size, claimed if claimed <= limit else size)
                claims[sha1] = max(claims.get(sha1, 0), final)
        return sum(size for sha1, size in claims.items() if sha1 not in landed)

    def version(self) -> int | None:
        try:
            return os.stat(self.directory).st_mtime_ns
        except OSError:
            return None

    def new_index(self) -> CheckpointIndex:
        return CheckpointIndex(self.directory)

    def path_of(self, sha1: str) -> str:
        return str(self.directory / f"{sha1}{KV_SUFFIX}")

    def write(self, text: bytes, header: KvcHeader, payload: Any, tool_map: list[ToolMapEntry]) -> str:
        return str(write_checkpoint(self.directory, text, header, payload, tool_map, fsync=self.fsync))

    def open(self, path: str) -> Checkpoint:
        return open_checkpoint(path, check_name=True, follow_symlinks=False)

    def read_header(self, path: str) -> KvcHeader:
        return read_prefix(path, with_text=False, follow_symlinks=False).header

    def touch(self, path: str, now: int) -> KvcHeader:
        return touch_checkpoint(path, now=now, follow_symlinks=False)

    def remove(self, path: str) -> None:
        os.unlink(path)

    def quarantine(self, path: str) -> str:
        """Move `path` into DIR/quarantine/ (created 0700). Refuses (OSError) when `quarantine` is
        a link or not a directory: a bad file must not be moved out of the store through it."""
        qdir = self.directory / QUARANTINE_DIR
        with contextlib.suppress(FileExistsError):
            os.mkdir(qdir, DIR_MODE)
            os.chmod(qdir, DIR_MODE)
        if not stat.S_ISDIR(os.lstat(qdir).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory (links are not followed)", str(qdir))
        target = qdir / Path(path).name
        os.replace(path, target)
        return str(target)

    def free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.directory).free
        except OSError:
            return None

    def read_small(self, name: str) -> bytes | None:
        return read_private_file(self.directory / name)

    def write_small(self, name: str, data: bytes) -> None:
        write_private_file(self.directory / name, data)

    def put_marker(self, name: str) -> None:
        folder = self.directory / LEASE_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        os.close(os.open(folder / name, os.O_WRONLY | os.O_CREAT, 0o600))

    def list_markers(self) -> list[str]:
        try:
            return os.listdir(self.directory / LEASE_DIR)
        except FileNotFoundError:
            return []

    def remove_marker(self, name: str) -> None:
        try:
            os.unlink(self.directory / LEASE_DIR / name)
        except FileNotFoundError:
            pass

    def list_checkpoints(self) -> list[ListedCheckpoint]:
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        out: list[ListedCheckpoint] = []
        for name in names:
            if not KV_NAME_RE.match(name):  # only checkpoints: ds4's scan takes <40 hex>.kv alone
                continue
            try:
                st = os.stat(self.directory / name, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):  # a link is never followed out of the directory
                path = str(self.directory / name)
                out.append(ListedCheckpoint(name, path, (st.st_size, st.st_mtime_ns), st.st_mtime_ns))
        return out

    def read_tool_map(self, path: str, max_bytes: int) -> list[tuple[str, str]] | None:
        return read_tool_map(path, max_bytes=max_bytes, check_name=True)
