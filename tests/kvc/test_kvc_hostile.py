"""Crafted hostile files at the kvc level: each is rejected naming the lying field, through every
entry point (bytes, mmap'ed file, `ds4-kv verify`), and the lenient KTM reader keeps what is sound.

The cases themselves live in tests/fuzz/crafted.py (shared with the store tests). The proof that
no case allocates memory in proportion to what it claims is in tests/store/test_store_hostile.py
(run under an address-space limit), together with links, names and neighbouring entries.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ds4_vllm.cli.kv import verify_file
from ds4_vllm.kvc import KvcFormatError, open_checkpoint, parse_checkpoint, read_prefix, touch_checkpoint
from tests.fuzz.crafted import TOOL_ENTRIES, Crafted, base_file, crafted_files

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return base_file(str(tmp_path_factory.mktemp("base")))


def _cases() -> list[Crafted]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return crafted_files(base_file(d))


CASES = _cases()


def test_base_file_is_valid_and_keeps_hostile_ids_as_bytes(base: bytes) -> None:
    with parse_checkpoint(base) as ck:
        assert ck.tool_map.entries == TOOL_ENTRIES  # NUL and "../" kept exactly, never interpreted
        assert ck.trailing_bytes == 0


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_crafted_file_rejected_naming_the_field(case: Crafted, tmp_path: Path) -> None:
    with pytest.raises(KvcFormatError) as info:
        parse_checkpoint(case.data)
    assert info.value.field == case.field and case.says in info.value.reason, str(info.value)
    assert info.value.offset is None or 0 <= info.value.offset < len(case.data)

    path = tmp_path / case.file_name
    path.write_bytes(case.data)
    with pytest.raises(KvcFormatError) as info:
        open_checkpoint(path)
    assert info.value.field == case.field and info.value.path == str(path)
    assert case.field in (verify_file(path) or "")


@pytest.mark.parametrize("case", [c for c in CASES if c.field.startswith("ktm")], ids=lambda c: c.name)
def test_lenient_trailer_reader_keeps_the_sound_entries(case: Crafted) -> None:
    """ds4's reader (strict_trailer=False) ignores a bad trailer or stops at a bad entry."""
    with parse_checkpoint(case.data, strict_trailer=False) as ck:
        kept = ck.tool_map.entries
    assert kept == TOOL_ENTRIES[: len(kept)]
    # A count above the 400k limit drops the trailer; a count the bytes cannot hold reads the
    # entries that are there (ds4 stops at the truncated third); a bad entry keeps those before it.
    expected = {"ktm_count_400k_in_60_bytes": 2, "ktm_second_entry_past_end": 1}
    assert len(kept) == expected.get(case.name, 0)


def test_header_only_readers_stop_at_the_prefix(tmp_path: Path) -> None:
    """Scans and touches read 52 bytes + text: the prefix lies are caught there, payload lies are not theirs."""
    by_name = {c.name: c for c in CASES}
    for name, field in (
        ("text_len_past_end", "text_bytes"),
        ("payload_bytes_u64_max", "header.payload_bytes"),
    ):
        path = tmp_path / by_name[name].file_name
        path.write_bytes(by_name[name].data)
        for call in (read_prefix, touch_checkpoint):
            with pytest.raises(KvcFormatError) as info:
                call(path)
            assert info.value.field == field
        assert path.read_bytes() == by_name[name].data  # a rejected touch wrote nothing


def test_links_and_fifos_are_refused_when_not_followed(tmp_path: Path, base: bytes) -> None:
    outside = tmp_path / "outside.kv"
    outside.write_bytes(base)
    link = tmp_path / "link.kv"
    link.symlink_to(outside)
    fifo = tmp_path / "fifo.kv"
    os.mkfifo(fifo)
    for call in (
        lambda p: open_checkpoint(p, check_name=False, follow_symlinks=False),
        lambda p: read_prefix(p, follow_symlinks=False),
        lambda p: touch_checkpoint(p, follow_symlinks=False),
    ):
        with pytest.raises(KvcFormatError) as info:
            call(link)
        assert info.value.field == "file_type" and "symbolic link" in info.value.reason
        # A FIFO is refused at once: a plain open would block until a writer came (a hung server).
        with pytest.raises(KvcFormatError) as info:
            call(fifo)
        assert info.value.field == "file_type" and "FIFO" in info.value.reason
    assert outside.read_bytes() == base and stat.S_ISFIFO(fifo.lstat().st_mode)
    # Following is still the default for tools given an explicit path (ds4-kv inspect LINK).
    with open_checkpoint(link, check_name=False) as ck:
        assert ck.header.tokens == 9
