"""A checkpoint directory at an fsspec URL (`s3://`, `memory://`, ...): whole-object uploads and
reads, a backend guard that fails fast after the store stopped answering, and listings with the
KVC headers fetched by range reads."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import tempfile
import time
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ds4_vllm.kvc import (
    Checkpoint,
    CheckpointIndex,
    KvcFormatError,
    KvcHeader,
    ToolMapEntry,
    parse_checkpoint,
    write_checkpoint,
)
from ds4_vllm.kvc.constants import (
    KV_NAME_RE,
    KV_SUFFIX,
    PREFIX_BYTES,
)
from ds4_vllm.kvc.header import unpack_prefix
from ds4_vllm.kvc.index import UNREADABLE, FileHead, Listed

from .fs import LEASE_DIR, QUARANTINE_DIR
from .trailers import ListedCheckpoint, tool_map_of

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
            return bytes(self.fs.cat_file(self._join(name)))
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
