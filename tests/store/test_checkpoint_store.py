"""CheckpointStore with real files: lookup, load checks, store, budget, quarantine, failures."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from ds4_vllm.kvc import ModelDims, SaveReason, read_prefix
from ds4_vllm.store import CheckpointWriter, LoadFailure, LoadReport, LookupOutcome
from ds4_vllm.store.checkpoint_store import CheckpointStore
from ds4_vllm.store.options import StoreConfigError
from tests.store.store_helpers import NOW, WIDE, header, opts, payload, put, text_of, toks


def open_store(directory: Path | str, **kw) -> CheckpointStore:
    return CheckpointStore(opts(directory, **kw), clock=lambda: NOW + 60, fsync=False).open()


def lookup(store: CheckpointStore, tokens: list[int], *, ctx: int = 4096, quant: int = 2):
    return store.lookup(text_of(tokens), tokens, ctx, quant)


def open_for_load(store: CheckpointStore, out: LookupOutcome):
    """What the connector's worker does (verified open), with the result reported to the store."""
    try:
        return CheckpointWriter(store.fs, store.model_dims).open_verified(out)
    except LoadFailure as exc:
        store.finish_load(out, LoadReport(exc.path, False, exc.reason, exc.corrupt))
        raise


def record_hit(store: CheckpointStore, out: LookupOutcome, seconds: float = 0.0) -> None:
    store.finish_load(out, LoadReport(out.path, True, seconds=seconds))


def test_longest_prefix_wins_among_many(tmp_path: Path) -> None:
    prompt = toks(60)
    for n in (10, 20, 30, 40):
        put(tmp_path, prompt[:n])
    for k in range(5):
        put(tmp_path, toks(45, start=k + 7))  # unrelated conversations
    store = open_store(tmp_path)
    out = lookup(store, prompt)
    assert out.hit and out.entry_tokens == 40 and out.agreed_tokens == 40 and out.reason is None
    assert out.text_bytes == 80 and Path(out.path).name == f"{out.sha1}.kv"


