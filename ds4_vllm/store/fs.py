"""Where checkpoint files live: a local directory (plain OS calls) or an fsspec URL.

The store and the writer need these operations on a directory; this module gives them for both
kinds. Local paths and `file://` go straight to `ds4_vllm.kvc` (mmap loads, atomic
rename), so the hot path never goes through fsspec. Other URLs (`memory://`, `s3://`, ...)
go through fsspec: a file is serialized into a local staging folder and uploaded whole,
and loaded by reading the whole object into memory. Remote stores are for sharing and
tests, not for speed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

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
    parse_checkpoint,
    read_prefix,
    touch_checkpoint,
    write_checkpoint,
)
from ds4_vllm.kvc.atomic import atomic_output
from ds4_vllm.kvc.constants import (
    DIR_MODE,
    FILE_MODE,
    FIXED_HEADER_BYTES,
    KV_NAME_RE,
    KV_SUFFIX,
    PREFIX_BYTES,
    TMP_NAME_RE,
)
from ds4_vllm.kvc.file import open_regular_file
from ds4_vllm.kvc.header import unpack_prefix
from ds4_vllm.kvc.index import UNREADABLE, FileHead, Listed

from .options import is_local_dir, local_path
from .trailers import ListedCheckpoint, read_tool_map, tool_map_of

logger = logging.getLogger(__name__)

#: After an object store failed to answer, its calls fail at once for this long instead of
#: waiting on the network again: the store's lookups run on the engine loop.
BACKEND_RETRY_S = 30.0
#: Deadline of one call to an asynchronous (fsspec) backend such as s3fs: a store that accepts
#: connections but never answers would otherwise hold the engine loop for s3fs's 5 retries of
#: botocore's 60 s read timeout. Whole-object transfers get longer (1 GiB at 3.5 MB/s).
BACKEND_CALL_TIMEOUT_S = 10.0
BACKEND_TRANSFER_TIMEOUT_S = 300.0
_TRANSFERS = frozenset({"put_file", "pipe_file", "cat_file"})

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


def remote_checkpoints(fs: Any, root: str) -> list[tuple[str, str, int, object]]:
    """(name, path, size, listed timestamp) of the `<sha1>.kv` objects under `root`.

    Drops the filesystem's listing cache first: s3fs keeps listings forever by default, and
    files other servers wrote would never show up.
    """
    fs.invalidate_cache(root)
    try:
        listing = fs.ls(root, detail=True)
    except FileNotFoundError:
        return []
    out: list[tuple[str, str, int, object]] = []
    for info in listing:
        name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
        if info.get("type") == "file" and KV_NAME_RE.match(name):
            stamp = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
            out.append((name, str(info["name"]), int(info.get("size") or 0), stamp))
    return out


class FsspecLister:
    """`CheckpointIndex`'s lister over an fsspec filesystem (`remote_checkpoints`; two ranged
    reads per new or changed file). Files are re-read when their listed size or timestamp changes."""

    def __init__(self, fs: Any, root: str) -> None:
        self._fs = fs
        self._root = root

    def listing(self, known: Mapping[str, tuple[Path, int]], *, restat: bool) -> list[Listed] | None:
        out: list[Listed] = []
        for name, path, size, stamp in remote_checkpoints(self._fs, self._root):
            read = functools.partial(self._read, Path(path), size, hash(str(stamp)))
            out.append(Listed(name, Path(path), 0, (size, hash(str(stamp))), read))
        return out

    def _read(self, path: Path, size: int, stamp: int) -> FileHead | str:
        try:
            head = self._fs.cat_file(str(path), start=0, end=PREFIX_BYTES)
            header, text_bytes = unpack_prefix(head, size, path)
            text = self._fs.cat_file(str(path), start=PREFIX_BYTES, end=PREFIX_BYTES + text_bytes)
        except KvcFormatError as exc:
            return f"{exc.field}: {exc.reason}"
        except OSError as exc:
            return f"{UNREADABLE}: {exc}"
        if len(text) != text_bytes:
            return "text: truncated cached text"
        # The listing's timestamp stands in for mtime_ns: it changes when the object is rewritten.
        return FileHead(header, text, size, stamp)


class GuardedBackend:
    """An fsspec filesystem whose failures are all OSError, failing fast while its backend is down.

    s3fs raises botocore exceptions, which are not OSError, when the endpoint cannot be reached,
    after seconds of retries; unguarded, one lookup on the engine loop took the server down. A
    connection-level failure (any non-OSError, or a timeout or connection error) marks the
    backend down for `retry_s`: calls fail at once with EIO, and the outage is logged once
    (with its recovery). Errors about one object (missing, denied) pass through as they are.
    """

    def __init__(
        self,
        fs: Any,
        url: str,
        retry_s: float = BACKEND_RETRY_S,
        call_timeout_s: float = BACKEND_CALL_TIMEOUT_S,
        transfer_timeout_s: float = BACKEND_TRANSFER_TIMEOUT_S,
    ) -> None:
        self._fs = fs
        self._url = url
        self.retry_s = retry_s
        self.call_timeout_s = call_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self._down_until = -float("inf")
        self._down_reason: str | None = None

    @property
    def wrapped(self) -> Any:
        """The fsspec filesystem behind the guard."""
        return self._fs

    def retry_now(self) -> None:
        """Let the next call go to the network although the retry interval has not passed."""
        self._down_until = -float("inf")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: self._call(name, attr, *args, **kwargs)

    def _call(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._down_reason is not None and time.monotonic() < self._down_until:
            raise OSError(errno.EIO, "object store unavailable", self._down_reason)
        if getattr(fn, "__wrapped__", None) is not None:  # fsspec's sync wrapper of a coroutine
            # takes a deadline (plain methods such as `mv` do not)
            whole = name in _TRANSFERS and kwargs.get("start") is None and kwargs.get("end") is None
            kwargs.setdefault("timeout", self.transfer_timeout_s if whole else self.call_timeout_s)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            connection_level = not isinstance(exc, OSError) or isinstance(exc, TimeoutError | ConnectionError)
            if not connection_level:
                raise
            reason = f"{name}: {type(exc).__name__}: {exc}"
            if self._down_reason is None:
                logger.warning(
                    "kv cache object store %s failed (%s); requests are computed, retrying every %.0f s",
                    self._url,
                    reason,
                    self.retry_s,
                )
            self._down_reason = reason
            self._down_until = time.monotonic() + self.retry_s
            raise OSError(errno.EIO, "object store unavailable", reason) from exc
        if self._down_reason is not None:
            logger.warning("kv cache object store %s answers again", self._url)
            self._down_reason = None
        return result


class FsspecFS:
    """Any fsspec URL; see the module docstring for the trade-offs.

    Credentials and endpoint come from the backend's usual sources: for `s3://`, the
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL / AWS_DEFAULT_REGION environment
    variables (or ~/.aws), and fsspec's own `FSSPEC_S3_<OPTION>` variables. `storage_options`
    go to the filesystem as keyword arguments (tests use them).
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        import fsspec  # only remote stores need it

        self.url = url
        fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        self.fs = GuardedBackend(fs, url)
        self.root = self.root.rstrip("/") or "/"

    def _join(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def prepare(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        probe = self._join(f".write-probe.{os.getpid()}")
        self.fs.pipe_file(probe, b"")
        self.fs.rm_file(probe)

    def clean_temp(self, now: float | None = None) -> list[str]:
        return []  # temp files only ever exist in the local staging folder

    def other_writes_bytes(self, own_sha1s: Collection[str], limit: int) -> int:
        return 0  # uploads are whole objects: nothing is visible before it is complete

    def budget_lock(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext()  # object stores have no lock; each process counts its own

    def reserve(self, sha1: str, file_size: int) -> str | None:
        return None

    def release(self, reservation: str) -> None:
        pass

    def version(self) -> int | None:
        return None

    def new_index(self) -> CheckpointIndex:
        return CheckpointIndex(self.root, lister=FsspecLister(self.fs, self.root))

    def path_of(self, sha1: str) -> str:
        return self._join(f"{sha1}{KV_SUFFIX}")

    def write(self, text: bytes, header: KvcHeader, payload: Any, tool_map: list[ToolMapEntry]) -> str:
        with tempfile.TemporaryDirectory(prefix="ds4-kvc-stage-") as stage:
            local = write_checkpoint(stage, text, header, payload, tool_map, fsync=False)
            target = self._join(local.name)
            self.fs.put_file(str(local), target)
        return target

    def open(self, path: str) -> Checkpoint:
        return parse_checkpoint(self.fs.cat_file(path), path=path, check_name=True)

    def read_header(self, path: str) -> KvcHeader:
        head = self.fs.cat_file(path, start=0, end=PREFIX_BYTES)
        return unpack_prefix(head, self.fs.size(path), path)[0]

    def touch(self, path: str, now: int) -> KvcHeader:
        # Object stores cannot rewrite 48 bytes in place: rewrite the whole object.
        data = bytearray(self.fs.cat_file(path))
        header, _ = unpack_prefix(bytes(data[:PREFIX_BYTES]), len(data), path)
        new = header.touched(now)
        data[: len(new.pack())] = new.pack()
        self.fs.pipe_file(path, bytes(data))
        return new

    def remove(self, path: str) -> None:
        self.fs.rm_file(path)

    def quarantine(self, path: str) -> str:
        qdir = self._join(QUARANTINE_DIR)
        self.fs.makedirs(qdir, exist_ok=True)
        target = f"{qdir}/{path.rsplit('/', 1)[-1]}"
        self.fs.mv(path, target)
        return target

    def free_bytes(self) -> int | None:
        return None

    def read_small(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._join(name))
        except FileNotFoundError:
            return None

    def write_small(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self._join(name), data)

    def put_marker(self, name: str) -> None:
        self.fs.pipe_file(self._join(f"{LEASE_DIR}/{name}"), b"")

    def list_markers(self) -> list[str]:
        folder = self._join(LEASE_DIR)
        self.fs.invalidate_cache(folder)
        try:
            names = self.fs.ls(folder, detail=False)
        except FileNotFoundError:
            return []
        return [str(n).rstrip("/").rsplit("/", 1)[-1] for n in names]

    def remove_marker(self, name: str) -> None:
        try:
            self.fs.rm_file(self._join(f"{LEASE_DIR}/{name}"))
        except FileNotFoundError:
            pass

    def list_checkpoints(self) -> list[ListedCheckpoint]:
        return [
            ListedCheckpoint(name, path, (size, str(stamp)), _seconds(stamp))
            for name, path, size, stamp in remote_checkpoints(self.fs, self.root)
        ]

    def read_tool_map(self, path: str, max_bytes: int) -> list[tuple[str, str]] | None:
        """Three ranged reads: the prefix, the text (its SHA-1 must be the name), the trailer."""
        try:
            return tool_map_of(
                lambda start, end: self.fs.cat_file(path, start=start, end=end),
                self.fs.size(path),
                path,
                max_bytes=max_bytes,
                check_name=True,
            )
        except (OSError, KvcFormatError) as exc:
            logger.debug("tool memory: skipping %s: %s", path, exc)
            return None


def _seconds(listed: object) -> float:
    """A listing's timestamp as seconds (s3fs gives datetimes, memory:// floats or datetimes)."""
    if isinstance(listed, (int, float)):
        return float(listed)
    timestamp = getattr(listed, "timestamp", None)
    return float(timestamp()) if callable(timestamp) else 0.0


def open_fs(url: str, *, fsync: bool = True) -> CheckpointFS:
    """LocalFS for paths and file:// URLs, FsspecFS for every other URL."""
    if is_local_dir(url):
        return LocalFS(local_path(url), fsync=fsync)
    return FsspecFS(url)
