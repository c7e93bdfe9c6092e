"""Exact-replay tool memory: bounded id -> DSML map, derived ids, KTM scan and reload."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ds4_vllm.kvc import ToolMapEntry, open_checkpoint, write_checkpoint
from ds4_vllm.store.local_fs import LocalFS
from ds4_vllm.store.tool_memory import (
    ToolMemory,
    find_tool_blocks,
    new_seed,
    random_tool_id,
    tool_call_id,
    tool_map_for_text,
)
from ds4_vllm.store.trailers import read_tool_map
from tests.shared_data import ENGINE_TESTDATA, require
from tests.store.store_helpers import header, payload, toks

ENGINE_FILES = ENGINE_TESTDATA
BLOCK_A = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="a">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
BLOCK_B = '<｜DSML｜tool_calls><｜DSML｜invoke name="b"></｜DSML｜invoke></｜DSML｜tool_calls>'


def test_cap_drops_the_least_recently_used_first() -> None:
    memory = ToolMemory(max_ids=3)
    for i in range(3):
        memory.remember(f"call_{i}", BLOCK_A if i % 2 else BLOCK_B)
    assert memory.lookup("call_0") == BLOCK_B  # a use: call_0 is now the most recent
    memory.remember("call_3", BLOCK_A)
    assert memory.ids() == ["call_2", "call_0", "call_3"]  # call_1 was the oldest
    assert memory.lookup("call_1") is None
    memory.remember("call_4", BLOCK_B)
    assert memory.ids() == ["call_0", "call_3", "call_4"] and len(memory) == 3
    assert memory.nbytes == len(BLOCK_A.encode()) + len(BLOCK_B.encode())  # a shared block counts once


def test_byte_cap_and_refusals() -> None:
    memory = ToolMemory(max_ids=10, max_bytes=len(BLOCK_A.encode()) + 10)
    memory.remember("x", BLOCK_A)
    memory.remember("y", BLOCK_B)  # both would exceed the byte cap: the older goes
    assert memory.ids() == ["y"]
    memory.remember("", BLOCK_A)
    memory.remember("z" * 257, BLOCK_A)  # longer than a KTM id may be
    memory.remember("w", "")
    assert memory.ids() == ["y"]
    with pytest.raises(
        ValueError, match=re.escape("--tool-memory-max-ids / tool_memory_max_ids: must be >= 1")
    ):
        ToolMemory(max_ids=0)


def test_only_the_exact_id_matches() -> None:
    memory = ToolMemory()
    tool_id = tool_call_id(new_seed(), BLOCK_A, 0)
    memory.remember(tool_id, BLOCK_A)
    assert memory.lookup(tool_id) == BLOCK_A
    for other in (tool_id.upper(), tool_id[:-1], tool_id + " ", " " + tool_id, tool_id[:5], "call_"):
        assert memory.lookup(other) is None, other


def test_ids_are_derived_unguessable_and_distinct() -> None:
    seed = new_seed()
    assert re.fullmatch("[0-9a-f]{32}", seed)
    first = tool_call_id(seed, BLOCK_A, 0)
    assert re.fullmatch("call_[0-9a-f]{32}", first)
    assert tool_call_id(seed, BLOCK_A.encode(), 0) == first  # both processes derive the same id
    assert re.fullmatch("toolu_[0-9a-f]{32}", tool_call_id(seed, BLOCK_A, 0, "toolu_"))
    others = {
        tool_call_id(seed, BLOCK_A, 1),
        tool_call_id(seed, BLOCK_B, 0),
        tool_call_id(new_seed(), BLOCK_A, 0),
    }
    assert first not in others and len(others) == 3
    ids = {random_tool_id() for _ in range(2000)} | {
        tool_call_id(new_seed(), BLOCK_A, 0) for _ in range(2000)
    }
    assert len(ids) == 4000
    # 128 random bits each: every hex digit position takes many values across ids
    assert all(len({i[5 + k] for i in ids}) == 16 for k in range(32))


def test_every_id_bit_is_a_fair_coin() -> None:
    """Issue 12: ids cannot be guessed. Over 20,000 ids from fresh seeds (one per request, as the
    server makes them) and 20,000 seedless ids, each of the 128 bits is set in 50% of ids within
    5 standard deviations (sd = sqrt(0.25 / 20000) = 0.0035, so +-0.018): a counter, a clock or
    a short seed would fail this; `secrets` (the OS CSPRNG) passes. Measured in one run: shares 0.4897-0.5117."""
    n = 20_000
    for ids in (
        [tool_call_id(new_seed(), BLOCK_A, 0) for _ in range(n)],
        [random_tool_id() for _ in range(n)],
    ):
        assert len(set(ids)) == n and all(len(i) == len("call_") + 32 for i in ids)
        values = [int(i[5:], 16) for i in ids]
        for bit in range(128):
            share = sum((v >> bit) & 1 for v in values) / n
            assert abs(share - 0.5) < 5 * (0.25 / n) ** 0.5, (bit, share)


def test_writer_scan_finds_blocks_like_the_engine() -> None:
    text = ("x" + BLOCK_A + " y <tool_calls>z</tool_calls>" + BLOCK_B + "<｜DSML｜tool_calls>open").encode()
    spans = find_tool_blocks(text)
    assert [text[s:e] for s, e in spans] == [
        BLOCK_A.encode(),
        b"<tool_calls>z</tool_calls>",
        BLOCK_B.encode(),
    ]
    # an id is written only for a block that appears in the text, and each block once
    text2 = text + BLOCK_A.encode()
    entries = tool_map_for_text(text2, {BLOCK_A.encode(): ["a1", "a2"], b"unrelated": ["u"]})
    assert entries == [ToolMapEntry(b"a1", BLOCK_A.encode()), ToolMapEntry(b"a2", BLOCK_A.encode())]


def test_engine_files_trailers_are_read_and_rewritten_identically() -> None:
    require(ENGINE_FILES, "the ds4 engine's test files")
    files = [p for p in sorted(ENGINE_FILES.glob("*/*.kv")) if read_tool_map(p)]
    assert files, "the engine test files hold no KTM trailer"
    for path in files:
        with open_checkpoint(path) as ck:
            by_block: dict[bytes, list[str]] = {}
            for entry in ck.tool_map.entries:
                by_block.setdefault(entry.dsml, []).append(entry.tool_id.decode())
            assert tool_map_for_text(ck.text, by_block) == list(ck.tool_map.entries), path
            assert read_tool_map(path) == [(e.tool_id.decode(), e.dsml.decode()) for e in ck.tool_map.entries]


def _put(directory: Path, text: str, entries: list[tuple[str, str]], start: int = 0) -> Path:
    tokens = toks(8, start)
    tool_map = [ToolMapEntry(i.encode(), d.encode()) for i, d in entries]
    return write_checkpoint(
        directory, text.encode(), header(len(tokens)), payload(tokens), tool_map, fsync=False
    )


def test_directory_reload_and_per_request_restore(tmp_path: Path) -> None:
    one = _put(tmp_path, "one" + BLOCK_A, [("call_a1", BLOCK_A), ("call_a2", BLOCK_A)])
    _put(tmp_path, "two" + BLOCK_B, [("call_b", BLOCK_B)], start=9)
    (tmp_path / "junk.kv").write_bytes(b"not a checkpoint")
    memory = ToolMemory(checkpoints=LocalFS(tmp_path))
    assert memory.load_directory() == 3
    assert (memory.lookup("call_a2"), memory.lookup("call_b")) == (BLOCK_A, BLOCK_B)
    assert memory.load_directory() == 0  # files already read are not read again

    # another server sharing the directory writes a new file: a request naming an unknown id reads it
    other = ToolMemory(checkpoints=LocalFS(tmp_path))
    _put(tmp_path, "three" + BLOCK_B, [("call_c", BLOCK_B), ("call_d", BLOCK_B)], start=20)
    assert memory.restore(["call_a1", "call_b"]) == 0  # all known: the directory is not read
    assert memory.lookup("call_c") is None
    assert memory.restore(["call_a1", "call_c"]) == 2
    assert (memory.lookup("call_c"), memory.lookup("call_d")) == (BLOCK_B, BLOCK_B)
    assert memory.restore(["call_unknown"]) == 0  # nothing new to read
    assert other.load_directory() == 5

    # a corrupt trailer is ignored (ds4's reader), never an error
    shutil.copy(one, tmp_path / "copy.kv")
    data = bytearray((tmp_path / "copy.kv").read_bytes())
    trailer_at = data.rfind(b"KTM")
    data[trailer_at] = ord("X")
    (tmp_path / "copy.kv").write_bytes(bytes(data))
    assert read_tool_map(tmp_path / "copy.kv") == []


def test_the_engines_tool_ids_reload_from_an_s3_store_as_from_a_local_directory() -> None:
    """Issue 20: tool ids were reloaded only from local directories. The engine's own q2 files,
    uploaded to an S3-compatible server (moto on loopback) with s3fs as a user would, give the
    same ids and blocks through the store's filesystem layer; a file another server writes later
    is read on the request that names its id; a corrupt trailer is skipped."""
    import s3fs

    from ds4_vllm.store.object_fs import FsspecFS
    from tests.store.s3_server import moto_s3, new_bucket_url

    require(ENGINE_FILES / "q2", "the ds4 engine's test files")
    local = ToolMemory(checkpoints=LocalFS(ENGINE_FILES / "q2"))
    assert local.load_directory() == 10  # R1..R5 of the engine's run carried tool calls
    with moto_s3():
        url = new_bucket_url()
        bucket = s3fs.S3FileSystem(skip_instance_cache=True)
        for f in sorted((ENGINE_FILES / "q2").glob("*.kv")):
            bucket.put_file(str(f), f"{url.removeprefix('s3://')}/{f.name}")
        store = FsspecFS(url, skip_instance_cache=True)
        remote = ToolMemory(checkpoints=store)
        assert remote.load_directory() == 10
        assert {i: remote.peek(i) for i in remote.ids()} == {i: local.peek(i) for i in local.ids()}
        assert remote.load_directory() == 0  # listed stamps unchanged: nothing is read again

        tokens = toks(8, 40)
        text = ("four" + BLOCK_B).encode()
        store.write(text, header(len(tokens)), payload(tokens), [ToolMapEntry(b"call_new", BLOCK_B.encode())])
        assert remote.restore(["call_new"]) == 1 and remote.lookup("call_new") == BLOCK_B

        corrupt = bytearray(
            (ENGINE_FILES / "q2" / "2b43d1f7f98c90d5bae42da6047821c00bd0a972.kv").read_bytes()
        )
        corrupt[corrupt.rfind(b"KTM")] = ord("X")
        name = "2b43d1f7f98c90d5bae42da6047821c00bd0a972.kv"
        bucket.pipe_file(f"{url.removeprefix('s3://')}/{name}", bytes(corrupt))
        assert store.read_tool_map(f"{url.removeprefix('s3://')}/{name}", 1 << 20) == []
        # The engine's 10 entries less the corrupt file's one, plus the new file's one.
        assert ToolMemory(checkpoints=store).load_directory() == 10 - 1 + 1
