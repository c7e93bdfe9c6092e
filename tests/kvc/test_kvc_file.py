"""Whole files: write/read round trips, atomic writes, modes, touch, trailer rewrite, temp cleanup."""

from __future__ import annotations

import dataclasses
import os
import stat
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4_vllm.kvc import (
    ExtFlag,
    KvcFormatError,
    LayerArrays,
    ModelDims,
    PayloadData,
    PayloadHeader,
    ToolMapEntry,
    checkpoint_file_size,
    checkpoint_name,
    clean_temp_files,
    compute_layout,
    default_counts,
    open_checkpoint,
    read_prefix,
    rewrite_tool_map,
    touch_checkpoint,
    write_checkpoint,
)
from tests.kvc.kvc_helpers import MICRO, new_header, random_payload, tool_entries

SECTIONS = ("raw", "comp", "state_kv", "state_score", "index_comp", "index_state_kv", "index_state_score")


def assert_same_payload(got, want: PayloadData) -> None:
    assert got.header == want.header
    assert list(got.n_comp) == list(want.n_comp) and list(got.n_index_comp) == list(want.n_index_comp)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.logits, want.logits)
    for g, w in zip(got.layers, want.layers, strict=True):
        for name in SECTIONS:
            if getattr(w, name) is None:
                assert getattr(g, name) is None
            else:
                np.testing.assert_array_equal(getattr(g, name), getattr(w, name))


@st.composite
def checkpoints(draw):
    dims = ModelDims(
        n_layer=draw(st.integers(1, 7)),
        head_dim=draw(st.integers(1, 12)),
        index_dim=draw(st.integers(1, 6)),
        n_vocab=draw(st.integers(1, 40)),
    )
    n_tokens = draw(st.integers(1, 300))
    ctx = draw(st.integers(1, 600))
    header = PayloadHeader.build(dims, ctx_size=ctx, n_tokens=n_tokens)
    if draw(st.booleans()):
        n_comp, n_index = default_counts(dims.n_layer, n_tokens)
        n_comp = [min(c, header.comp_cap) for c in n_comp]
        n_index = [min(c, header.comp_cap) for c in n_index]
    else:  # any counts the layout allows
        n_comp, n_index = [], []
        for il in range(dims.n_layer):
            r = 0 if il < 2 else (4 if il % 2 == 0 else 128)
            n_comp.append(draw(st.integers(0, min(header.comp_cap, 40))) if r else 0)
            n_index.append(draw(st.integers(0, min(header.comp_cap, 40))) if r == 4 else 0)
    seed = draw(st.integers(0, 2**32 - 1))
    text = draw(st.binary(max_size=200))
    n_tools = draw(st.sampled_from([0, 1, 2, 17]))
    return dims, n_tokens, ctx, (n_comp, n_index), seed, text, n_tools


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(checkpoints())
def test_round_trip_random_shapes(case) -> None:
    dims, n_tokens, ctx, counts, seed, text, n_tools = case
    rng = np.random.default_rng(seed)
    data = random_payload(dims, n_tokens, rng, ctx_size=ctx, counts=counts)
    tools = tool_entries(n_tools)
    header = new_header(n_tokens, ctx_size=ctx)
    with tempfile.TemporaryDirectory() as d:
        path = write_checkpoint(d, text, header, data, tools, fsync=False)
        assert path.name == checkpoint_name(text)
        raw = path.read_bytes()
        with open_checkpoint(path) as ck:
            assert ck.text == text
            assert ck.header == dataclasses.replace(
                header, payload_bytes=ck.header.payload_bytes, ext_flags=ExtFlag.TOOL_MAP if n_tools else 0
            )
            assert ck.file_size == checkpoint_file_size(
                len(text), ck.header.payload_bytes, ck.tool_map.nbytes
            )
            assert list(ck.tool_map.entries) == tools
            assert ck.trailing_bytes == 0
            assert_same_payload(ck.payload, data)
            again = write_checkpoint(
                Path(d) / "copy", ck.text, ck.header, ck.payload, ck.tool_map.entries, fsync=False
            )
            del ck
        assert again.read_bytes() == raw
        # raw payload bytes are accepted too (validated before writing)
        start = 52 + len(text)
        payload_raw = raw[start : start + int.from_bytes(raw[40:48], "little")]
        third = write_checkpoint(Path(d) / "raw", text, header, payload_raw, tools, fsync=False)
        assert third.read_bytes() == raw


