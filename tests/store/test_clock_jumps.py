"""Issue 12: the clock jumps. Last-used times in the future or zero, in headers and file times.

The store takes "last used" from the KVC header (`created_at`, `last_used`, which eviction
decays hits by) and notices directory changes by mtimes. Both are set here to the far future and
to zero, and the store's own clock is jumped both ways: eviction still brings the directory
within budget, lookups still find and verify the right file, and nothing raises.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ds4_vllm.kvc import touch_checkpoint, write_checkpoint
from ds4_vllm.store import CheckpointStore, CheckpointWriter
from tests.store.store_helpers import NOW, WIDE, header, opts, payload, text_of, toks

pytestmark = pytest.mark.reliability

FUTURE = NOW + 10 * 365 * 86400  # ten years ahead


def write_files(directory: Path, stamps: list[int]) -> list[tuple[list[int], Path]]:
    """One ~200 KB checkpoint per stamp: header created_at = last_used = stamp, file times too."""
    files = []
    for i, stamp in enumerate(stamps):
        tokens = toks(30 + i, start=9 * i)
        path = write_checkpoint(
            directory,
            text_of(tokens),
            header(len(tokens), now=stamp),
            payload(tokens, dims=WIDE, seed=i),
            fsync=False,
        )
        touch_checkpoint(path, now=stamp, hits=i % 3)  # some hits, used "at" the stamp
        os.utime(path, (stamp, stamp))
        files.append((tokens, path))
    return files


@pytest.mark.parametrize(
    "store_now", [0, NOW, FUTURE * 2], ids=["clock-zero", "clock-now", "clock-far-future"]
)
def test_future_and_zero_last_used_times_evict_and_load(tmp_path, store_now):
    stamps = [FUTURE, 0, NOW, FUTURE, 0, NOW, 0, FUTURE]
    files = write_files(tmp_path, stamps)
    budget = 1 << 20  # 1 MiB: about four of the eight files
    store = CheckpointStore(
        opts(tmp_path, disk_space_mb=1), clock=lambda: store_now, model_dims=WIDE, fsync=False
    ).open()
    kept = store.entries()
    assert 0 < len(kept) < len(files)
    assert sum(e.file_size for e in kept) <= budget
    writer = CheckpointWriter(store.fs, WIDE)
    by_path = {str(p): t for t, p in files}
    for entry in kept:
        tokens = by_path[str(entry.path)]
        prompt = tokens + [61, 62]
        outcome = store.lookup(text_of(prompt), prompt, None, 2)
        assert outcome.hit and outcome.path == str(entry.path)
        with writer.open_verified(outcome) as ck:
            assert [int(t) for t in ck.payload.tokens] == tokens
        from ds4_vllm.store import LoadReport

        store.finish_load(outcome, LoadReport(outcome.path, True))
        assert store.fs.read_header(outcome.path).last_used == int(store_now)
    # A new save under the same pressure still evicts what the budget needs.
    new = toks(40, start=3)
    result = store.store(text_of(new), header(40, now=int(store_now)), payload(new, dims=WIDE, seed=99))
    assert result.stored, result.reason
    assert sum(e.file_size for e in store.entries()) <= budget


def test_temp_file_with_a_future_or_zero_time_does_not_break_the_start(tmp_path):
    """A temp file dated in the future is young (kept); one dated 1970 is stale (removed)."""
    live = tmp_path / f"{'a' * 40}.kv.tmp.{os.getpid()}.future"
    stale = tmp_path / f"{'b' * 40}.kv.tmp.{os.getpid()}.zero"
    for path, stamp in ((live, FUTURE), (stale, 0)):
        path.write_bytes(b"partial")
        os.utime(path, (stamp, stamp))
    CheckpointStore(opts(tmp_path), fsync=False).open()
    assert live.exists() and not stale.exists()
