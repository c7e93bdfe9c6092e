"""Directory index: scan, refresh, longest-prefix lookup with ds4's filters, miss explanations."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from kvc_helpers import MICRO, random_payload

from ds4_vllm.kvc import CheckpointIndex, KvcHeader, SaveReason, touch_checkpoint, write_checkpoint

PROMPT = b"<|begin|>system: be brief<|User|>hello there, how are you today?<|Assistant|>"


def store(d: Path, text: bytes, tokens: int, *, quant: int = 2, ctx: int = 4096) -> Path:
    data = random_payload(MICRO, tokens, np.random.default_rng(tokens), ctx_size=ctx)
    header = KvcHeader.new(quant_bits=quant, reason=SaveReason.COLD, tokens=tokens, ctx_size=ctx, now=1000)
    return write_checkpoint(d, text, header, data, fsync=False)


def index_of(d: Path) -> CheckpointIndex:
    idx = CheckpointIndex(d)
    idx.refresh()
    return idx


def test_longest_match_among_many(tmp_path: Path) -> None:
    for n in range(0, len(PROMPT) + 1, 3):
        store(tmp_path, PROMPT[:n], tokens=n + 1)
    store(tmp_path, PROMPT[:20] + b"X", tokens=50)  # diverges: never a prefix
    store(tmp_path, PROMPT + b"more", tokens=70)  # longer than the prompt
    idx = index_of(tmp_path)
    res = idx.lookup(PROMPT)
    best = max(n for n in range(0, len(PROMPT) + 1, 3))
    assert res.hit is not None and res.hit.text_bytes == best
    assert res.skipped == {"text_longer_than_prompt": 1}
    assert res.hashed_lengths == len({*range(0, len(PROMPT) + 1, 3), 21})
    assert res.describe().startswith("hit ")
    short = idx.lookup(PROMPT[:10])
    assert short.hit is not None and short.hit.text_bytes == 9


def test_ties_go_to_more_tokens() -> None:
    # Same text length can only be the same file, so exercise the rule on in-memory entries.
    from ds4_vllm.kvc.index import IndexEntry

    base = KvcHeader.new(quant_bits=2, reason=1, tokens=5, ctx_size=10, now=1)
    idx = CheckpointIndex("/nonexistent")
    sha = hashlib.sha1(b"abc").hexdigest()
    for name, tokens in (("A", 5), ("B", 9), ("C", 7)):
        p = Path(f"/x/{name}/{sha}.kv")
        idx._entries[p] = IndexEntry(p, sha, dataclasses.replace(base, tokens=tokens), 3, 100, 0, b"abc")
    assert idx.lookup(b"abcdef").hit.header.tokens == 9


def test_filters(tmp_path: Path) -> None:
    small = store(tmp_path, PROMPT[:30], tokens=10)
    big_ctx = store(tmp_path, PROMPT[:40], tokens=600, ctx=8192)
    q4 = store(tmp_path, PROMPT[:50], tokens=700, quant=4)
    idx = index_of(tmp_path)
    assert idx.lookup(PROMPT).hit.path == q4
    assert idx.lookup(PROMPT, quant_bits=4, reject_different_quant=True).hit.path == q4
    res = idx.lookup(PROMPT, quant_bits=2, reject_different_quant=True, ctx_size=4096)
    assert res.hit.path == small
    assert res.skipped == {"quant_mismatch": 1, "ctx_too_large": 1}
    assert idx.lookup(PROMPT, quant_bits=2, reject_different_quant=True).hit.path == big_ctx
    miss = idx.lookup(PROMPT, min_tokens=512, ctx_size=4096, quant_bits=2, reject_different_quant=True)
    assert miss.hit is None
    assert miss.skipped == {"below_min_tokens": 1, "ctx_too_large": 1, "quant_mismatch": 1}
    assert miss.nearest is not None and miss.nearest.path == q4
    assert "quant" in miss.nearest_skip and "was skipped" in miss.describe()
    # ctx filter is inclusive: ctx_size equal to the current ctx is fine
    assert idx.lookup(PROMPT, ctx_size=8192, quant_bits=2, reject_different_quant=True).hit.path == big_ctx


def test_miss_explains_divergence(tmp_path: Path) -> None:
    other = PROMPT[:33] + b"Z" + PROMPT[34:60]
    near = store(tmp_path, other, tokens=5)
    store(tmp_path, b"totally different", tokens=5)
    res = index_of(tmp_path).lookup(PROMPT)
    assert res.hit is None and res.nearest.path == near and res.diverge_at == 33
    assert "text diverges at byte 33 from the nearest entry" in res.describe()
    empty = CheckpointIndex(tmp_path / "nothing")
    empty.refresh()
    assert "no usable entry" in empty.lookup(PROMPT).describe()


def test_refresh_rereads_only_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = store(tmp_path, b"alpha", tokens=3)
    b = store(tmp_path, b"beta", tokens=4)
    (tmp_path / "sysprompt.kv").write_bytes(b"ignored")
    (tmp_path / f"{'c' * 40}.kv.tmp.1").write_bytes(b"ignored")
    bad = tmp_path / ("d" * 40 + ".kv")
    bad.write_bytes(b"KVC\x01" + bytes(60))
    idx = CheckpointIndex(tmp_path)
    stats = idx.refresh()
    assert (stats.added, stats.invalid, len(idx)) == (3, 1, 2)
    assert "tokens" in idx.invalid[bad] or "quant" in idx.invalid[bad]
    assert idx.total_bytes == a.stat().st_size + b.stat().st_size

    reads = []
    import ds4_vllm.kvc.index as index_mod

    real = index_mod.read_prefix
    monkeypatch.setattr(index_mod, "read_prefix", lambda p, **kw: reads.append(Path(p).name) or real(p, **kw))
    assert idx.refresh() == type(stats)()
    assert reads == []
    touch_checkpoint(b, now=2000)
    os.utime(b, ns=(b.stat().st_atime_ns, b.stat().st_mtime_ns + 10**9))
    c = store(tmp_path, b"gamma", tokens=5)
    a.unlink()
    stats = idx.refresh()
    assert (stats.added, stats.changed, stats.removed) == (1, 1, 1)
    assert sorted(reads) == sorted([b.name, c.name])
    assert idx.get(b.name[:40]).header.hits == 1
    assert {e.path for e in idx.entries} == {b, c}


def test_misnamed_file_is_invalid(tmp_path: Path) -> None:
    p = store(tmp_path, b"text", tokens=3)
    p.rename(tmp_path / ("e" * 40 + ".kv"))
    idx = index_of(tmp_path)
    assert len(idx) == 0 and "SHA-1" in next(iter(idx.invalid.values()))


def test_lookup_scales_with_distinct_lengths(tmp_path: Path) -> None:
    """Thousands of entries at a few lengths: one hashing pass, snapshots per distinct length."""
    from ds4_vllm.kvc.index import IndexEntry

    idx = CheckpointIndex(tmp_path)
    prompt = bytes(range(256)) * 400
    header = KvcHeader.new(quant_bits=2, reason=1, tokens=5, ctx_size=10, now=1)
    for i in range(5000):
        text = prompt[: 1000 * (i % 50)] + (b"" if i % 2 else b"#")
        p = tmp_path / f"{i:040x}.kv"
        idx._entries[p] = IndexEntry(p, hashlib.sha1(text).hexdigest(), header, len(text), 1, 0, None)
    res = idx.lookup(prompt)
    assert res.hit is not None and res.hit.text_bytes == 49_000
    assert res.hashed_lengths <= 100
