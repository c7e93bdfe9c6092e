"""Fixed header: golden bytes from the spec, ds4's read quirks, and rejection of bad values."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds4_vllm.kvc import KvcFormatError, KvcHeader, SaveReason
from ds4_vllm.kvc.header import unpack_prefix

# spec §2.3 example: quant 2, cold, no ext, 2048 tokens, ctx 100000, time 1767225600,
# payload 52 184 460 bytes.
SPEC_HEADER_HEX = """
4b 56 43 01 02 01 00 00 00 08 00 00 00 00 00 00
a0 86 01 00 00 00 00 00 00 b9 55 69 00 00 00 00
00 b9 55 69 00 00 00 00 8c 45 1c 03 00 00 00 00
"""
SPEC_HEADER = bytes.fromhex(SPEC_HEADER_HEX)
SPEC_FIELDS = KvcHeader(
    quant_bits=2,
    reason=SaveReason.COLD,
    ext_flags=0,
    tokens=2048,
    hits=0,
    ctx_size=100000,
    created_at=1767225600,
    last_used=1767225600,
    payload_bytes=52_184_460,
)


def test_pack_matches_spec_hexdump() -> None:
    header = KvcHeader.new(quant_bits=2, reason=SaveReason.COLD, tokens=2048, ctx_size=100000, now=1767225600)
    header = KvcHeader(
        **{**{f: getattr(header, f) for f in header.__dataclass_fields__}, "payload_bytes": 52_184_460}
    )
    assert header.pack() == SPEC_HEADER
    assert SPEC_FIELDS.pack() == SPEC_HEADER


def test_unpack_spec_hexdump() -> None:
    assert KvcHeader.unpack(SPEC_HEADER) == SPEC_FIELDS
    assert SPEC_FIELDS.reason_name == "cold" and SPEC_FIELDS.key_kind == "token-text"


def _with(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


@pytest.mark.parametrize("reason", [7, 8, 200, 255])
def test_unknown_reason_reads_as_zero(reason: int) -> None:
    assert KvcHeader.unpack(_with(SPEC_HEADER, 5, "<B", reason)).reason == 0


@pytest.mark.parametrize("reason", range(7))
def test_known_reasons_kept(reason: int) -> None:
    assert KvcHeader.unpack(_with(SPEC_HEADER, 5, "<B", reason)).reason == reason


def test_reserved_bytes_ignored_on_read_and_zeroed_on_write() -> None:
    dirty = _with(_with(SPEC_HEADER, 7, "<B", 0xAB), 20, "<I", 0xDEADBEEF)
    header = KvcHeader.unpack(dirty)
    assert header == SPEC_FIELDS
    assert header.pack() == SPEC_HEADER


def test_unknown_ext_bits_kept() -> None:
    header = KvcHeader.unpack(_with(SPEC_HEADER, 6, "<B", 0xF3))
    assert header.ext_flags == 0xF3
    assert header.key_kind == "responses-visible"
    assert KvcHeader.unpack(header.pack()).ext_flags == 0xF3


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "field"),
    [
        (0, "<B", ord("X"), "header.magic"),
        (3, "<B", 2, "header.version"),
        (4, "<B", 3, "header.quant_bits"),
        (4, "<B", 8, "header.quant_bits"),
        (8, "<I", 0, "header.tokens"),
    ],
)
def test_invalid_header_fields_rejected(offset: int, fmt: str, value: int, field: str) -> None:
    with pytest.raises(KvcFormatError) as info:
        KvcHeader.unpack(_with(SPEC_HEADER, offset, fmt, value), "x.kv")
    assert info.value.field == field
    assert info.value.offset == offset
    assert f"byte {offset}" in str(info.value)


@pytest.mark.parametrize("quant", [2, 4])
def test_legal_quant_twins(quant: int) -> None:
    assert KvcHeader.unpack(_with(SPEC_HEADER, 4, "<B", quant)).quant_bits == quant


def test_prefix_bounds() -> None:
    prefix = SPEC_HEADER + struct.pack("<I", 10)
    need = 52 + 10 + 52_184_460
    header, text_bytes = unpack_prefix(prefix, need)
    assert text_bytes == 10 and header == SPEC_FIELDS
    with pytest.raises(KvcFormatError, match="payload_bytes"):
        unpack_prefix(prefix, need - 1)
    with pytest.raises(KvcFormatError, match="text_bytes"):
        unpack_prefix(SPEC_HEADER + struct.pack("<I", 0xFFFFFFFF), need)
    with pytest.raises(KvcFormatError, match="fewer than 52"):
        unpack_prefix(prefix[:51], 51)
    # u64 payload length that would overflow a C u64 sum is still rejected, not wrapped
    huge = _with(prefix, 40, "<Q", 0xFFFFFFFFFFFFFFFF)
    with pytest.raises(KvcFormatError, match="payload_bytes"):
        unpack_prefix(huge, need)


def test_touched_increments_hits_and_sets_last_used() -> None:
    t = SPEC_FIELDS.touched(now=1767300000)
    assert (t.hits, t.last_used, t.created_at) == (1, 1767300000, 1767225600)


@pytest.mark.parametrize(
    "bad",
    [
        {"quant_bits": 3},
        {"tokens": 0},
        {"tokens": 2**32},
        {"hits": -1},
        {"reason": 256},
        {"created_at": 2**64},
    ],
)
def test_pack_refuses_unwritable_values(bad: dict) -> None:
    fields = {f: getattr(SPEC_FIELDS, f) for f in SPEC_FIELDS.__dataclass_fields__} | bad
    with pytest.raises(KvcFormatError):
        KvcHeader(**fields).pack()


headers = st.builds(
    KvcHeader,
    quant_bits=st.sampled_from([2, 4]),
    reason=st.integers(0, 6),
    ext_flags=st.integers(0, 255),
    tokens=st.integers(1, 2**32 - 1),
    hits=st.integers(0, 2**32 - 1),
    ctx_size=st.integers(0, 2**32 - 1),
    created_at=st.integers(0, 2**64 - 1),
    last_used=st.integers(0, 2**64 - 1),
    payload_bytes=st.integers(0, 2**64 - 1),
)


@given(headers)
def test_header_round_trip(header: KvcHeader) -> None:
    data = header.pack()
    assert len(data) == 48
    assert KvcHeader.unpack(data) == header
    assert KvcHeader.unpack(data).pack() == data
