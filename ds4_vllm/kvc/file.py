"""Whole `.kv` files: checked memory-mapped open, atomic streamed write, in-place touch.

This is the only module that creates, renames or rewrites checkpoint files. Writes go to
`<sha1>.kv.tmp.<pid>.<rand>` in the target directory, are fsync'ed, then renamed over the
final name, and the directory is fsync'ed: a crash leaves either the old state or the whole
new file, never a partial `<sha1>.kv`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import mmap
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .atomic import atomic_output, temp_name
from .constants import (
    DIR_MODE,
    FILE_MODE,
    KV_NAME_RE,
    KV_SUFFIX,
    PREFIX_BYTES,
    TMP_NAME_RE,
    ExtFlag,
)
from .errors import KvcFormatError
from .header import KvcHeader, pack_text_len, unpack_prefix
from .payload import Payload, PayloadLike, parse_payload, write_payload
from .payload_layout import payload_size
from .trailer import ToolMap, ToolMapEntry, pack_tool_map, parse_tool_map

PathArg = str | os.PathLike[str]


def text_sha1(text: bytes) -> str:
    """Lower-case hex SHA-1 of the key text: the checkpoint's identity."""
    return hashlib.sha1(text).hexdigest()


def checkpoint_name(text: bytes) -> str:
    """`<sha1(text)>.kv`, the only file name ds4 will look up for this text."""
    return text_sha1(text) + KV_SUFFIX


def name_sha1(name: str) -> str | None:
    """The (lower-cased) hash a checkpoint file name claims, or None if it is not one."""
    return name[:40].lower() if KV_NAME_RE.match(name) else None


def checkpoint_file_size(text_bytes: int, payload_bytes: int, trailer_bytes: int = 0) -> int:
    """Size of a file on disk, for budget checks before writing (spec §3.4)."""
    return PREFIX_BYTES + text_bytes + payload_bytes + trailer_bytes


