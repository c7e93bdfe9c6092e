"""Budget properties: after a store the valid files fit the budget, and the new file survives."""

from __future__ import annotations

import uuid

import fsspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4_vllm.store import LoadReport
from ds4_vllm.store.checkpoint_store import CheckpointStore
from ds4_vllm.store.eviction import MIB, EvictionEntry, plan_eviction
from tests.store.store_helpers import NOW, WIDE, header, opts, payload, text_of, toks

entry = st.builds(
    EvictionEntry,
    path=st.uuids().map(str),
    file_size=st.integers(1, 5000),
    tokens=st.integers(1, 50_000),
    hits=st.integers(0, 20),
    created_at=st.integers(NOW - 86_400, NOW),
    last_used=st.integers(0, NOW),
)


@given(st.lists(entry, max_size=30), st.integers(1, 40_000), st.integers(0, 29))
def test_plan_fits_budget_and_keeps_protected(entries, budget, protect_at) -> None:
    protected = entries[protect_at].path if protect_at < len(entries) else None
    victims = plan_eviction(entries, budget, NOW, protected)
    left = sum(e.file_size for e in entries) - sum(v.file_size for v in victims)
    assert left <= budget
    prot = [e for e in entries if e.path == protected]
    if prot and prot[0].file_size <= budget:
        assert all(v.path != protected for v in victims)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(8, 60), st.integers(0, 50), st.booleans()), min_size=1, max_size=10))
def test_store_never_leaves_directory_over_budget(ops) -> None:
    root = f"/prop-{uuid.uuid4().hex}"
    url = f"memory://{root}"
    store = CheckpointStore(opts(url, disk_space_mb=1), clock=lambda: NOW, refresh_interval_s=0).open()
    try:
        for n, start, hit in ops:
            t = toks(n, start=start)
            res = store.store(text_of(t), header(n), payload(t, dims=WIDE))
            sizes = {str(e.path): e.file_size for e in store.entries()}
            assert sum(sizes.values()) <= 1 * MIB
            if res.path is not None:
                assert res.path in sizes  # the file just written is never the victim
            if hit and res.path is not None:
                out = store.lookup(text_of(t), t, 4096, 2)
                if out.hit:
                    store.finish_load(out, LoadReport(out.path, True))
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)
