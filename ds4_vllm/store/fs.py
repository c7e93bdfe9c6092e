"""Where checkpoint files live: a local directory (plain OS calls) or an fsspec URL.

The store and the writer need these operations on a directory; this module gives them for both
kinds. Local paths and `file://` go straight to `ds4_vllm.kvc` (mmap loads, atomic
rename), so the hot path never goes through fsspec. Other URLs (`memory://`, `s3://`, ...)
go through fsspec: a file is serialized into a local staging folder and uploaded whole,
and loaded by reading the whole object into memory. Remote stores are for sharing and
tests, not for speed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from ds4_vllm.kvc import (
    Checkpoint,
    CheckpointIndex,
    IndexEntry,
    KvcFormatError,
    KvcHeader,
    ToolMapEntry,
    clean_temp_files,
    ensure_directory,
    open_checkpoint,
    parse_checkpoint,
    read_prefix,
    text_sha1,
    touch_checkpoint,
    write_checkpoint,
)
from ds4_vllm.kvc.constants import KV_NAME_RE, KV_SUFFIX, PREFIX_BYTES
from ds4_vllm.kvc.header import unpack_prefix

from .options import is_local_dir, local_path

#: Sub-folder for files that failed validation; scans only look at `<sha1>.kv` in the top level.
QUARANTINE_DIR = "quarantine"
#: Sub-folder of load-lease markers (empty files whose names say who holds which file until when).
LEASE_DIR = "leases"


class CheckpointFS(Protocol):
    """The directory operations the store uses. Paths are strings as the backend spells them."""

    url: str

    def prepare(self) -> None:
        """Create the directory (0700 when local) and prove it is writable; raises OSError."""

    def clean_temp(self) -> list[str]: ...

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

    def clean_temp(self) -> list[str]:
        return [str(p) for p in clean_temp_files(self.directory)]

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
        return open_checkpoint(path, check_name=True)

    def read_header(self, path: str) -> KvcHeader:
        return read_prefix(path, with_text=False).header

    def touch(self, path: str, now: int) -> KvcHeader:
        return touch_checkpoint(path, now=now)

    def remove(self, path: str) -> None:
        os.unlink(path)

    def quarantine(self, path: str) -> str:
        qdir = self.directory / QUARANTINE_DIR
        qdir.mkdir(mode=0o700, exist_ok=True)
        target = qdir / Path(path).name
        os.replace(path, target)
        return str(target)

    def free_bytes(self) -> int | None:
        try:
            return shutil.disk_usage(self.directory).free
        except OSError:
            return None

    def read_small(self, name: str) -> bytes | None:
        try:
            return (self.directory / name).read_bytes()
        except FileNotFoundError:
            return None

    def write_small(self, name: str, data: bytes) -> None:
        tmp = self.directory / f".{name}.tmp.{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, self.directory / name)

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


class FsspecIndex(CheckpointIndex):
    """`CheckpointIndex` over an fsspec filesystem: same entries and lookup, listing via `fs.ls`.

    Files are re-read when their listed size or timestamp changes. Every refresh drops the
    filesystem's listing cache first: s3fs keeps listings forever by default, and files other
    servers wrote would never show up.
    """

    def __init__(self, fs: Any, root: str) -> None:
        super().__init__(root)
        self._fs = fs
        self._root = root

    def refresh(self, *, restat: bool = True):  # type: ignore[override]  # a listing has every stamp
        from ds4_vllm.kvc import RefreshStats

        added = changed = invalid = 0
        self._fs.invalidate_cache(self._root)
        try:
            listing = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            listing = []
        seen: set[Path] = set()
        for info in listing:
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") != "file" or not KV_NAME_RE.match(name):
                continue
            path = Path(info["name"])
            seen.add(path)
            stamp = info.get("mtime") or info.get("LastModified") or info.get("created") or 0
            sig = (int(info.get("size") or 0), hash(str(stamp)), 0, 0)
            outcome = self._update(
                path, sig, lambda p=path, n=name, s=sig: self._read_remote(p, n, s[0], s[1])
            )
            if outcome is not None:
                added += outcome[0] == "added"
                changed += outcome[0] == "changed"
                invalid += outcome[1]
        return RefreshStats(added, changed, self._drop_unseen(seen), invalid)

    def _read_remote(self, path: Path, name: str, size: int, stamp: int) -> IndexEntry | str:
        try:
            with self._fs.open(str(path), "rb") as fp:
                head = fp.read(PREFIX_BYTES)
                header, text_bytes = unpack_prefix(head, size, path)
                text = fp.read(text_bytes)
        except KvcFormatError as exc:
            return f"{exc.field}: {exc.reason}"
        except OSError as exc:
            return f"unreadable: {exc}"
        if len(text) != text_bytes:
            return "text: truncated cached text"
        if text_sha1(text) != name[:40].lower():
            return "file_name: text SHA-1 is not the name's"
        # The listing's timestamp stands in for mtime_ns: it changes when the object is rewritten.
        return IndexEntry(path, name[:40].lower(), header, text_bytes, size, stamp, text)


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
        self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = self.root.rstrip("/") or "/"

    def _join(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def prepare(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        probe = self._join(f".write-probe.{os.getpid()}")
        self.fs.pipe_file(probe, b"")
        self.fs.rm_file(probe)

    def clean_temp(self) -> list[str]:
        return []  # temp files only ever exist in the local staging folder

    def version(self) -> int | None:
        return None

    def new_index(self) -> CheckpointIndex:
        return FsspecIndex(self.fs, self.root)

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
        with self.fs.open(path, "rb") as fp:
            head = fp.read(PREFIX_BYTES)
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


def open_fs(url: str, *, fsync: bool = True) -> CheckpointFS:
    """LocalFS for paths and file:// URLs, FsspecFS for every other URL."""
    if is_local_dir(url):
        return LocalFS(local_path(url), fsync=fsync)
    return FsspecFS(url)