def open_regular_file(path: PathArg, flags: int = os.O_RDONLY, *, follow_symlinks: bool = True) -> int:
    """Open an existing checkpoint file and return its descriptor, refusing anything but a regular file.

    The open never blocks (a FIFO put in place of a checkpoint would hang a plain open) and,
    with `follow_symlinks=False`, does not follow a link (the store never reads or writes
    through a link out of its directory). Raises KvcFormatError(field "file_type") for a link
    or a non-regular file, OSError for I/O failures.
    """
    nofollow = 0 if follow_symlinks else getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | nofollow | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if nofollow and exc.errno == errno.ELOOP and os.path.islink(path):
            raise KvcFormatError(
                path,
                None,
                "file_type",
                "is a symbolic link; links in a checkpoint directory are not followed",
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "not a regular file"
            )
            raise KvcFormatError(path, None, "file_type", f"is {kind}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclasses.dataclass(frozen=True, slots=True)
class Prefix:
    """Header, text and size of a file, read without touching the payload (for scans)."""

    header: KvcHeader
    text_bytes: int
    text: bytes | None
    file_size: int


def read_prefix(path: PathArg, *, with_text: bool = True, follow_symlinks: bool = True) -> Prefix:
    """Read the 52-byte prefix (and the text), proving header + text + payload fit the file."""
    with open(open_regular_file(path, follow_symlinks=follow_symlinks), "rb") as fp:
        size = os.fstat(fp.fileno()).st_size
        data = fp.read(PREFIX_BYTES)
        header, text_bytes = unpack_prefix(data, size, path)
        text = None
        if with_text:
            text = fp.read(text_bytes)
            if len(text) != text_bytes:  # file shrank under us
                raise KvcFormatError(path, PREFIX_BYTES + len(text), "text", "truncated cached text")
    return Prefix(header, text_bytes, text, size)


class Checkpoint:
    """An opened, fully validated checkpoint. Arrays in `payload` are read-only views of the
    file's memory map: nothing proportional to the payload is copied.

    Use as a context manager. `close()` releases the map once no view is referenced any
    more; views still held keep it alive (and valid) until they are garbage-collected.
    """

    def __init__(
        self,
        *,
        path: Path | None,
        buffer: Any,
        file_size: int,
        header: KvcHeader,
        text: bytes,
        payload: Payload,
        tool_map: ToolMap,
        trailing_bytes: int,
    ) -> None:
        self.path = path
        self.file_size = file_size
        self.header = header
        self.text = text
        self.payload = payload
        self.tool_map = tool_map
        #: Bytes after the payload and any KTM trailer. ds4 tolerates them; `verify` reports them.
        self.trailing_bytes = trailing_bytes
        self._buffer = buffer

    @property
    def text_bytes(self) -> int:
        return len(self.text)

    @property
    def payload_offset(self) -> int:
        return PREFIX_BYTES + len(self.text)

    @property
    def trailer_offset(self) -> int:
        return self.payload_offset + self.header.payload_bytes

    @property
    def sha1(self) -> str:
        return text_sha1(self.text)

    @property
    def name_matches(self) -> bool | None:
        """True/False when the file has a `<sha1>.kv` name, None when it has another name."""
        if self.path is None:
            return None
        claimed = name_sha1(self.path.name)
        return None if claimed is None else claimed == self.sha1

    def close(self) -> None:
        buf, self._buffer = self._buffer, None
        if isinstance(buf, mmap.mmap):
            with contextlib.suppress(BufferError):  # views still exported: GC closes it later
                buf.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_checkpoint(
    buf: Any,
    *,
    path: PathArg | None = None,
    check_name: bool = False,
    strict_trailer: bool = True,
) -> Checkpoint:
    """Validate a whole checkpoint held in `buf` (bytes, mmap, ...) and map its sections.

    Checks, in order: header (magic, version, quant, tokens != 0), text and payload fit the
    buffer, the payload structure and exact length, header tokens == payload T, the KTM
    trailer when ext bit0 is set, and with `check_name` that the name is SHA-1(text) + ".kv".
    Raises KvcFormatError on the first defect.
    """
    size = len(buf)
    header, text_bytes = unpack_prefix(buf[:PREFIX_BYTES], size, path)
    text = bytes(buf[PREFIX_BYTES : PREFIX_BYTES + text_bytes])
    p = Path(path) if path is not None else None
    if check_name:
        if p is None:
            raise KvcFormatError(None, None, "file_name", "check_name needs a path")
        claimed = name_sha1(p.name)
        if claimed is None:
            raise KvcFormatError(p, None, "file_name", f"{p.name!r} is not <40 hex digits>.kv")
        actual = text_sha1(text)
        if claimed != actual:
            raise KvcFormatError(
                p, PREFIX_BYTES, "file_name", f"text SHA-1 is {actual} but the file is named {p.name}"
            )
    payload_at = PREFIX_BYTES + text_bytes
    payload = parse_payload(buf, payload_at, header.payload_bytes, path=p)
    if payload.header.n_tokens != header.tokens:
        raise KvcFormatError(
            p,
            payload_at + 28,
            "payload.n_tokens",
            f"payload holds {payload.header.n_tokens} tokens, header says {header.tokens}",
        )
    trailer_at = payload_at + header.payload_bytes
    tool_map = ToolMap()
    if header.ext_flags & ExtFlag.TOOL_MAP:
        tool_map = parse_tool_map(buf, trailer_at, size, path=p, strict=strict_trailer)
    trailing = size - trailer_at - tool_map.nbytes
    return Checkpoint(
        path=p,
        buffer=buf,
        file_size=size,
        header=header,
        text=text,
        payload=payload,
        tool_map=tool_map,
        trailing_bytes=trailing,
    )


def open_checkpoint(
    path: PathArg, *, check_name: bool = True, strict_trailer: bool = True, follow_symlinks: bool = True
) -> Checkpoint:
    """Open a `.kv` file read-only through mmap and validate it (see `parse_checkpoint`).

    `check_name=False` accepts files under any name (e.g. `inspect` on a renamed copy).
    `strict_trailer=False` reads the KTM trailer as ds4 does (defects stop the scan quietly).
    `follow_symlinks=False` (the store) refuses a link with KvcFormatError("file_type").
    """
    with open(open_regular_file(path, follow_symlinks=follow_symlinks), "rb") as fp:
        size = os.fstat(fp.fileno()).st_size
        if size < PREFIX_BYTES:
            raise KvcFormatError(path, size, "header", f"file has {size} bytes, fewer than 52")
        mm = mmap.mmap(fp.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return parse_checkpoint(mm, path=path, check_name=check_name, strict_trailer=strict_trailer)
    except BaseException:
        with contextlib.suppress(BufferError):
            mm.close()
        raise


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def ensure_directory(directory: PathArg) -> Path:
    """Create the cache directory and missing parents with mode 0700 (existing ones are left as is)."""
    d = Path(directory)
    missing = []
    probe = d
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for part in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process won the race
            os.mkdir(part, DIR_MODE)
            os.chmod(part, DIR_MODE)  # the umask may have narrowed it; never widen beyond 0700
    return d


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    directory: PathArg,
    text: bytes,
    header: KvcHeader,
    payload: PayloadLike | bytes | bytearray | memoryview,
    tool_map: Iterable[ToolMapEntry] = (),
    *,
    fsync: bool = True,
) -> Path:
    """Write `<directory>/<sha1(text)>.kv` atomically and return its path.

    Args:
        text: the key text bytes (they name the file).
        header: header fields; `payload_bytes` is replaced by the real payload size, and ext
            bit0 is set when `tool_map` has entries (otherwise ext_flags are kept as given).
        payload: a `PayloadData` (arrays, or a per-layer callable/iterator streamed one layer
            at a time), a read `Payload` (copy), or raw payload bytes (validated first).
        tool_map: KTM entries; none means no trailer.
        fsync: fsync the file and the directory (turn off only in tests).

    The temp file is created 0600 in the same directory, fsync'ed and renamed; on any
    failure it is removed and the exception re-raised. An existing file of that name is
    replaced. Raises KvcFormatError for inconsistent input, OSError for I/O failures.
    """
    text = bytes(text)
    trailer = pack_tool_map(tool_map)
    raw_payload: memoryview | None = None
    structured: PayloadLike | None = None
    if isinstance(payload, bytes | bytearray | memoryview):
        raw_payload = memoryview(payload).cast("B")
        parse_payload(raw_payload, 0, len(raw_payload))  # never write bytes we could not read back
        size = len(raw_payload)
    else:
        structured = payload
        size = payload_size(payload.header, payload.n_comp, payload.n_index_comp)
        if payload.header.n_tokens != header.tokens:
            raise KvcFormatError(
                None, None, "header.tokens", f"{header.tokens} != payload n_tokens {payload.header.n_tokens}"
            )
    ext = header.ext_flags | (ExtFlag.TOOL_MAP if trailer else 0)
    header = dataclasses.replace(header, payload_bytes=size, ext_flags=int(ext))
    head = header.pack() + pack_text_len(len(text))
    expected = checkpoint_file_size(len(text), size, len(trailer))

    d = ensure_directory(directory)
    final = d / checkpoint_name(text)
    with atomic_output(final, temp=d / temp_name(final.name, prefix="")) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
        with os.fdopen(fd, "wb", buffering=1 << 20) as fp:
            os.fchmod(fp.fileno(), FILE_MODE)
            fp.write(head)
            fp.write(text)
            if raw_payload is not None:
                fp.write(raw_payload)
            elif structured is not None:
                write_payload(fp.write, structured)
            fp.write(trailer)
            fp.flush()
            if fsync:
                os.fsync(fp.fileno())
            actual = os.fstat(fp.fileno()).st_size
        if actual != expected:
            raise KvcFormatError(tmp, actual, "file", f"wrote {actual} bytes, expected {expected}")
    if fsync:
        _fsync_dir(d)
    return final


def touch_checkpoint(
    path: PathArg, *, now: int | None = None, hits: int | None = None, follow_symlinks: bool = True
) -> KvcHeader:
    """Record a disk hit in place, like `ds4_kvstore_touch_file`: hits + 1 (or `hits`), last_used = now.

    Rewrites the 48 header bytes with reserved bytes zero and an unknown reason as 0.
    Not atomic (one 48-byte write), as in ds4. Returns the new header.
    """
    with open(open_regular_file(path, os.O_RDWR, follow_symlinks=follow_symlinks), "r+b") as fp:
        size = os.fstat(fp.fileno()).st_size
        header, _ = unpack_prefix(fp.read(PREFIX_BYTES), size, path)
        new = header.touched(now, hits)
        fp.seek(0)
        fp.write(new.pack())
        fp.flush()
    return new


def rewrite_tool_map(
    path: PathArg, entries: Iterable[ToolMapEntry], *, now: int | None = None, follow_symlinks: bool = True
) -> KvcHeader:
    """Replace the KTM trailer in place, like ds4's `kv_cache_rewrite_trailer`.

    With entries: truncate at the payload end, append the new trailer, set ext bit0, keep
    hits and set last_used = now. With no entries nothing changes (ds4 only rewrites a
    non-empty map). Returns the header as it is afterwards.
    """
    trailer = pack_tool_map(entries)
    with open(open_regular_file(path, os.O_RDWR, follow_symlinks=follow_symlinks), "r+b") as fp:
        size = os.fstat(fp.fileno()).st_size
        header, text_bytes = unpack_prefix(fp.read(PREFIX_BYTES), size, path)
        if not trailer:
            return header
        end = PREFIX_BYTES + text_bytes + header.payload_bytes
        fp.truncate(end)
        fp.seek(end)
        fp.write(trailer)
        new = dataclasses.replace(
            header,
            ext_flags=header.ext_flags | ExtFlag.TOOL_MAP,
            last_used=int(time.time()) if now is None else int(now),
        )
        fp.seek(0)
        fp.write(new.pack())
        fp.flush()
        os.fsync(fp.fileno())
    return new


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def clean_temp_files(
    directory: PathArg,
    *,
    now: float | None = None,
    min_age_s: float = 10.0,
    max_age_s: float = 3600.0,
    dry_run: bool = False,
) -> list[Path]:
    """Remove temp files a crashed writer left (`<sha1>.kv.tmp.<pid>[.<rand>]`); ds4 never does.

    A temp file is stale when it has not been written for `max_age_s`, or when its writer
    pid is not alive on this host and it has not been written for `min_age_s` (a live
    writer keeps the mtime fresh). Returns the paths removed (or that would be, dry run).
    """
    d = Path(directory)
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        it = os.scandir(d)
    except FileNotFoundError:
        return removed
    with it:
        for entry in it:
            m = TMP_NAME_RE.match(entry.name)
            if not m:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            age = now - st.st_mtime
            if age > max_age_s or (age > min_age_s and not _pid_alive(int(m["pid"]))):
                if not dry_run:
                    try:
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        continue
                removed.append(Path(entry.path))
    return removed
