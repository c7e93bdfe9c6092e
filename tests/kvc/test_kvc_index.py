"""Directory index: scan, refresh, longest-prefix lookup with ds4's filters, miss explanations."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ds4_vllm.kvc import CheckpointIndex, KvcHeader, SaveReason, touch_checkpoint, write_checkpoint
from tests.kvc.kvc_helpers import MICRO, random_payload

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


# ---------------------------------------------------------------- lookup against a brute-force reference

FILTER_PREFIX = ("text_longer_than_prompt", "below_min_tokens", "ctx_too_large", "quant_mismatch")


def reference_lookup(
    entries: list, prompt: bytes, min_tokens: int, ctx: int | None, quant: int | None, reject: bool
):
    """The definition, spelled out over every entry in index order: (hit, nearest, diverge_at, skip, skipped)."""

    def skip(e) -> str | None:
        h = e.header
        if e.text_bytes > len(prompt):
            return "text_longer_than_prompt"
        if h.tokens < min_tokens:
            return "below_min_tokens"
        if ctx is not None and h.ctx_size > ctx:
            return "ctx_too_large"
        if reject and quant is not None and h.quant_bits != quant:
            return "quant_mismatch"
        return None

    skipped: dict[str, int] = {}
    hit, hit_rank = None, None
    for order, e in enumerate(entries):
        why = skip(e)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        # Matched by name: the SHA-1 of the prompt's first text_bytes bytes is the entry's.
        if hashlib.sha1(prompt[: e.text_bytes]).hexdigest() != e.sha1:
            continue
        rank = (e.text_bytes, e.header.tokens, -order)
        if hit_rank is None or rank > hit_rank:
            hit, hit_rank = e, rank
    candidates = sum(1 for e in entries if skip(e) is None)
    lengths = len({e.text_bytes for e in entries if skip(e) is None})
    if hit is not None:
        return hit, None, None, None, skipped, candidates, lengths
    nearest, near_rank = None, None
    for order, e in enumerate(entries):
        if e.text is None:
            continue
        common = len(os.path.commonprefix([prompt, e.text]))
        rank = (common, common == e.text_bytes, e.header.tokens, -order)
        if near_rank is None or rank > near_rank:
            nearest, near_rank = e, rank
    if nearest is None:
        return None, None, None, None, skipped, candidates, lengths
    why = skip(nearest) if near_rank[1] else None
    return None, nearest, near_rank[0], why, skipped, candidates, lengths


# Two letters (one of them 0xff, the sort order's edge) and short texts: texts are prefixes of the
# prompts, of each other, or diverge early, most of the time.
short_texts = st.lists(st.sampled_from(b"a\xff"), min_size=1, max_size=5).map(
    bytes
)  # b"" is in the tests above
prompt_texts = st.lists(st.sampled_from(b"a\xff"), max_size=8).map(bytes)
entry_specs = st.lists(
    st.tuples(
        short_texts, st.integers(0, 12), st.sampled_from([8, 16]), st.sampled_from([2, 4]), st.booleans()
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
# The longer prefix is filtered, the shorter one is the hit.
@example([(b"a", 10, 8, 2, True), (b"aa", 1, 8, 2, True)], set(), [b"aaa"], 5, None, None, False, True)
# A miss whose nearest entry is in a run of texts followed by one with more tokens.
@example([(b"aa", 1, 8, 2, True), (b"\xff", 10, 8, 2, True)], set(), [b"a\xff"], 0, None, None, False, True)
@given(
    specs=entry_specs,
    removed=st.sets(st.integers(0, 29), max_size=8),
    prompts=st.lists(prompt_texts, min_size=1, max_size=4),
    min_tokens=st.integers(0, 8),
    ctx=st.sampled_from([None, 8, 16]),
    quant=st.sampled_from([None, 2, 4]),
    reject=st.booleans(),
    verify_text=st.booleans(),
)
def test_lookup_matches_brute_force_reference(
    specs, removed, prompts, min_tokens, ctx, quant, reject, verify_text
) -> None:
    """Hit, miss explanation, counts and `get` equal the definition, for entries with and without texts.

    Texts nest and collide often;
    repeated texts (same name in several directories) exercise the tie rules; removing and
    re-adding entries exercises the structures' upkeep and the order ties fall back on.
    """
    from ds4_vllm.kvc.index import IndexEntry

    base = KvcHeader.new(quant_bits=2, reason=1, tokens=5, ctx_size=10, now=1)
    idx = CheckpointIndex("/nonexistent", verify_text=verify_text)
    for i, (text, tokens, ctx_size, q, keep) in enumerate(specs):
        sha = hashlib.sha1(text).hexdigest()
        p = Path(f"/x/{i}/{sha}.kv")
        header = dataclasses.replace(base, tokens=tokens, ctx_size=ctx_size, quant_bits=q)
        idx._entries[p] = IndexEntry(p, sha, header, len(text), 100, 0, text if keep else None)
    for i in sorted(removed):
        paths = list(idx._entries)
        if i < len(paths):
            entry = idx._entries.pop(paths[i])
            if i % 2:
                idx._entries[entry.path] = entry  # re-added: now last in order
    for prompt in prompts:
        res = idx.lookup(
            prompt, min_tokens=min_tokens, ctx_size=ctx, quant_bits=quant, reject_different_quant=reject
        )
        hit, nearest, diverge_at, why, skipped, candidates, lengths = reference_lookup(
            list(idx._entries.values()), prompt, min_tokens, ctx, quant, reject
        )
        assert res.hit is hit
        assert (res.nearest, res.diverge_at) == (nearest, diverge_at)
        assert (res.nearest_skip or "").split(":")[0] == (why or "")
        assert (res.skipped, res.candidates, res.hashed_lengths) == (skipped, candidates, lengths)
    for text, *_ in specs:
        sha = hashlib.sha1(text).hexdigest()
        assert idx.get(sha) is next((e for e in idx._entries.values() if e.sha1 == sha), None)


# ---------------------------------------------------------------- cheap rescans


def counting_scandir(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count directory listings and per-file stat calls the index makes."""
    import ds4_vllm.kvc.index as index_mod

    calls = {"listings": 0, "stats": 0}
    real_scandir = os.scandir

    class CountingEntry:
        def __init__(self, entry: os.DirEntry) -> None:
            self._entry = entry
            self.name, self.path = entry.name, entry.path

        def stat(self, *, follow_symlinks: bool = True):
            calls["stats"] += 1
            return self._entry.stat(follow_symlinks=follow_symlinks)

        def inode(self) -> int:
            return self._entry.inode()

        def is_file(self) -> bool:
            return self._entry.is_file()

    class CountingScandir:
        def __init__(self, path) -> None:
            calls["listings"] += 1
            self._it = real_scandir(path)

        def __iter__(self):
            return (CountingEntry(e) for e in self._it)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self._it.close()

    monkeypatch.setattr(index_mod.os, "scandir", CountingScandir)
    return calls


