"""The store's real save/load/evict path as a killable process, and the checks made after a kill.

`run_workload` does what the connector does, minus vLLM: the scheduler side (`CheckpointStore`:
lookup, pin, admit, finish_write with its eviction pass, finish_load with its in-place touch)
on the main thread, and the worker side (`CheckpointWriter.write`, temp file + fsync + rename,
and `open_verified` loads) with a `WriteQueue` and a writer thread. Conversations grow turn by
turn, so lookups hit earlier turns and a small budget keeps eviction busy. Every payload is a
function of its tokens (`expected_payload`), so a file found after a crash can be compared
byte for byte with what was meant to be written.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np

from ds4_vllm.kvc import KvcFormatError, open_checkpoint
from ds4_vllm.kvc.constants import TMP_MARKER
from ds4_vllm.store import CheckpointStore, CheckpointWriter, LoadReport, WriteQueue
from ds4_vllm.store.records import LoadFailure
from tests.store.store_helpers import WIDE, header, opts, payload, text_of, toks

#: Tokens of a conversation's first turn, and what each later turn adds.
FIRST_TURN = 40
TURN_GROWTH = 24
CONVERSATIONS = 6


def conversation_tokens(conversation: int, turn: int) -> list[int]:
    """Turn `turn` of `conversation`: the previous turn's tokens plus TURN_GROWTH more."""
    n = FIRST_TURN + TURN_GROWTH * turn
    return [conversation * 7 + 1] + toks(n - 1, start=conversation * 11)


def expected_payload(tokens: list[int]):
    """The payload the workload writes for `tokens` (seeded by the tokens, so checkers can rebuild it)."""
    return payload(tokens, dims=WIDE, seed=len(tokens) * 1000 + int(tokens[0]))


def workload_store(directory: Path, budget_mb: int, **kw) -> CheckpointStore:
    return CheckpointStore(opts(directory, disk_space_mb=budget_mb), model_dims=WIDE, **kw)


def run_workload(directory: Path, budget_mb: int, seed: int, events_fd: int | None = None) -> None:
    """Save, load and evict forever (until killed).

    Reports to `events_fd`, one byte each: `r` once the store is open, `l` per load verified
    from a file, `s` per file written, `e` per file evicted.
    """
    rng = np.random.default_rng(seed)
    store = workload_store(directory, budget_mb, refresh_interval_s=0.0).open()
    writer = CheckpointWriter(store.fs, WIDE)
    queue = WriteQueue(max_bytes=256 << 10, wait_s=30.0)  # one write in flight, as a busy server has
    reports: list = []
    lock = threading.Lock()

    def write_loop() -> None:
        while (taken := queue.take()) is not None:
            _, (ticket, text, tokens) = taken
            report = writer.write(ticket, text, header(len(tokens)), expected_payload(tokens))
            with lock:
                reports.append(report)
            queue.done(ticket.sha1)

    def event(kind: bytes) -> None:
        if events_fd is not None and kind:
            os.write(events_fd, kind)

    threading.Thread(target=write_loop, daemon=True).start()
    event(b"r")
    turns = [0] * CONVERSATIONS
    while True:
        conversation = int(rng.integers(CONVERSATIONS))
        tokens = conversation_tokens(conversation, turns[conversation])
        turns[conversation] = (turns[conversation] + 1) % 8
        text = text_of(tokens)
        outcome = store.lookup(text, tokens, None, 2)
        if outcome.hit and not outcome.in_flight:
            store.pin(outcome.path)
            try:
                with writer.open_verified(outcome) as ck:
                    assert np.array_equal(ck.payload.logits, expected_payload(list(ck.payload.tokens)).logits)
                report = LoadReport(outcome.path, True)
                event(b"l")
            except LoadFailure as exc:  # evicted by another process meanwhile
                report = LoadReport(outcome.path, False, exc.reason, exc.corrupt)
            store.finish_load(outcome, report)
            store.unpin(outcome.path)
        admission = store.admit(text, tokens, header(len(tokens)), _file_size(store, text, tokens))
        event(b"e" * len(admission.evicted))
        if admission.ticket is not None:
            queue.put(admission.ticket.sha1, admission.ticket.file_size, (admission.ticket, text, tokens))
        with lock:
            done, reports[:] = list(reports), []
        for report in done:
            evicted, nested = store.finish_write(report)
            event(b"s" * report.stored + b"e" * (len(evicted) + len(nested)))


def _file_size(store: CheckpointStore, text: bytes, tokens: list[int]) -> int:
    p = expected_payload(tokens)
    from ds4_vllm.kvc import payload_size

    return store.file_size(len(text), payload_size(p.header, p.n_comp, p.n_index_comp))


def temp_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if TMP_MARKER in p.name)


def check_every_file(directory: Path) -> int:
    """Open every `<sha1>.kv` as a loader would and compare it with what was meant; returns the count.

    Raises AssertionError naming the file when one is partial, corrupt or holds other bytes.
    """
    count = 0
    for path in sorted(directory.glob("*.kv")):
        try:
            with open_checkpoint(path, check_name=True) as ck:
                tokens = [int(t) for t in ck.payload.tokens]
                want = expected_payload(tokens)
                assert ck.header.tokens == len(tokens), path
                assert np.array_equal(ck.payload.logits, want.logits), f"{path}: logits differ"
                for got, exp in zip(ck.payload.layers, want.layers, strict=True):
                    for name in exp.__dataclass_fields__:
                        a, b = getattr(got, name), getattr(exp, name)
                        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), (
                            f"{path}: layer array {name} differs"
                        )
                assert bytes(ck.text) == text_of(tokens), f"{path}: text is not its tokens' text"
        except KvcFormatError as exc:
            raise AssertionError(f"partial or corrupt checkpoint left after a crash: {path}: {exc}") from exc
        count += 1
    return count


def kv_bytes(directory: Path) -> tuple[int, int]:
    """(bytes of `*.kv` files, bytes of every file including temp files) in the top level.

    A scan is not a snapshot: a temp file renamed to its `.kv` name while the scan runs can be
    listed under both names. Files are counted once by inode, so such a file counts once (as the
    `.kv` file when the scan saw that name).
    """
    kv = total = 0
    seen: dict[int, tuple[int, bool]] = {}  # inode -> (size, listed as .kv)
    with os.scandir(directory) as it:
        for entry in it:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            size, was_kv = seen.get(st.st_ino, (st.st_size, False))
            seen[st.st_ino] = (max(size, st.st_size), was_kv or entry.name.endswith(".kv"))
    for size, is_kv in seen.values():
        total += size
        if is_kv:
            kv += size
    return kv, total