def test_no_entry_and_divergence_reasons(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert lookup(store, toks(30)).reason == "no entry"
    put(tmp_path, toks(20))
    other = toks(10) + toks(20, start=30)
    out = lookup(store, other)  # the index sees the new file: the directory changed
    assert not out.hit and out.reason.startswith("text diverges at byte 20 from the nearest entry")


def test_lookups_say_how_much_text_a_known_checkpoint_shares(tmp_path: Path) -> None:
    """Issue 21: where a prompt parts from the known checkpoint it agrees with longest, on a hit
    (past the hit) and on a miss, counting checkpoints still being written."""
    store = open_store(tmp_path)
    shared = toks(30)
    put(tmp_path, shared[:10])  # a short prefix both prompts have
    put(tmp_path, shared + toks(10, start=50))  # another folder's prompt: parts at token 30
    mine = shared + toks(10, start=20)
    out = lookup(store, mine)
    assert out.hit and out.entry_tokens == 10 and out.shared_bytes == 60  # 2 bytes per token
    assert lookup(store, toks(30, start=5)).shared_bytes == 0
    ticket = store.admit(text_of(toks(40, start=3)), toks(40, start=3), header(40), 4096)
    assert ticket is not None
    assert lookup(store, toks(25, start=3) + toks(5)).shared_bytes == 50  # the write in flight


@pytest.mark.parametrize(
    ("file_kw", "lookup_kw", "store_kw", "reason"),
    [
        ({}, {}, {"min_tokens": 25}, "under the minimum"),
        ({"ctx_size": 8192}, {"ctx": 4096}, {}, "context size"),
        ({"quant_bits": 4}, {"quant": 2}, {"reject_different_quant": True}, "quant"),
    ],
)
def test_filters(tmp_path: Path, file_kw: dict, lookup_kw: dict, store_kw: dict, reason: str) -> None:
    put(tmp_path, toks(20), **file_kw)
    store = open_store(tmp_path, **store_kw)
    out = lookup(store, toks(30), **lookup_kw)
    assert not out.hit and out.reason.startswith(reason + ":")


def test_cross_quant_accepted_by_default(tmp_path: Path) -> None:
    put(tmp_path, toks(20), quant_bits=4)
    assert lookup(open_store(tmp_path), toks(30), quant=2).hit


def test_token_mismatch_reports_agreeing_part(tmp_path: Path) -> None:
    prompt = toks(40)
    stored = list(prompt[:30])
    stored[12] = 63  # same text, different tokenization from token 12 on
    put(tmp_path, stored, text=text_of(prompt[:30]))
    out = lookup(open_store(tmp_path), prompt)
    assert out.hit and out.entry_tokens == 30 and out.agreed_tokens == 12
    assert out.reason == "token mismatch at token 12 of 30 (the text matches; file id 63, prompt id 13)"
    stored[3] = 63
    put(tmp_path, stored, text=text_of(prompt[:30]))
    out = lookup(open_store(tmp_path), prompt)
    assert not out.hit and out.reason == (
        "token mismatch at token 3 of 30 (the text matches; file id 63, prompt id 4), under the minimum 8"
    )


def corrupt_payload(path: Path) -> None:
    text_bytes = read_prefix(path).text_bytes
    with open(path, "r+b") as fp:
        fp.seek(52 + text_bytes)
        fp.write(b"XXXX")  # payload magic


def warnings_about(caplog, words: str) -> int:
    """Warning lines mentioning ``words`` (INFO lines name paths, which hold the test's name)."""
    return sum(r.levelno >= logging.WARNING and words in r.message for r in caplog.records)


def test_corrupt_file_quarantined_once_and_next_entry_used(tmp_path: Path, caplog) -> None:
    prompt = toks(60)
    short = put(tmp_path, prompt[:20])
    long = put(tmp_path, prompt[:40])
    corrupt_payload(long)
    store = open_store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ds4_vllm.store"):
        out = lookup(store, prompt)
        again = lookup(store, prompt)
    assert out.hit and out.path == str(short) and again.path == str(short)
    assert not long.exists() and (tmp_path / "quarantine" / long.name).exists()
    assert warnings_about(caplog, "quarantined") == 1
    assert store.stats.files_quarantined == 1


def test_corrupt_only_entry_gives_a_miss(tmp_path: Path) -> None:
    corrupt_payload(put(tmp_path, toks(20)))
    out = lookup(open_store(tmp_path), toks(30))
    assert not out.hit and out.reason == "no entry"


def test_invalid_header_is_ignored_not_moved(tmp_path: Path, caplog) -> None:
    bad = tmp_path / ("0" * 40 + ".kv")
    bad.write_bytes(b"not a checkpoint at all, but long enough to have a header......")
    with caplog.at_level(logging.WARNING, logger="ds4_vllm.store"):
        store = open_store(tmp_path)
        lookup(store, toks(30))
        store.evict()
    assert bad.exists()  # ds4 leaves such files alone; they may be another engine's version
    assert warnings_about(caplog, "ignoring invalid file") == 1


def test_file_removed_between_lookup_and_load(tmp_path: Path) -> None:
    path = put(tmp_path, toks(20))
    store = open_store(tmp_path)
    out = lookup(store, toks(30))
    os.unlink(path)
    with pytest.raises(LoadFailure, match="file removed by another process"):
        open_for_load(store, out)
    assert store.stats.failures == 1


def test_file_changed_since_lookup(tmp_path: Path) -> None:
    prompt = toks(30)
    put(tmp_path, prompt[:20])
    store = open_store(tmp_path)
    out = lookup(store, prompt)
    changed = list(prompt[:20])
    changed[5] = 63
    put(tmp_path, changed, text=text_of(prompt[:20]))  # same name, other tokens
    with pytest.raises(LoadFailure, match="replaced since the lookup"):
        open_for_load(store, out)


def test_store_lookup_load_hit_roundtrip(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    prompt = toks(50)
    res = store.store(text_of(prompt[:32]), header(32, reason=SaveReason.COLD), payload(prompt[:32]))
    assert res.stored and res.reason == "cold" and Path(res.path).exists()
    out = lookup(store, prompt)
    assert out.hit and out.agreed_tokens == 32
    with open_for_load(store, out) as ck:
        assert list(ck.payload.tokens) == prompt[:32]
    record_hit(store, out, seconds=0.01)
    assert read_prefix(res.path).header.hits == 1
    assert read_prefix(res.path).header.last_used == NOW + 60
    s = store.stats
    assert (s.hits, s.tokens_loaded, s.stores, s.bytes_read) == (1, 32, 1, out.file_size)
    assert s.load_seconds == 0.01  # the worker's time, counted where the hit is
    assert s.bytes_written == Path(res.path).stat().st_size


def test_same_text_is_not_rewritten(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    t = toks(20)
    first = store.store(text_of(t), header(20), payload(t))
    second = store.store(text_of(t), header(20), payload(t))
    assert first.stored and not second.stored and second.reason == "already stored"
    assert second.path == first.path


def test_unusable_directory_stops_startup(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(StoreConfigError, match="--kv-disk-dir / kv_disk_dir: cannot use .*not a directory"):
        open_store(blocker / "cache")


@pytest.mark.parametrize(
    ("err", "reason"),
    [(errno.ENOSPC, "disk full (ENOSPC)"), (errno.EACCES, "permission denied (EACCES)")],
)
def test_write_failure_is_a_skipped_store_logged_once(
    tmp_path: Path, caplog, monkeypatch, err: int, reason: str
) -> None:
    store = open_store(tmp_path)

    def failing_open(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    t = toks(20)
    with caplog.at_level(logging.WARNING, logger="ds4_vllm.store"), monkeypatch.context() as m:
        m.setattr(os, "open", failing_open)  # the temp-file creation inside write_checkpoint
        results = [store.store(text_of(t), header(20), payload(t)) for _ in range(3)]
    assert [r.stored for r in results] == [False] * 3 and results[0].reason == reason
    assert warnings_about(caplog, "store failed") == 1
    assert store.stats.failures == 3 and list(tmp_path.glob("*.kv")) == []


def test_no_free_space_skips_the_write(tmp_path: Path, monkeypatch) -> None:
    store = open_store(tmp_path)
    monkeypatch.setattr(store.fs, "free_bytes", lambda: 100)
    t = toks(20)
    res = store.store(text_of(t), header(20), payload(t))
    assert not res.stored and res.reason.startswith("disk full")


def test_file_larger_than_budget_is_not_written(tmp_path: Path) -> None:
    store = open_store(tmp_path, disk_space_mb=1)
    t = toks(20)
    big = payload(t, dims=ModelDims(n_layer=5, head_dim=8, index_dim=4, n_vocab=300_000))
    res = store.store(text_of(t), header(20), big)
    assert not res.stored and "exceeds budget 1 MiB" in res.reason
    assert store.store(text_of(t), header(20), payload(t, dims=WIDE)).stored


def test_eviction_protects_new_file_and_respects_pins(tmp_path: Path) -> None:
    store = open_store(tmp_path, disk_space_mb=1)
    paths = []
    for k in range(8):
        t = toks(20, start=k * 3)
        res = store.store(text_of(t), header(20), payload(t, dims=WIDE))
        assert res.stored and Path(res.path).exists()
        paths.append(res.path)
        if k == 0:
            store.pin(res.path)
        assert sum(e.file_size for e in store.entries()) <= 1024 * 1024
    assert Path(paths[0]).exists()  # pinned: a load is pending
    assert store.stats.files_evicted >= 3
    store.unpin(paths[0])


def test_nested_files_of_one_conversation_are_not_kept_twice(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    t = toks(60)

    def save(n: int, reason: SaveReason, conv: str):
        return store.store(text_of(t[:n]), header(n, reason=reason), payload(t[:n]), conversation_key=conv)

    cold = save(10, SaveReason.COLD, "a")
    c20 = save(20, SaveReason.CONTINUED, "a")
    other = save(25, SaveReason.CONTINUED, "b")  # another conversation's file
    used = save(30, SaveReason.CONTINUED, "a")
    assert not Path(c20.path).exists() and used.deduplicated == (c20.path,)
    record_hit(store, lookup(store, t[:31]))  # the 30-token file now has a hit
    final = save(40, SaveReason.EVICT, "a")
    assert Path(cold.path).exists()  # cold files are shared anchors
    assert Path(other.path).exists() and Path(used.path).exists() and final.deduplicated == ()
    assert store.stats.files_deduplicated == 1


def test_other_processes_changes_are_seen(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    prompt = toks(40)
    assert not lookup(store, prompt).hit
    path = put(tmp_path, prompt[:30])
    assert lookup(store, prompt).hit
    os.unlink(path)
    assert not lookup(store, prompt).hit


def test_memory_url_roundtrip() -> None:
    import fsspec

    url = "memory://ds4-store-test"
    fs = fsspec.filesystem("memory")
    if fs.exists("/ds4-store-test"):
        fs.rm("/ds4-store-test", recursive=True)
    store = CheckpointStore(opts(url), clock=lambda: NOW + 60, refresh_interval_s=0).open()
    prompt = toks(50)
    res = store.store(text_of(prompt[:32]), header(32), payload(prompt[:32]))
    assert res.stored and fs.exists(res.path)
    out = lookup(store, prompt)
    assert out.hit and out.agreed_tokens == 32
    with open_for_load(store, out) as ck:
        assert list(ck.payload.tokens) == prompt[:32]
    record_hit(store, out)
    assert store.entries()[0].header.hits == 1
    # corrupt remote file: quarantined, then a miss
    data = bytearray(fs.cat_file(res.path))
    data[52 + 64 : 52 + 68] = b"XXXX"
    fs.pipe_file(res.path, bytes(data))
    assert not lookup(store, prompt).hit
    assert fs.exists(f"/ds4-store-test/quarantine/{Path(res.path).name}")


def test_file_of_another_model_shape_is_a_miss_and_kept(tmp_path: Path) -> None:
    path = put(tmp_path, toks(20))
    other = ModelDims(n_layer=5, head_dim=16, index_dim=4, n_vocab=64)
    store = CheckpointStore(opts(tmp_path), model_dims=other, fsync=False).open()
    out = lookup(store, toks(30))
    assert not out.hit and "another model shape" in out.reason and path.exists()


def test_close_releases_the_reservations_of_unreported_writes(tmp_path: Path) -> None:
    """A stop after a write's admission leaves no reservation file (it did, for the next start to clean)."""
    store = open_store(tmp_path)
    admission = store.admit(text_of(toks(30)), toks(30), header(30), store.file_size(60, 4096))
    assert admission.ticket is not None
    report = CheckpointWriter(store.fs, None).write(
        admission.ticket, text_of(toks(30)), header(30), payload(toks(30))
    )
    assert report.stored and [p.name for p in tmp_path.glob("*.kv.tmp.*")] != []
    store.close()  # the engine stops before the write's report reaches the scheduler
    assert [p.name for p in tmp_path.glob("*.kv.tmp.*")] == []
    assert [p.name for p in tmp_path.glob("*.kv")] == [Path(report.path).name]