def test_unchanged_directory_rescan_reads_and_stats_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ds4_vllm.kvc.index as index_mod

    monkeypatch.setattr(index_mod, "DIR_SETTLE_NS", 0)  # this test's directory counts as settled at once
    files = [store(tmp_path, b"text %d" % i, tokens=3 + i) for i in range(5)]
    idx = index_of(tmp_path)
    calls = counting_scandir(monkeypatch)
    reads = []
    real = index_mod.read_prefix
    monkeypatch.setattr(index_mod, "read_prefix", lambda p, **kw: reads.append(Path(p).name) or real(p, **kw))

    assert idx.refresh(restat=False) == type(idx.refresh(restat=False))()
    assert (calls, reads) == ({"listings": 0, "stats": 0}, [])

    store(tmp_path, b"text 0", tokens=9)  # same name, replaced by rename: a new inode
    added = store(tmp_path, b"new text", tokens=4)
    stats = idx.refresh(restat=False)
    assert (stats.added, stats.changed, stats.removed) == (1, 1, 0)
    assert calls == {"listings": 1, "stats": 2} and sorted(reads) == sorted([files[0].name, added.name])
    assert idx.get(files[0].name[:40]).header.tokens == 9

    touch_checkpoint(files[1], now=2000)  # in place: the directory does not change
    assert idx.refresh(restat=False).changed == 0
    assert idx.refresh().changed == 1  # a full rescan stats every file and sees it
    assert calls == {"listings": 2, "stats": 2 + 6} and idx.get(files[1].name[:40]).header.hits == 1


def test_young_directory_is_listed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory changed within DIR_SETTLE_NS may change again within the same timestamp tick."""
    store(tmp_path, b"alpha", tokens=3)
    idx = index_of(tmp_path)
    calls = counting_scandir(monkeypatch)
    idx.refresh(restat=False)
    idx.refresh(restat=False)
    assert calls == {"listings": 2, "stats": 0}


def test_the_table_cannot_be_changed_behind_the_lookup_structures() -> None:
    """Issue 22: the table was a dict subclass whose update()/setdefault()/popitem() bypassed
    the sorted texts. It wraps a dict now: those methods do not exist."""
    from ds4_vllm.kvc.entry_table import EntryTable

    table = EntryTable(trust_text=True)
    for method in ("update", "setdefault", "popitem"):
        assert not hasattr(table, method), method


def test_an_excluded_whole_text_match_is_explained_as_set_aside(tmp_path: Path) -> None:
    """One filter rule for the search, the counts and the miss explanation."""
    f = store(tmp_path, PROMPT[:30], tokens=8)
    idx = index_of(tmp_path)
    res = idx.lookup(PROMPT, exclude={f})
    assert res.hit is None and res.skipped == {"set_aside": 1}
    assert res.nearest is not None and res.nearest.path == f and res.diverge_at == 30
    assert res.nearest_skip is not None and res.nearest_skip.startswith("set_aside")


def test_an_unreadable_file_is_read_again_at_the_next_refresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read error (EIO, a backend outage) is not the file's fault: it is not remembered."""
    import errno

    import ds4_vllm.kvc.index as index_mod

    f = store(tmp_path, PROMPT[:30], tokens=8)
    real = index_mod.read_prefix

    def failing(path, **kw):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(index_mod, "read_prefix", failing)
    idx = CheckpointIndex(tmp_path)
    idx.refresh()
    assert idx.invalid[f] == "unreadable: Input/output error" and len(idx) == 0
    monkeypatch.setattr(index_mod, "read_prefix", real)
    idx.refresh()
    assert len(idx) == 1 and f not in idx.invalid
