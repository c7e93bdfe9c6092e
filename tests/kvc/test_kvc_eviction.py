"""ds4's eviction score and victim order (spec §5.5), from tables and as properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds4_vllm.store.eviction import EvictionEntry, effective_hits, eviction_score, plan_eviction

NOW = 1_800_000_000
H = 21600


def entry(
    path: str,
    size: int = 1000,
    tokens: int = 100,
    hits: int = 0,
    created: int = NOW - 10,
    used: int = NOW - 10,
):
    return EvictionEntry(path, size, tokens, hits, created, used)


@pytest.mark.parametrize(
    ("hits", "last_used", "created", "expected"),
    [
        (4, NOW - H, NOW - 99 * H, 2.0),  # one half-life
        (4, NOW - 2 * H, 0, 1.0),
        (4, 0, NOW - H, 2.0),  # never used: decays from creation
        (4, 0, 0, 0.0),  # no time at all
        (4, NOW, NOW, 4.0),  # now == used_at: no decay
        (4, NOW + 50, NOW, 4.0),  # clock skew: no decay
        (1, NOW - 7 * H, NOW - 7 * H, 0.0),  # 1/128 < 0.01 -> 0
        (1, NOW - 6 * H, NOW - 6 * H, 1 / 64),
    ],
)
def test_effective_hits(hits: int, last_used: int, created: int, expected: float) -> None:
    assert effective_hits(hits, last_used, created, NOW) == expected


def test_score() -> None:
    assert eviction_score(entry("a", size=1000, tokens=100, hits=0), NOW) == 0.1
    assert eviction_score(entry("a", size=1000, tokens=100, hits=2, used=NOW - H), NOW) == 0.2
    assert eviction_score(entry("a", size=0), NOW) == 0.0
    assert eviction_score(entry("a"), NOW, protected=True) == math.inf


def test_plan_order_and_strict_budget() -> None:
    cheap = entry("cheap", size=1000, tokens=10)  # 0.01 tokens/byte
    dense = entry("dense", size=1000, tokens=500)
    hit = entry("hit", size=1000, tokens=10, hits=100, used=NOW)
    old_tie = entry("old", size=1000, tokens=10, used=NOW - 100)
    victims = plan_eviction([cheap, dense, hit, old_tie], budget_bytes=2000, now=NOW)
    assert [v.path for v in victims] == ["old", "cheap"]
    assert plan_eviction([cheap, dense], budget_bytes=2000, now=NOW) == []  # total == budget: keep all
    assert [v.path for v in plan_eviction([cheap, dense], budget_bytes=1999, now=NOW)] == ["cheap"]


def test_protected_kept_unless_alone_too_big() -> None:
    new = entry("new", size=1500, tokens=1)
    other = entry("other", size=1000, tokens=900)
    assert [v.path for v in plan_eviction([new, other], 2000, NOW, protected_path="new")] == ["other"]
    assert [v.path for v in plan_eviction([new, other], 2000, NOW)] == ["new"]
    # protected file alone exceeds the budget: protection dropped, scored normally
    huge = entry("huge", size=5000, tokens=4000)
    victims = plan_eviction([huge, other], 2000, NOW, protected_path="huge")
    assert [v.path for v in victims] == ["huge"]


entries = st.lists(
    st.builds(
        EvictionEntry,
        path=st.text("abcdef", min_size=1, max_size=6),
        file_size=st.integers(0, 10_000),
        tokens=st.integers(1, 5000),
        hits=st.integers(0, 50),
        created_at=st.integers(0, NOW),
        last_used=st.integers(0, NOW + 100),
    ),
    max_size=30,
    unique_by=lambda e: e.path,
)


@given(entries, st.integers(0, 100_000), st.data())
def test_plan_properties(items, budget, data) -> None:
    protected = data.draw(st.sampled_from([None] + [e.path for e in items]))
    victims = plan_eviction(items, budget, NOW, protected_path=protected)
    kept = sum(e.file_size for e in items) - sum(v.file_size for v in victims)
    prot = [e for e in items if e.path == protected]
    if prot and prot[0].file_size <= budget:
        assert prot[0] not in victims
    assert kept <= budget or not victims or len(victims) == len(items) - len(prot)
    if victims:  # the last victim was needed: total was still over budget before it went
        assert kept + victims[-1].file_size > budget
    scores = [eviction_score(v, NOW) for v in victims]
    assert scores == sorted(scores) or any(v.path == protected for v in victims)
