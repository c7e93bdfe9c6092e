"""Reading the tool maps (KTM trailers) of checkpoint files, as ds4's reader reads them.

`ToolMemory.load_directory` takes the ids that checkpoint files carry, at start-up and when a
request names ids another server handed out. It reads them through the store's filesystem layer
(`ds4_vllm.store.fs`: `list_checkpoints` and `read_tool_map`, the `CheckpointTrailers` protocol),
so a local directory and an `s3://` store reload the same ids. The two readers here are the
local one (memory-mapped, no link followed) and ranged reads of a remote object, both through
`tool_map_of`.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

from ds4_vllm.kvc import ExtFlag, KvcFormatError, text_sha1
from ds4_vllm.kvc.constants import (
    KTM_ENTRY_HEADER_BYTES,
    KTM_HEADER_BYTES,
    KTM_MAX_DSML_BYTES,
    KTM_MAX_ENTRIES,
    PREFIX_BYTES,
)
from ds4_vllm.kvc.file import open_regular_file
from ds4_vllm.kvc.header import unpack_prefix
from ds4_vllm.kvc.trailer import ToolMap, parse_tool_map

logger = logging.getLogger(__name__)

#: DS4_TOOL_MEMORY_MAX_BYTES: the memory also stops growing at this much DSML.
TOOL_MEMORY_MAX_BYTES = KTM_MAX_DSML_BYTES


class ListedCheckpoint(NamedTuple):
    """One `<sha1>.kv` file of a store listing."""

    name: str
    path: str
    #: Changes when the file is rewritten: (size, mtime_ns) locally, (size, listed time) remotely.
    stamp: tuple[object, ...]
    #: Oldest first when sorted (seconds or nanoseconds; only the order matters).
    order: float


class CheckpointTrailers(Protocol):
    """What `ToolMemory` needs of a store's filesystem (`LocalFS`, `FsspecFS`)."""

    url: str

    def list_checkpoints(self) -> list[ListedCheckpoint]: ...

    def read_tool_map(self, path: str, max_bytes: int) -> list[tuple[str, str]] | None: ...


def decoded_entries(parsed: ToolMap) -> list[tuple[str, str]]:
    """(id, DSML) text pairs; an id or block that is not UTF-8 cannot be replayed and is left out."""
    out: list[tuple[str, str]] = []
    for entry in parsed.entries:
        try:
            out.append((entry.tool_id.decode("utf-8"), entry.dsml.decode("utf-8", "surrogatepass")))
        except UnicodeDecodeError:
            continue
    return out


def tool_map_of(
    read: Callable[[int, int], bytes | memoryview], size: int, path: str, *, max_bytes: int, check_name: bool
) -> list[tuple[str, str]]:
    """(id, DSML) pairs of a checkpoint's KTM trailer, read the way ds4's reader reads it (a bad
    trailer is ignored, a bad entry ends it), from `read(start, end)` of a file of `size` bytes.

    Reads the prefix, the text only with `check_name` (a file whose name is not the SHA-1 of its
    text is not a checkpoint: KvcFormatError), and the trailer up to where the reader could stop;
    at most `max_bytes` of ids and DSML are copied, whatever sizes the trailer claims.
    """
    header, text_bytes = unpack_prefix(bytes(read(0, PREFIX_BYTES)), size, path)
    if check_name:
        sha = text_sha1(bytes(read(PREFIX_BYTES, PREFIX_BYTES + text_bytes)))
        if sha != Path(path).name[:40].lower():
            raise KvcFormatError(path, PREFIX_BYTES, "file_name", f"text SHA-1 is {sha}, not the name's")
    if not header.ext_flags & ExtFlag.TOOL_MAP:
        return []
    at = PREFIX_BYTES + text_bytes + header.payload_bytes
    if at >= size:
        return []
    trailer = read(at, trailer_read_end(at, size, max_bytes))
    return decoded_entries(
        parse_tool_map(trailer, 0, len(trailer), path=path, strict=False, max_bytes=max_bytes)
    )


def read_tool_map(
    path: str | os.PathLike[str], *, max_bytes: int = TOOL_MEMORY_MAX_BYTES, check_name: bool = False
) -> list[tuple[str, str]] | None:
    """`tool_map_of` a local file, memory-mapped (nothing copied but the entries taken); None
    when it is unreadable or not a checkpoint. A link is not followed."""
    try:
        with open(open_regular_file(path, follow_symlinks=False), "rb") as fp:
            size = os.fstat(fp.fileno()).st_size
            if size < PREFIX_BYTES:
                unpack_prefix(fp.read(), size, path)  # raises: too short for a checkpoint
                return None
            with mmap.mmap(fp.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    return tool_map_of(
                        lambda start, end: view[start:end],
                        size,
                        str(path),
                        max_bytes=max_bytes,
                        check_name=check_name,
                    )
                finally:
                    view.release()
    except (OSError, KvcFormatError) as exc:
        logger.debug("tool memory: skipping %s: %s", path, exc)
        return None


def trailer_read_end(at: int, size: int, max_bytes: int) -> int:
    """Where a ranged read of a trailer at `at` can stop: past it the reader takes nothing (at
    most `max_bytes` of ids and DSML, each entry framed by 8 bytes, at most KTM_MAX_ENTRIES)."""
    return min(size, at + KTM_HEADER_BYTES + max_bytes + KTM_ENTRY_HEADER_BYTES * KTM_MAX_ENTRIES)