def _write(tmp_path: Path, n_tokens: int = 9, text: bytes = b"hello", tools: int = 0) -> Path:
    data = random_payload(MICRO, n_tokens, np.random.default_rng(0), ctx_size=256)
    return write_checkpoint(tmp_path, text, new_header(n_tokens, ctx_size=256), data, tool_entries(tools))


def test_modes_and_directory_creation(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = _write(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_views_are_read_only_and_not_copies(tmp_path: Path) -> None:
    path = _write(tmp_path)
    with open_checkpoint(path) as ck:
        raw = ck.payload.layers[2].raw
        assert not raw.flags.writeable and not raw.flags.owndata
        with pytest.raises(ValueError):
            raw[0, 0] = 1.0
        base = raw
        while getattr(base, "base", None) is not None and isinstance(base, np.ndarray):
            base = base.base
        assert not isinstance(base, np.ndarray)  # the chain ends in the mmap, not a numpy copy


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    good = _write(tmp_path, text=b"keep")
    before = good.read_bytes()
    data = random_payload(MICRO, 9, np.random.default_rng(0), ctx_size=256)

    def layers(il: int) -> LayerArrays:
        if il == 3:
            raise RuntimeError("device copy failed")
        return data.layers[il]

    broken = PayloadData(data.header, data.tokens, data.logits, data.n_comp, data.n_index_comp, layers)
    with pytest.raises(RuntimeError):
        write_checkpoint(tmp_path, b"new", new_header(9, ctx_size=256), broken)
    # a bad layer shape is caught while streaming, too
    data.layers[4].raw = data.layers[4].raw[:, :2]
    with pytest.raises(KvcFormatError):
        write_checkpoint(tmp_path, b"new", new_header(9, ctx_size=256), data)
    assert sorted(p.name for p in tmp_path.iterdir()) == [good.name]
    assert good.read_bytes() == before


def test_header_tokens_must_match_payload(tmp_path: Path) -> None:
    data = random_payload(MICRO, 9, np.random.default_rng(0), ctx_size=256)
    with pytest.raises(KvcFormatError, match="n_tokens"):
        write_checkpoint(tmp_path, b"x", new_header(10, ctx_size=256), data)
    assert list(tmp_path.iterdir()) == []


def test_replaces_existing_file(tmp_path: Path) -> None:
    first = _write(tmp_path, n_tokens=9, text=b"same")
    second = _write(tmp_path, n_tokens=12, text=b"same")
    assert first == second
    assert read_prefix(second).header.tokens == 12


def test_name_check(tmp_path: Path) -> None:
    path = _write(tmp_path, text=b"abc")
    wrong = path.with_name("0" * 40 + ".kv")
    path.rename(wrong)
    with pytest.raises(KvcFormatError) as info:
        open_checkpoint(wrong)
    assert info.value.field == "file_name" and info.value.offset == 52
    with open_checkpoint(wrong, check_name=False) as ck:
        assert ck.name_matches is False
    other = wrong.with_name("sysprompt.kv")
    wrong.rename(other)
    with pytest.raises(KvcFormatError, match="40 hex"):
        open_checkpoint(other)
    with open_checkpoint(other, check_name=False) as ck:
        assert ck.name_matches is None


def test_touch_in_place(tmp_path: Path) -> None:
    path = _write(tmp_path, tools=2)
    before = path.read_bytes()
    new = touch_checkpoint(path, now=1_800_000_000)
    assert new.hits == 1 and new.last_used == 1_800_000_000
    after = path.read_bytes()
    assert after[48:] == before[48:] and after[:12] == before[:12] and after[16:32] == before[16:32]
    assert touch_checkpoint(path, now=1_800_000_001).hits == 2
    with open_checkpoint(path) as ck:
        assert (ck.header.hits, ck.header.last_used) == (2, 1_800_000_001)


def test_touch_zeroes_reserved_and_clamps_reason(tmp_path: Path) -> None:
    path = _write(tmp_path)
    buf = bytearray(path.read_bytes())
    buf[5], buf[7], buf[20] = 9, 0xAA, 0xBB
    path.write_bytes(bytes(buf))
    touch_checkpoint(path, now=5)
    out = path.read_bytes()
    assert out[5] == 0 and out[7] == 0 and out[20:24] == b"\0\0\0\0"


def test_touch_rejects_bad_header(tmp_path: Path) -> None:
    bad = tmp_path / ("1" * 40 + ".kv")
    bad.write_bytes(b"XYZ" + bytes(100))
    with pytest.raises(KvcFormatError, match="magic"):
        touch_checkpoint(bad)
    assert bad.read_bytes() == b"XYZ" + bytes(100)


def test_rewrite_tool_map(tmp_path: Path) -> None:
    path = _write(tmp_path, tools=3)
    created = read_prefix(path).header
    new = rewrite_tool_map(path, tool_entries(1), now=1_900_000_000)
    assert new.ext_flags & ExtFlag.TOOL_MAP and new.hits == created.hits and new.last_used == 1_900_000_000
    with open_checkpoint(path) as ck:
        assert list(ck.tool_map.entries) == tool_entries(1) and ck.trailing_bytes == 0
    plain = _write(tmp_path, text=b"plain")
    size = plain.stat().st_size
    rewrite_tool_map(plain, [ToolMapEntry(b"id", b"block")], now=1)
    with open_checkpoint(plain) as ck:
        assert ck.tool_map.ids == ["id"] and ck.header.ext_flags == ExtFlag.TOOL_MAP
    assert plain.stat().st_size == size + 8 + 8 + 2 + 5
    # an empty map leaves the file alone, as ds4 does
    before = plain.read_bytes()
    rewrite_tool_map(plain, [])
    assert plain.read_bytes() == before


def test_bit0_without_trailer_means_no_entries(tmp_path: Path) -> None:
    path = _write(tmp_path, tools=0)
    buf = bytearray(path.read_bytes())
    buf[6] |= 1
    path.write_bytes(bytes(buf))
    with open_checkpoint(path) as ck:
        assert ck.tool_map.entries == () and not ck.tool_map.present and ck.trailing_bytes == 0


def test_trailing_bytes_are_reported_not_fatal(tmp_path: Path) -> None:
    path = _write(tmp_path)
    with open(path, "ab") as fp:
        fp.write(b"junk")
    with open_checkpoint(path) as ck:
        assert ck.trailing_bytes == 4


def test_clean_temp_files(tmp_path: Path) -> None:
    keep = _write(tmp_path)
    sha = "a" * 40
    dead = tmp_path / f"{sha}.kv.tmp.999999999"
    ours = tmp_path / f"{sha}.kv.tmp.{os.getpid()}.abcd1234"
    old_ours = tmp_path / f"{'b' * 40}.kv.tmp.{os.getpid()}"
    other = tmp_path / "notes.kv.tmp.1"
    for p in (dead, ours, old_ours, other):
        p.write_bytes(b"partial")
    now = time.time()
    os.utime(dead, (now - 60, now - 60))
    os.utime(old_ours, (now - 7200, now - 7200))
    assert sorted(clean_temp_files(tmp_path, dry_run=True)) == sorted([dead, old_ours])
    assert dead.exists()
    assert sorted(clean_temp_files(tmp_path)) == sorted([dead, old_ours])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([keep.name, ours.name, other.name])
    assert clean_temp_files(tmp_path / "missing") == []


def test_streaming_memory(tmp_path: Path) -> None:
    """A ~32 MB checkpoint is written from a per-layer callable and read through views
    without the process ever holding a copy of the payload."""
    dims = ModelDims(n_layer=12, head_dim=512, index_dim=128, n_vocab=1000)
    n_tokens = 8192
    header = PayloadHeader.build(dims, ctx_size=16384, n_tokens=n_tokens)
    n_comp, n_index = default_counts(dims.n_layer, n_tokens)
    layout = compute_layout(header, n_comp, n_index)
    largest_layer = max(sum(s.nbytes for s in lay.sections) for lay in layout.layers)
    assert layout.total_bytes > 30 * 2**20

    def layer(il: int) -> LayerArrays:
        lay = layout.layers[il]
        return LayerArrays(**{s.name: np.full(s.shape, il, np.float32) for s in lay.sections})

    data = PayloadData(
        header, np.arange(n_tokens, dtype=np.uint32), np.zeros(1000, np.float32), n_comp, n_index, layer
    )
    tracemalloc.start()
    try:
        path = write_checkpoint(tmp_path, b"big", new_header(n_tokens, ctx_size=16384), data, fsync=False)
        _, peak_write = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with open_checkpoint(path) as ck:
            total = 0.0
            for il, lay in enumerate(ck.payload.layers):
                total += float(lay.raw[0, 0]) + (float(lay.comp[-1, -1]) if lay.comp is not None else il)
            _, peak_read = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == sum(2 * il for il in range(12))
    assert peak_write < 2.5 * largest_layer < layout.total_bytes / 2
    assert peak_read < 2 * 2**20
