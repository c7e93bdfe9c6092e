"""Reading the tool maps (KTM trailers) of checkpoint files, as ds4's reader reads them.

`ToolMemory.load_directory` takes the ids that checkpoint files carry, at start-up and when a
request names ids another server handed out. It reads them through the store's filesystem layer
(`ds4_vllm.store.fs`: `list_checkpoints` and `read_tool_map`, the `CheckpointTrailers` protocol),
so a local directory and an `s3://` store reload the same ids. The two readers here are the
local one (memory-mapped, no link followed) and the one over bytes fetched by ranged reads.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
from pathlib import Path
from typing import NamedTuple, Protocol

from ds4_vllm.kvc import ExtFlag, KvcFormatError, KvcHeader
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


def trailer_start(header: KvcHeader, text_bytes: int) -> int:
    """Where a checkpoint's trailer begins (the end of its payload)."""
    return PREFIX_BYTES + text_bytes + header.payload_bytes


def read_tool_map(
    path: str | os.PathLike[str], *, max_bytes: int = TOOL_MEMORY_MAX_BYTES, check_name: bool = False
) -> list[tuple[str, str]] | None:
    """(id, DSML) pairs of one local checkpoint's KTM trailer, read the way ds4's reader reads it
    (a bad trailer is ignored, a bad entry ends it); None when the file is unreadable or not a
    checkpoint.

    The file is memory-mapped and at most `max_bytes` of ids and DSML are copied out of it (an
    entry past that ends the map, as a bad one does), whatever sizes the trailer claims. A link
    is not followed. With `check_name` (the directory scan) a file whose name is not the SHA-1
    of its text is not a checkpoint: None.
    """
    try:
        with open(open_regular_file(path, follow_symlinks=False), "rb") as fp:
            size = os.fstat(fp.fileno()).st_size
            header, text_bytes = unpack_prefix(fp.read(PREFIX_BYTES), size, path)
            if check_name and hashlib.sha1(fp.read(text_bytes)).hexdigest() != Path(path).name[:40].lower():
                logger.debug("tool memory: skipping %s: its name is not the SHA-1 of its text", path)
                return None
            if not header.ext_flags & ExtFlag.TOOL_MAP:
                return []
            at = trailer_start(header, text_bytes)
            if at >= size:
                return []
            with mmap.mmap(fp.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                parsed = parse_tool_map(mm, at, size, path=path, strict=False, max_bytes=max_bytes)
    except (OSError, KvcFormatError) as exc:
        logger.debug("tool memory: skipping %s: %s", path, exc)
        return None
    return decoded_entries(parsed)


def trailer_read_end(at: int, size: int, max_bytes: int) -> int:
    """Where a ranged read of a trailer at `at` can stop: past it the reader takes nothing (at
    most `max_bytes` of ids and DSML, each entry framed by 8 bytes, at most KTM_MAX_ENTRIES)."""
    return min(size, at + KTM_HEADER_BYTES + max_bytes + KTM_ENTRY_HEADER_BYTES * KTM_MAX_ENTRIES)


def tool_map_of_trailer(trailer: bytes, *, path: str, max_bytes: int) -> list[tuple[str, str]]:
    """(id, DSML) pairs of a trailer fetched as bytes (a ranged read of a remote object)."""
    return decoded_entries(
        parse_tool_map(trailer, 0, len(trailer), path=path, strict=False, max_bytes=max_bytes)
    )
