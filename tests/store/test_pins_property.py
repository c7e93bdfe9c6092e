"""Issue 7: the scheduler side (store) and the worker side (writer) under random interleavings.

A hypothesis state machine plays both halves of the connector on one small-budget directory:
lookups that pin what they chose, admissions, background writes reported late, loads,
eviction passes and nested copies of one conversation. Whatever the order:
- a pinned file is never removed before its load ends;
- the files never exceed the budget by more than one file (a write lands before its report);
- every load either gets exactly the state the lookup chose or fails cleanly.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ds4_vllm.store import CheckpointWriter, LoadFailure, LoadReport, tokens_digest
from ds4_vllm.store.checkpoint_store import CheckpointStore
from ds4_vllm.store.eviction import MIB
from tests.store.store_helpers import NOW, WIDE, header, opts, payload, text_of, toks

BUDGET_MB = 1


class StoreAndWriter(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="ds4-pins-")
        self.dir = self._tmp.name
        self.store = CheckpointStore(
            opts(self.dir, disk_space_mb=BUDGET_MB), clock=lambda: NOW, refresh_interval_s=0, fsync=False
        ).open()
        self.writer = CheckpointWriter(self.store.fs, WIDE)  # the worker's own instance
        self.admitted: list = []  # (ticket, tokens) not yet written
        self.written: list = []  # reports not yet delivered to the store
        self.loads: list = []  # pinned outcomes, load not yet ended
        self.pinned_seen: dict[str, bool] = {}  # pinned path -> existed at some point since pinning
        self.largest = 0

    def teardown(self) -> None:
        self._tmp.cleanup()

    def _files(self) -> dict[str, int]:
        import os

        out = {}
        for name in os.listdir(self.dir):
            if name.endswith(".kv"):
                out[os.path.join(self.dir, name)] = os.path.getsize(os.path.join(self.dir, name))
        return out

    @rule(n=st.integers(8, 60), start=st.integers(0, 6), conversation=st.sampled_from(["a", "b", None]))
    def admit(self, n, start, conversation):
        t = toks(n, start=start)
        p = payload(t, dims=WIDE)
        from ds4_vllm.kvc import payload_size

        size = self.store.file_size(len(text_of(t)), payload_size(p.header, p.n_comp, p.n_index_comp))
        admission = self.store.admit(text_of(t), t, header(n), size, conversation_key=conversation)
        if admission.ticket is not None:
            self.admitted.append((admission.ticket, t))

    @precondition(lambda self: self.admitted)
    @rule(i=st.integers(0, 100))
    def write(self, i):
        ticket, t = self.admitted.pop(i % len(self.admitted))
        report = self.writer.write(ticket, text_of(t), header(len(t)), payload(t, dims=WIDE))
        assert report.stored
        self.largest = max(self.largest, report.file_size)
        self.written.append(report)

    @precondition(lambda self: self.written)
    @rule(i=st.integers(0, 100))
    def report(self, i):
        self.store.finish_write(self.written.pop(i % len(self.written)))

    @rule(n=st.integers(8, 70), start=st.integers(0, 6))
    def lookup_and_pin(self, n, start):
        t = toks(n, start=start)
        out = self.store.lookup(text_of(t), t, 4096, 2)
        if out.hit:
            self.store.pin(out.path)
            self.loads.append((out, t))
            self.pinned_seen.setdefault(out.path, False)

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 100))
    def load(self, i):
        out, t = self.loads.pop(i % len(self.loads))
        try:
            with self.writer.open_verified(out) as ck:
                assert tokens_digest(ck.payload.tokens[: out.agreed_tokens]) == out.tokens_digest
                assert [int(x) for x in ck.payload.tokens[: out.agreed_tokens]] == t[: out.agreed_tokens]
            report = LoadReport(out.path, True)
        except LoadFailure as exc:
            # Only an in-flight checkpoint whose write has not landed yet may be missing.
            assert out.in_flight and "removed" in exc.reason, exc.reason
            report = LoadReport(out.path, False, exc.reason)
        self.store.finish_load(out, report)
        self.store.unpin(out.path)
        if out.path not in self.store.pinned:
            self.pinned_seen.pop(out.path, None)

    @rule()
    def evict(self):
        self.store.evict()

    @invariant()
    def pinned_files_stay(self):
        files = self._files()
        for path, seen in list(self.pinned_seen.items()):
            if path in files:
                self.pinned_seen[path] = True
            else:
                assert not seen, f"pinned file {path} was removed"

    @invariant()
    def budget_holds_within_one_file(self):
        assert sum(self._files().values()) <= BUDGET_MB * MIB + self.largest


TestStoreAndWriter = StoreAndWriter.TestCase
TestStoreAndWriter.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
