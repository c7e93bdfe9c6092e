"""The 48-byte fixed header and the u32 text length that follows it (spec §2.3, §2.4)."""

from __future__ import annotations

import dataclasses
import os
import struct
import time

from .constants import (
    FIXED_HEADER_BYTES,
    HEADER_STRUCT,
    KVC_MAGIC,
    KVC_VERSION,
    PREFIX_BYTES,
    TEXT_LEN_STRUCT,
    U32_MAX,
    U64_MAX,
    VALID_QUANT_BITS,
    HeaderOffset,
    SaveReason,
    key_kind,
)
from .errors import KvcFormatError

_HEADER = struct.Struct(HEADER_STRUCT)
_TEXT_LEN = struct.Struct(TEXT_LEN_STRUCT)
assert _HEADER.size == FIXED_HEADER_BYTES and FIXED_HEADER_BYTES + _TEXT_LEN.size == PREFIX_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class KvcHeader:
    """Parsed fixed header. `reason` is already clamped (codes > 6 read as 0, as ds4 does).

    Reserved bytes are not kept: ds4 ignores them on read and writes zeros.
    """

    quant_bits: int
    reason: int
    ext_flags: int
    tokens: int
    hits: int
    ctx_size: int
    created_at: int
    last_used: int
    payload_bytes: int

    @classmethod
    def new(
        cls,
        *,
        quant_bits: int,
        reason: int | SaveReason,
        tokens: int,
        ctx_size: int,
        ext_flags: int = 0,
        now: int | None = None,
        payload_bytes: int = 0,
    ) -> KvcHeader:
        """Header of a fresh checkpoint, as ds4 writes it: hits 0, created_at == last_used == now.

        `payload_bytes` is filled in by `write_checkpoint`, so it may stay 0 here.
        """
        stamp = int(time.time()) if now is None else int(now)
        return cls(
            quant_bits=quant_bits,
            reason=int(reason),
            ext_flags=ext_flags,
            tokens=tokens,
            hits=0,
            ctx_size=ctx_size,
            created_at=stamp,
            last_used=stamp,
            payload_bytes=payload_bytes,
        )

    @property
    def reason_name(self) -> str:
        return SaveReason(self.reason).label

    @property
    def key_kind(self) -> str:
        return key_kind(self.ext_flags)

    def pack(self) -> bytes:
        """The 48 header bytes, reserved bytes zero. Raises KvcFormatError for out-of-range values."""
        self.check_writable()
        return _HEADER.pack(
            KVC_MAGIC,
            KVC_VERSION,
            self.quant_bits,
            self.reason,
            self.ext_flags,
            0,
            self.tokens,
            self.hits,
            self.ctx_size,
            0,
            self.created_at,
            self.last_used,
            self.payload_bytes,
        )

    def check_writable(self) -> None:
        """Refuse values ds4 would reject on read, or that do not fit their field."""
        if self.quant_bits not in VALID_QUANT_BITS:
            raise KvcFormatError(
                None, HeaderOffset.QUANT_BITS, "header.quant_bits", f"{self.quant_bits} is not 2 or 4"
            )
        limits = (
            ("reason", self.reason, 0, 255),
            ("ext_flags", self.ext_flags, 0, 255),
            ("tokens", self.tokens, 1, U32_MAX),
            ("hits", self.hits, 0, U32_MAX),
            ("ctx_size", self.ctx_size, 0, U32_MAX),
            ("created_at", self.created_at, 0, U64_MAX),
            ("last_used", self.last_used, 0, U64_MAX),
            ("payload_bytes", self.payload_bytes, 0, U64_MAX),
        )
        for name, value, lo, hi in limits:
            if not isinstance(value, int) or not lo <= value <= hi:
                raise KvcFormatError(
                    None, HeaderOffset[name.upper()], f"header.{name}", f"{value!r} is outside {lo}..{hi}"
                )

    @classmethod
    def unpack(cls, data: bytes | memoryview, path: str | os.PathLike[str] | None = None) -> KvcHeader:
        """Parse and validate 48 bytes (checks 4-5 of spec §2.7)."""
        if len(data) < FIXED_HEADER_BYTES:
            raise KvcFormatError(
                path, len(data), "header", f"file has {len(data)} bytes, the header needs 48"
            )
        (magic, version, quant, reason, ext, _r0, tokens, hits, ctx, _r1, created, used, payload) = (
            _HEADER.unpack_from(data, 0)
        )
        if magic != KVC_MAGIC:
            raise KvcFormatError(path, HeaderOffset.MAGIC, "header.magic", f"{bytes(magic)!r} is not b'KVC'")
        if version != KVC_VERSION:
            raise KvcFormatError(
                path, HeaderOffset.VERSION, "header.version", f"{version} is not {KVC_VERSION}"
            )
        if quant not in VALID_QUANT_BITS:
            raise KvcFormatError(path, HeaderOffset.QUANT_BITS, "header.quant_bits", f"{quant} is not 2 or 4")
        if tokens == 0:
            raise KvcFormatError(path, HeaderOffset.TOKENS, "header.tokens", "token count is 0")
        if reason > max(SaveReason):
            reason = SaveReason.UNKNOWN
        return cls(
            quant_bits=quant,
            reason=reason,
            ext_flags=ext,
            tokens=tokens,
            hits=hits,
            ctx_size=ctx,
            created_at=created,
            last_used=used,
            payload_bytes=payload,
        )

    def touched(self, now: int | None = None, hits: int | None = None) -> KvcHeader:
        """The header after a disk hit (`ds4_kvstore_touch_file`): hits + 1, last_used = now."""
        new_hits = self.hits + 1 if hits is None else hits
        return dataclasses.replace(
            self,
            hits=min(new_hits, U32_MAX),
            last_used=int(time.time()) if now is None else int(now),
        )


def pack_text_len(text_bytes: int) -> bytes:
    if not 0 <= text_bytes <= U32_MAX:
        raise KvcFormatError(
            None, HeaderOffset.TEXT_BYTES, "text_bytes", f"text of {text_bytes} bytes does not fit a u32"
        )
    return _TEXT_LEN.pack(text_bytes)


def unpack_prefix(
    data: bytes | memoryview, file_size: int, path: str | os.PathLike[str] | None = None
) -> tuple[KvcHeader, int]:
    """Parse the 52-byte prefix and prove header + text + payload fit in `file_size` (spec §2.7)."""
    if file_size < PREFIX_BYTES or len(data) < PREFIX_BYTES:
        raise KvcFormatError(
            path, min(file_size, len(data)), "header", f"file has {file_size} bytes, fewer than 52"
        )
    header = KvcHeader.unpack(data, path)
    (text_bytes,) = _TEXT_LEN.unpack_from(data, FIXED_HEADER_BYTES)
    if PREFIX_BYTES + text_bytes > file_size:
        raise KvcFormatError(
            path,
            HeaderOffset.TEXT_BYTES,
            "text_bytes",
            f"text of {text_bytes} bytes runs past the end of the {file_size}-byte file",
        )
    end = PREFIX_BYTES + text_bytes + header.payload_bytes  # Python ints: no u64 overflow
    if end > file_size:
        raise KvcFormatError(
            path,
            HeaderOffset.PAYLOAD_BYTES,
            "header.payload_bytes",
            f"payload of {header.payload_bytes} bytes ends at byte {end}, past the end of the {file_size}-byte file",
        )
    return header, text_bytes
