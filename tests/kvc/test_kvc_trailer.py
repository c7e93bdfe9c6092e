"""KTM trailer: golden bytes from spec §4, strict vs ds4-lenient parsing, round trip."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds4_vllm.kvc import KvcFormatError, ToolMapEntry
from ds4_vllm.kvc.trailer import pack_tool_map, parse_tool_map, tool_map_size

ID = b"call_0123456789abcdef0123456789abcdef"
DSML = b'\n\n<tool_calls>\n<invoke name="f"></invoke></tool_calls>'


def golden_one_entry() -> bytes:
    # "KTM", version 1, N=1, then id_len, dsml_len, id, dsml (spec §4), built by hand.
    return (
        b"\x4b\x54\x4d\x01"
        + b"\x01\x00\x00\x00"
        + len(ID).to_bytes(4, "little")
        + len(DSML).to_bytes(4, "little")
        + ID
        + DSML
    )


def test_pack_golden() -> None:
    assert pack_tool_map([ToolMapEntry(ID, DSML)]) == golden_one_entry()
    assert tool_map_size([ToolMapEntry(ID, DSML)]) == 8 + 8 + len(ID) + len(DSML)


def test_empty_map_writes_nothing() -> None:
    assert pack_tool_map([]) == b""
    assert tool_map_size([]) == 0


def test_parse_golden_and_eof_means_no_entries() -> None:
    data = b"PAD" + golden_one_entry()
    tm = parse_tool_map(data, 3, len(data))
    assert tm.present and tm.entries == (ToolMapEntry(ID, DSML),) and tm.nbytes == len(data) - 3
    assert tm.ids == [ID.decode()]
    empty = parse_tool_map(data, len(data), len(data))
    assert not empty.present and empty.entries == ()


def test_zero_count_header_is_legal() -> None:
    data = b"KTM\x01" + struct.pack("<I", 0)
    tm = parse_tool_map(data, 0, len(data))
    assert tm.present and tm.entries == ()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"KTM\x01\x01", "ktm.header"),
        (b"KTX\x01" + struct.pack("<I", 1), "ktm.magic"),
        (b"KTM\x02" + struct.pack("<I", 1), "ktm.version"),
        (b"KTM\x01" + struct.pack("<I", 400_001), "ktm.count"),
        (b"KTM\x01" + struct.pack("<III", 1, 0, 5) + b"abcde", "ktm.entry[0].id_len"),
        (b"KTM\x01" + struct.pack("<III", 1, 257, 5) + b"x" * 10, "ktm.entry[0].id_len"),
        (b"KTM\x01" + struct.pack("<III", 1, 3, 0) + b"abc", "ktm.entry[0].dsml_len"),
        (b"KTM\x01" + struct.pack("<III", 1, 3, 9) + b"abcdef", "ktm.entry[0]"),
    ],
)
def test_strict_rejects_lenient_ignores(data: bytes, field: str) -> None:
    with pytest.raises(KvcFormatError) as info:
        parse_tool_map(data, 0, len(data), path="f.kv")
    assert info.value.field == field
    assert parse_tool_map(data, 0, len(data), strict=False).entries == ()


def test_lenient_keeps_entries_before_a_bad_one() -> None:
    good = ToolMapEntry(ID, DSML)
    data = pack_tool_map([good, good])
    data = data[:8].replace(b"\x02\x00\x00\x00", b"\x03\x00\x00\x00") + data[8:]
    assert parse_tool_map(data, 0, len(data), strict=False).entries == (good, good)
    with pytest.raises(KvcFormatError, match=r"ktm\.count|ktm\.entry\[2\]"):
        parse_tool_map(data, 0, len(data))


def test_writer_refuses_entries_the_reader_would_drop() -> None:
    with pytest.raises(KvcFormatError, match="id_len"):
        pack_tool_map([ToolMapEntry(b"", DSML)])
    with pytest.raises(KvcFormatError, match="id_len"):
        pack_tool_map([ToolMapEntry(b"x" * 257, DSML)])
    with pytest.raises(KvcFormatError, match="dsml_len"):
        pack_tool_map([ToolMapEntry(ID, b"")])


entries = st.lists(
    st.builds(ToolMapEntry, st.binary(min_size=1, max_size=256), st.binary(min_size=1, max_size=300)),
    max_size=40,
)


@given(entries, st.binary(max_size=20))
def test_round_trip(items: list[ToolMapEntry], prefix: bytes) -> None:
    data = prefix + pack_tool_map(items)
    tm = parse_tool_map(data, len(prefix), len(data))
    assert list(tm.entries) == items
    assert tm.nbytes == tool_map_size(items)
