"""The KTM tool-id map trailer (spec §4): which tool-call id maps to which sampled DSML block."""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterable

from .constants import (
    KTM_ENTRY_HEADER_BYTES,
    KTM_ENTRY_STRUCT,
    KTM_HEADER_BYTES,
    KTM_HEADER_STRUCT,
    KTM_MAGIC,
    KTM_MAX_DSML_BYTES,
    KTM_MAX_ENTRIES,
    KTM_MAX_ID_BYTES,
    KTM_VERSION,
)
from .errors import KvcFormatError

_KTM_HEADER = struct.Struct(KTM_HEADER_STRUCT)
_KTM_ENTRY = struct.Struct(KTM_ENTRY_STRUCT)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolMapEntry:
    """One tool-call id and the exact DSML block bytes it was sampled in."""

    tool_id: bytes
    dsml: bytes

    def check(self, index: int = 0) -> None:
        """Refuse entries the ds4 reader would stop at (1 <= id <= 256, 1 <= dsml <= 512 MiB)."""
        if not 1 <= len(self.tool_id) <= KTM_MAX_ID_BYTES:
            raise KvcFormatError(
                None, None, f"ktm.entry[{index}].id_len", f"{len(self.tool_id)} is outside 1..256"
            )
        if not 1 <= len(self.dsml) <= KTM_MAX_DSML_BYTES:
            raise KvcFormatError(
                None, None, f"ktm.entry[{index}].dsml_len", f"{len(self.dsml)} is outside 1..512 MiB"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class ToolMap:
    """A parsed trailer. `present` is False when no KTM bytes were found (including ds4's
    "bit0 set but EOF at the trailer position" case, which means no entries)."""

    entries: tuple[ToolMapEntry, ...] = ()
    present: bool = False
    nbytes: int = 0

    @property
    def ids(self) -> list[str]:
        return [e.tool_id.decode("utf-8", "replace") for e in self.entries]


def tool_map_size(entries: Iterable[ToolMapEntry]) -> int:
    """Serialized size: 8 + sum(8 + id + dsml), or 0 when there are no entries."""
    entries = list(entries)
    if not entries:
        return 0
    return KTM_HEADER_BYTES + sum(KTM_ENTRY_HEADER_BYTES + len(e.tool_id) + len(e.dsml) for e in entries)


def pack_tool_map(entries: Iterable[ToolMapEntry]) -> bytes:
    """The trailer bytes; empty for no entries (ds4 writes nothing, not even the header)."""
    entries = list(entries)
    if not entries:
        return b""
    if len(entries) > KTM_MAX_ENTRIES:
        raise KvcFormatError(
            None, None, "ktm.count", f"{len(entries)} entries exceed the reader limit {KTM_MAX_ENTRIES}"
        )
    parts = [_KTM_HEADER.pack(KTM_MAGIC, KTM_VERSION, len(entries))]
    for i, entry in enumerate(entries):
        entry.check(i)
        parts.append(_KTM_ENTRY.pack(len(entry.tool_id), len(entry.dsml)))
        parts.append(bytes(entry.tool_id))
        parts.append(bytes(entry.dsml))
    return b"".join(parts)


def parse_tool_map(
    buf: bytes | memoryview,
    start: int,
    end: int,
    *,
    path: str | os.PathLike[str] | None = None,
    strict: bool = True,
    max_bytes: int | None = None,
) -> ToolMap:
    """Parse a trailer found at `buf[start:end]` (offsets are absolute, for error messages).

    `strict=True` raises KvcFormatError on any defect (what `verify` wants). `strict=False`
    follows ds4's `kv_tool_map_load_from_pos`: a bad header ignores the trailer, a bad entry
    stops the scan and keeps the entries read so far. Zero bytes always mean "no entries".
    `max_bytes` bounds the id + DSML bytes copied out of `buf`: an entry that would pass it
    ends the scan like a bad entry (lenient) or raises (strict), so a huge trailer in a
    memory-mapped file is never copied whole.
    """
    avail = end - start
    if avail <= 0:
        return ToolMap()

    def fail(offset: int, field: str, reason: str) -> None:
        if strict:
            raise KvcFormatError(path, offset, field, reason)

    if avail < KTM_HEADER_BYTES:
        fail(start, "ktm.header", f"only {avail} bytes after the payload, the KTM header needs 8")
        return ToolMap()
    magic, version, count = _KTM_HEADER.unpack_from(buf, start)
    if magic != KTM_MAGIC:
        fail(start, "ktm.magic", f"{bytes(magic)!r} is not b'KTM'")
        return ToolMap()
    if version != KTM_VERSION:
        fail(start + 3, "ktm.version", f"{version} is not {KTM_VERSION}")
        return ToolMap()
    if count > KTM_MAX_ENTRIES:
        fail(start + 4, "ktm.count", f"{count} entries exceed the limit {KTM_MAX_ENTRIES}")
        return ToolMap()
    # Each entry takes at least 10 bytes, so a count the bytes cannot hold is known at once.
    if count * (KTM_ENTRY_HEADER_BYTES + 2) > avail - KTM_HEADER_BYTES:
        fail(start + 4, "ktm.count", f"{count} entries cannot fit in {avail - KTM_HEADER_BYTES} bytes")
    pos = start + KTM_HEADER_BYTES
    copied = 0
    entries: list[ToolMapEntry] = []
    for i in range(count):
        if end - pos < KTM_ENTRY_HEADER_BYTES:
            fail(pos, f"ktm.entry[{i}]", "truncated entry header")
            break
        id_len, dsml_len = _KTM_ENTRY.unpack_from(buf, pos)
        if not 1 <= id_len <= KTM_MAX_ID_BYTES:
            fail(pos, f"ktm.entry[{i}].id_len", f"{id_len} is outside 1..{KTM_MAX_ID_BYTES}")
            break
        if not 1 <= dsml_len <= KTM_MAX_DSML_BYTES:
            fail(pos + 4, f"ktm.entry[{i}].dsml_len", f"{dsml_len} is outside 1..{KTM_MAX_DSML_BYTES}")
            break
        body = pos + KTM_ENTRY_HEADER_BYTES
        if max_bytes is not None and copied + id_len + dsml_len > max_bytes:
            fail(pos, f"ktm.entry[{i}]", f"entries past this one exceed the {max_bytes}-byte read limit")
            break
        if body + id_len + dsml_len > end:
            fail(
                pos,
                f"ktm.entry[{i}]",
                f"entry of {id_len}+{dsml_len} bytes runs past the end of the file ({end})",
            )
            break
        entries.append(
            ToolMapEntry(
                bytes(buf[body : body + id_len]), bytes(buf[body + id_len : body + id_len + dsml_len])
            )
        )
        pos = body + id_len + dsml_len
        copied += id_len + dsml_len
    return ToolMap(entries=tuple(entries), present=True, nbytes=pos - start)
